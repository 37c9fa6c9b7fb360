#!/usr/bin/env bash
# One lease of the H200 for the Super-widths runs (README "Super widths"): after the staging calls, this starts the
# whole pipeline in the background and returns; later calls poll it with `super_session.sh poll`.
#   bash benchmarks/h200_main_ppo/super_session.sh start "MODES" [extra run.py args]   (installs, then setsid)
#   bash benchmarks/h200_main_ppo/super_session.sh poll                                   (copies logs to $OUT)
# Pipeline: install (verl stack: .h200/device_install.sh; TE stack: /tmp/te/te_on_h200.sh), super_assets.py
# (pretraining on this GPU, seeded), then run.py run --stack te for each mode, in that order, one at a time.
set -u
S=/tmp/sess
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_AUTOTUNING=1
case "${1:-}" in
start)
  mkdir -p $S
  bash .h200/device_install.sh > $S/install.log 2>&1 || { cat $S/install.log; exit 3; }
  bash /tmp/te/te_on_h200.sh > $S/te.log 2>&1 || { tail -30 $S/te.log; exit 4; }
  tail -3 $S/install.log; tail -3 $S/te.log
  MODES=${2:-online}; shift 2 || shift $#
  cat > $S/pipeline.sh <<PIPE
set -x
cd $PWD
date -u +%FT%TZ > $S/t_start
[ -f /tmp/super/assets.json ] || python3 benchmarks/h200_main_ppo/super_assets.py /tmp/super ${SUPER_ASSETS_ARGS:-} > $S/assets.log 2>&1 || exit 5
date -u +%FT%TZ > $S/t_assets
python3 benchmarks/h200_main_ppo/run.py run --stack te --assets /tmp/super --out $S/run --modes $MODES \
  --reward benchmarks/h200_main_ppo/reward_long.py $* > $S/driver.log 2>&1
date -u +%FT%TZ > $S/t_end
PIPE
  setsid nohup bash $S/pipeline.sh > $S/pipeline.log 2>&1 < /dev/null &
  echo "pipeline started: pid $!"
  ;;
poll)
  mkdir -p "$OUT/sess"
  for f in $S/*.log $S/t_* /tmp/super/assets.json $S/run/*.log $S/run/summary.json; do [ -f "$f" ] && cp "$f" "$OUT/sess/"; done
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  ls $S; tail -5 $S/assets.log 2>/dev/null; echo ---; tail -25 $S/driver.log 2>/dev/null
  ;;
*) echo "usage: super_session.sh start|poll"; exit 2 ;;
esac
