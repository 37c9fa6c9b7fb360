"""Run the GPU correctness tests (``pytest -q tests/gpu``), the online-mode DDP probe and, with two or more
GPUs, the two-rank parallelism checks (``pp2_tp2_parallel.py``); exit code = pytest's, else the latter's.

Run on a CUDA machine from the repository root: ``python tests/gpu/run_all.py``.
"""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def child_env(environ=None) -> dict:
    """The tests' environment: the repository and the CPU runtime (``cpu_runtime/``: the tiny builders and the
    Mamba Triton loader that ``tests/gpu/conftest.py`` and ``verl_mtp_plugin.testing`` import, not installed on a
    GPU image) ahead of the caller's ``PYTHONPATH``."""
    env = dict(os.environ if environ is None else environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.path.join(ROOT, "cpu_runtime"), env.get("PYTHONPATH"))
                                        if p)
    return env


def main() -> int:
    env = child_env()
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-rfEs", "-s", "-p", "no:cacheprovider", HERE], cwd=ROOT, env=env)
    probe = subprocess.call([sys.executable, os.path.join(HERE, "probe_online_skip_ddp.py")], cwd=ROOT, env=env)
    print(f"[run_all] pytest rc={rc} probe rc={probe}", flush=True)
    import torch

    if torch.cuda.device_count() >= 2:  # PP=2 / TP=2 / EP=2 checks on two GPUs
        par = subprocess.call([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               os.path.join(HERE, "pp2_tp2_parallel.py")], cwd=ROOT, env=env)
        print(f"[run_all] pp2_tp2_parallel rc={par}", flush=True)
        return rc or par
    print("[run_all] fewer than 2 GPUs: pp2_tp2_parallel.py not run", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
