"""Run the GPU correctness tests (``pytest -q tests/gpu``) and the online-mode DDP probe; exit code = pytest's.

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
    return rc


if __name__ == "__main__":
    sys.exit(main())
