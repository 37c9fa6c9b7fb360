#!/usr/bin/env bash
# verl's trainer on every mode's recipe (one after the other, into demo_out/all/<mode>/; a few minutes
# each on 2 cores), then the two deliberately broken syncs (each must stop with the desync guard's
# message, exit 2).
set -euo pipefail
cd "$(dirname "$0")/.."
./run verl-mtp demo --mode online,frozen,joint,off --steps "${STEPS:-10}" --out demo_out/all --no-progress
for brk in skip-drafter swap-eh; do
    if ./run verl-mtp demo --mode online --break-sync "$brk" --steps "${STEPS:-4}" --out "demo_out/break-$brk" --no-progress; then
        echo "--break-sync $brk: the desync guard did not stop the run" >&2
        exit 1
    fi
done
# vLLM's measured first-draft acceptance per step next to the trainer's estimate, per mode
./run python - <<'PY'
import json
rows = [json.loads(line) for line in open("demo_out/all/metrics.jsonl")]
for mode in ("online", "frozen", "joint"):
    mine = [r for r in rows if r["mode"] == mode]
    acc = " ".join(f"{r.get('rollout/spec_accept_rate_pos_0', float('nan')):.3f}" for r in mine)
    est = " ".join(f"{r['actor/mtp_argmax_draft_accept_rate']:.3f}" if "actor/mtp_argmax_draft_accept_rate" in r else "-" for r in mine)
    print(f"{mode:>7}: vLLM acceptance {acc} | trainer estimate {est}")
PY
echo "plot: demo_out/all/demo.png; raw numbers: demo_out/all/metrics.jsonl; each run's log: demo_out/all/<mode>/"
