#!/usr/bin/env bash
# Refresh CHECKOUT/.h200/src from this worktree (plugin, recipes, this folder, the benchmarks the device calls run:
# step_cost.py, rollout_speedup.py and the two modules it imports) before a device call.
set -euo pipefail
CO=$(cd "${1:?usage: sync_src.sh CHECKOUT}" && pwd)
SRC=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$CO/.h200/src/benchmarks"
BENCH="step_cost.py rollout_speedup.py acceptance_drift.py v2_drafter_sync.py"
rm -rf "$CO/.h200/src/verl_mtp_plugin" "$CO/.h200/src/verl_mtp_cpu" "$CO/.h200/src/recipes" "$CO/.h200/src/benchmarks/h200_main_ppo"
for f in $BENCH; do rm -f "$CO/.h200/src/benchmarks/$f"; done
cp -r "$SRC/verl_mtp_plugin" "$SRC/recipes" "$CO/.h200/src/"
cp -r "$SRC/cpu_runtime/verl_mtp_cpu" "$CO/.h200/src/"  # the CPU runtime's package (the stand-ins these runs import)
cp -r "$SRC/benchmarks/h200_main_ppo" "$CO/.h200/src/benchmarks/"
for f in $BENCH; do cp "$SRC/benchmarks/$f" "$CO/.h200/src/benchmarks/"; done
find "$CO/.h200/src" -name __pycache__ -prune -exec rm -rf {} +
cp "$SRC/benchmarks/h200_main_ppo/device_install.sh" "$CO/.h200/"
du -sh "$CO/.h200"
