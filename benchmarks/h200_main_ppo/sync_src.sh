#!/usr/bin/env bash
# Refresh CHECKOUT/.h200/src from this worktree (plugin, recipes, this folder, benchmarks/step_cost.py) before a
# device call.
set -euo pipefail
CO=$(cd "${1:?usage: sync_src.sh CHECKOUT}" && pwd)
SRC=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$CO/.h200/src/benchmarks"
rm -rf "$CO/.h200/src/verl_mtp_plugin" "$CO/.h200/src/recipes" "$CO/.h200/src/benchmarks/h200_main_ppo" \
  "$CO/.h200/src/benchmarks/step_cost.py"
cp -r "$SRC/verl_mtp_plugin" "$SRC/recipes" "$CO/.h200/src/"
cp -r "$SRC/benchmarks/h200_main_ppo" "$SRC/benchmarks/step_cost.py" "$CO/.h200/src/benchmarks/"
find "$CO/.h200/src" -name __pycache__ -prune -exec rm -rf {} +
cp "$SRC/benchmarks/h200_main_ppo/device_install.sh" "$CO/.h200/"
du -sh "$CO/.h200"
