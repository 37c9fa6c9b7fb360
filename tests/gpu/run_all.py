"""Run the GPU correctness tests (``pytest -q tests/gpu``), the online-mode DDP probe and, with two or more
GPUs, the two-rank parallelism checks (``pp2_tp2_parallel.py``); exit code = pytest's, else the latter's.

Run on a CUDA machine from the repository root: ``python tests/gpu/run_all.py``.
"""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def main() -> int:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
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
