#!/usr/bin/env bash
# Refresh CHECKOUT/.h200/src from this worktree before a device call (stage.sh does it when it stages for another
# checkout): the plugin and recipes (a link into its package), the CPU runtime's package verl_mtp_cpu (the stand-ins,
# events and harness run loop these runs import; in a checkout it is cpu_runtime/), every benchmarks/*.py (the
# drivers and the modules they import) and this folder. The calls then run `python3 .h200/src/benchmarks/...` with
# PYTHONPATH=.h200/src:/tmp/site.
set -euo pipefail
CO=$(cd "${1:?usage: sync_src.sh CHECKOUT}" && pwd)
SRC=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$CO/.h200/src"
mkdir -p "$CO/.h200/src/benchmarks"
cp -r "$SRC/verl_mtp_plugin" "$SRC/recipes" "$SRC/cpu_runtime/verl_mtp_cpu" "$CO/.h200/src/"
cp "$SRC"/benchmarks/*.py "$CO/.h200/src/benchmarks/"
cp -r "$SRC/benchmarks/h200_main_ppo" "$CO/.h200/src/benchmarks/"
find "$CO/.h200/src" -name __pycache__ -prune -exec rm -rf {} +
cp "$SRC/benchmarks/h200_main_ppo/device_install.sh" "$CO/.h200/"
du -sh "$CO/.h200"
