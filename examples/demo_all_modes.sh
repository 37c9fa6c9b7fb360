#!/usr/bin/env bash
# Run the demo in every mode, side by side, into demo_out/<mode>/ (CPU: under a minute per mode), then
# the two deliberately broken syncs (each must stop with the desync guard's message, exit 2).
set -euo pipefail
cd "$(dirname "$0")/.."
for mode in off frozen online joint; do
    ./run verl-mtp demo --mode "$mode" --steps "${STEPS:-6}" --out "demo_out/$mode" --no-progress
done
for brk in skip-drafter swap-eh; do
    if ./run verl-mtp demo --break-sync "$brk" --steps "${STEPS:-6}" --out "demo_out/break-$brk" --no-progress; then
        echo "--break-sync $brk: the desync guard did not stop the run" >&2
        exit 1
    fi
done
# vLLM's measured first-draft acceptance per step, frozen vs online (and joint)
./run python - <<'PY'
import json
for mode in ("frozen", "online", "joint"):
    rows = [json.loads(line) for line in open(f"demo_out/{mode}/metrics.jsonl")]
    acc = " ".join(f"{r['rollout/spec_accept_rate_pos_0']:.3f}" for r in rows)
    est = " ".join("-" if r["argmax_draft_accept_rate"] != r["argmax_draft_accept_rate"] else f"{r['argmax_draft_accept_rate']:.3f}" for r in rows)
    print(f"{mode:>7}: vLLM acceptance {acc} | trainer estimate {est}")
PY
echo "plots: demo_out/*/demo.png; raw numbers: demo_out/*/metrics.jsonl"
