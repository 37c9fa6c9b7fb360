"""Run the issue-6 GPU benchmarks in one process: P1 (log-prob phase cost), P2 (online training-step
overhead) and P4 (MTP sync throughput, on P2's online model). Results: one JSON per benchmark in
``$OUT`` (or ``benchmarks/results/``) and one summary line each on stdout.

Run: ``python benchmarks/gpu_bench_all.py [p1] [p2] [p4]`` (default: all three).
"""

from __future__ import annotations

import sys
import time

import gpu_common as C


def main(which=("p1", "p2", "p4")):
    t0 = time.time()
    C.setup()
    print("[env]", C.env_info(), flush=True)
    if "p1" in which:
        import gpu_phase_cost

        gpu_phase_cost.main()
        print(f"[time] after P1 {time.time() - t0:.0f} s", flush=True)
    model = None
    if "p2" in which:
        import gpu_train_overhead

        _, ctx = gpu_train_overhead.main(keep_online_model="p4" in which)
        model = ctx.get("model")
        print(f"[time] after P2 {time.time() - t0:.0f} s", flush=True)
    if "p4" in which:
        import gpu_sync_throughput

        gpu_sync_throughput.main(model)
        print(f"[time] after P4 {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main(tuple(a.lower() for a in sys.argv[1:]) or ("p1", "p2", "p4"))
