#!/usr/bin/env bash
# Run the demo in every mode, side by side, into demo_out/<mode>/ (CPU: about a minute per mode).
set -euo pipefail
cd "$(dirname "$0")/.."
for mode in off frozen online joint; do
    ./run verl-mtp demo --mode "$mode" --steps "${STEPS:-6}" --out "demo_out/$mode" --no-progress
done
echo "plots: demo_out/*/demo.png; raw numbers: demo_out/*/metrics.jsonl"
