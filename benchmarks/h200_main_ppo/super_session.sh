#!/usr/bin/env bash
# One lease of the H200 for the Super-widths runs (README "Super widths"): after the staging calls, this starts the
# whole pipeline in the background and returns; later calls poll it with `super_session.sh poll`.
#   bash benchmarks/h200_main_ppo/super_session.sh start "MODES" [extra run.py args]   (installs, then setsid)
#   bash benchmarks/h200_main_ppo/super_session.sh bench [SECONDS_LEFT]                     (installs, then setsid)
#   bash benchmarks/h200_main_ppo/super_session.sh drift [SECONDS_LEFT] [drift.py args]     (installs, then setsid)
#   bash benchmarks/h200_main_ppo/super_session.sh derisk [run.py args]                     (installs, then setsid)
#   bash benchmarks/h200_main_ppo/super_session.sh poll                                   (copies logs to $OUT)
#   bash benchmarks/h200_main_ppo/super_session.sh wait [SECONDS]                         (sleeps until the pipeline ends, then poll)
#   bash benchmarks/h200_main_ppo/super_session.sh cache                                  (compile caches and the causal_conv1d wheel to $OUT/cache; carry them back as .h200-cache)
#   bash benchmarks/h200_main_ppo/super_session.sh restore                                (a call carrying .h200-cache alone)
#   bash benchmarks/h200_main_ppo/super_session.sh prebuild                               (causal_conv1d in the background, after te_parts.py put .te-stage/t01)
# Pipeline: install (verl stack: .h200/device_install.sh; TE stack: /tmp/te/te_on_h200.sh), super_assets.py
# (pretraining on this GPU, seeded), then run.py run --stack te for each mode, in that order, one at a time.
# `bench` instead: super_assets.py --mtp-steps 0 (the drafter trained with the trunk on the policy's own mixture),
# then speculation.py rollout (every arm's engine in one process, interleaved; ROLLOUT_ARGS added last, e.g.
# "--arms 0,2,schedule") with what the lease has left (SECONDS_LEFT from the start call, default 1500, less 200 s),
# then phase_cost.py memory with recompute if 150 s remain, then tests/gpu/run_all.py if 120 s remain.
# `start` with LEASE_LEFT=<seconds the lease has left> runs the same two after the modes (after_main), and each mode
# stops 75 s before the lease's end whatever its --run-timeout (run.py --end), keeping its finished steps.
set -u
S=/tmp/sess
# the card in the results' names (the lending tool may start an H100 for a call that names no kind)
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o 'H[0-9]\+' | tr A-Z a-z)
CARD=${CARD:-gpu}
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_AUTOTUNING=1 \
  TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}   # one cache for every process (run.py: why)
# what this call carries in .h200-cache: the compile caches and the causal_conv1d wheel (`cache` returned them), and
# py-spy's wheel for spy_warmup.sh
# (its status: the archive's extraction)
restore_caches() {
  local rc=0
  if ls .h200-cache/cache.tgz.part* >/dev/null 2>&1; then
    cat .h200-cache/cache.tgz.part* | tar xzf - -C / || rc=$?
    [ $rc = 0 ] && echo "caches restored: $(du -sh $TRITON_CACHE_DIR /tmp/cc1d 2>/dev/null | tr '\n\t' '  ')"
  fi
  ls .h200-cache/py_spy-*.whl >/dev/null 2>&1 && python3 -m zipfile -e $(ls .h200-cache/py_spy-*.whl | head -1) /tmp/pyspy \
    && chmod +x /tmp/pyspy/py_spy-*.data/scripts/py-spy && echo "py-spy: $(/tmp/pyspy/py_spy-*.data/scripts/py-spy --version)"
  return $rc
}
install() {
  mkdir -p $S
  # once per machine: te_on_h200.sh rebuilds causal_conv1d on every call (~80 s on the H100)
  if [ -f $S/.installed ]; then echo "installed already on this machine"; return 0; fi
  restore_caches || echo "the carried caches did not extract (status $?): every kernel builds again"
  bash .h200/device_install.sh > $S/install.log 2>&1 || { cat $S/install.log; exit 3; }
  # a `prebuild` still building causal_conv1d in the background: its wheel, once there, replaces the build below
  # (at most 300 s: a build still running then is stopped and the build below runs instead; none when a carried
  # wheel is there already)
  if [ -f /tmp/cc1d.pid ] && [ ! -f /tmp/cc1d.rc ] && ! ls /tmp/cc1d/causal_conv1d-*.whl >/dev/null 2>&1; then
    echo "waiting for the causal_conv1d prebuild"
    for _ in $(seq 150); do { [ -f /tmp/cc1d.rc ] || ! kill -0 $(cat /tmp/cc1d.pid) 2>/dev/null; } && break; sleep 2; done
    if [ ! -f /tmp/cc1d.rc ]; then
      if kill -0 $(cat /tmp/cc1d.pid) 2>/dev/null; then
        kill -- -$(cat /tmp/cc1d.pid) 2>/dev/null; echo "causal_conv1d prebuild stopped after 300 s"
      else echo "causal_conv1d prebuild ended without a status"; fi
      rm -f /tmp/cc1d/causal_conv1d-*.whl
    fi
  fi
  [ -f /tmp/cc1d.rc ] && echo "causal_conv1d prebuild: status $(cat /tmp/cc1d.rc); $(tail -2 /tmp/cc1d.log | head -1)"
  # causal_conv1d built for sm_90 by an earlier lease (`cache` returns it in /tmp/cc1d): installed instead of the
  # shared tool's build (~71-80 s), the tool's other steps and its import check as they are
  TE=/tmp/te/te_on_h200.sh
  if ls /tmp/cc1d/causal_conv1d-*.whl >/dev/null 2>&1; then
    sed 's#^MAX_JOBS=16 env -u OUT bash $T/build_causal_conv1d.sh $S || exit 10$#python3 -m pip install -q --no-index --no-deps --target $S /tmp/cc1d/causal_conv1d-*.whl \&\& PYTHONPATH=$S python3 -c "import torch, causal_conv1d_cuda" || exit 10#' \
      $TE > /tmp/te/te_cached.sh
    grep -q /tmp/cc1d /tmp/te/te_cached.sh && TE=/tmp/te/te_cached.sh && echo "causal_conv1d: the cached wheel"
  fi
  bash $TE > $S/te.log 2>&1 || { tail -30 $S/te.log; exit 4; }
  tail -3 $S/install.log; tail -3 $S/te.log
  touch $S/.installed
}
# the pipeline's last lines: with the lease's time left after its main job (END: the lease's end in epoch seconds;
# 0: unknown, nothing more), peak memory per objective with recompute if 150 s remain, then the GPU invariants if 120 s
after_main() {
  cat <<TAIL
date -u +%FT%TZ > $S/t_run
[ $END -gt 0 ] && [ \$(( $END - \$(date +%s) )) -gt 150 ] && PYTHONPATH=$PWD:$PWD/cpu_runtime:/tmp/site \
  OUT=$S/mem python3 benchmarks/phase_cost.py memory --stack te --recompute full --tag ${CARD}_te_recompute \
  > $S/memory.log 2>&1
[ $END -gt 0 ] && [ \$(( $END - \$(date +%s) )) -gt 120 ] && timeout \$(( $END - \$(date +%s) - 30 )) \
  python3 tests/gpu/run_all.py > $S/gpu_tests.log 2>&1
date -u +%FT%TZ > $S/t_end
TAIL
}
# start $S/pipeline.sh in the background: a warm machine's earlier pipeline leaves its t_* and failed files, which
# `wait` would read as this one's end; pipeline.pid and lease_end (0: unknown) tell `wait` when to stop waiting
launch() {
  rm -f $S/t_* $S/failed
  setsid nohup bash $S/pipeline.sh > $S/pipeline.log 2>&1 < /dev/null &
  echo $! > $S/pipeline.pid; echo $END > $S/lease_end
  echo "pipeline started: pid $!$([ $END -gt 0 ] && echo ", ends by $(date -u -d @$END +%FT%TZ)")"
}
case "${1:-}" in
bench)
  END=$(( $(date +%s) + ${2:-1500} ))
  install
  cat > $S/pipeline.sh <<PIPE
set -x
cd $PWD
export PYTHONPATH=$PWD:$PWD/cpu_runtime:/tmp/site VLLM_USE_V2_MODEL_RUNNER=1
date -u +%FT%TZ > $S/t_start
[ -f /tmp/super/assets.json ] || python3 benchmarks/h200_main_ppo/super_assets.py /tmp/super --mtp-steps 0 \
  ${SUPER_ASSETS_ARGS:-} > $S/assets.log 2>&1 || exit 5
date -u +%FT%TZ > $S/t_assets
B=\$(( $END - \$(date +%s) - 200 ))
[ \$B -gt 300 ] && python3 benchmarks/speculation.py rollout --model /tmp/super/model --batches 64,256,1024 \
  --len-median 160 --len-sigma 0.6 --len-max 640 --rounds 5 --budget \$B --out $S/roll --tag ${CARD}_super_mtp0 \
  ${ROLLOUT_ARGS:-} > $S/rollout.log 2>&1
# vLLM's async front end as verl runs it (FRONTEND_ARGS, e.g. "--arms 0,2 --batches 256 --len-fixed 400
# --sampling plain,verl,verl-nolp,verl-final"), if 500 s remain
[ -n "${FRONTEND_ARGS:-}" ] && [ \$(( $END - \$(date +%s) )) -gt 500 ] && python3 benchmarks/speculation.py frontend \
  --model /tmp/super/model --rounds 5 --out $S/roll --tag ${CARD}_frontend ${FRONTEND_ARGS:-} > $S/frontend.log 2>&1
$(after_main)
PIPE
  launch
  ;;
start)
  END=$(( ${LEASE_LEFT:-0} > 0 ? $(date +%s) + ${LEASE_LEFT:-0} : 0 ))
  install
  MODES=${2:-online}; shift 2 || shift $#
  cat > $S/pipeline.sh <<PIPE
set -x
cd $PWD
date -u +%FT%TZ > $S/t_start
# what each of verl's processes pays to import its libraries on this host (import_profile.py), while the GPU
# pretrains; stopped before main_ppo starts, so it takes nothing from the run's start-up
# (a process group of its own: stopping it stops the import it is timing too; a warm machine's earlier one removed)
rm -rf $S/imports
setsid python3 benchmarks/h200_main_ppo/import_profile.py run $S/imports > $S/imports.log 2>&1 & IP=\$!
[ -f /tmp/super/assets.json ] || python3 benchmarks/h200_main_ppo/super_assets.py /tmp/super ${SUPER_ASSETS_ARGS:-} > $S/assets.log 2>&1 || { kill -- -\$IP 2>/dev/null; exit 5; }
date -u +%FT%TZ > $S/t_assets
kill -- -\$IP 2>/dev/null
# every process's CPU use through the run (which process holds the rollout: proc_cpu.py summary)
python3 benchmarks/h200_main_ppo/proc_cpu.py sample $S/proc_cpu.jsonl --interval 0.5 & PC=\$!
# py-spy's samples of vLLM's worker through its profiling run (the Mamba2 SSD warm-up), when py-spy is carried; an
# earlier pipeline's logs (a warm machine) would name its worker
rm -f $S/run/*.log
bash benchmarks/h200_main_ppo/spy_warmup.sh $S/run $S/spy_warmup.txt & SP=\$!
python3 benchmarks/h200_main_ppo/run.py run --stack te --assets /tmp/super --out $S/run --modes $MODES \
  --reward benchmarks/h200_main_ppo/reward_long.py $([ $END -gt 0 ] && echo --end $END) $* > $S/driver.log 2>&1
kill \$PC; pkill -P \$SP 2>/dev/null; kill \$SP 2>/dev/null
$(after_main)
PIPE
  launch
  ;;
derisk)
  # the tiny checkpoint of .h200/assets in verl's trainer with the TE stack (mode online, the plugin's rollout server,
  # its trainer estimates beside vLLM's rate), then the GPU tests: a short lease's check of the code the Super-widths
  # leases run. LEASE_LEFT: the lease's seconds left (default 900); extra arguments go to run.py run. RUNS=2: the
  # same run again on the warm machine (into run2/, with its own verl work folder: what a run's start-up costs with
  # this machine's compile caches, the second run on a node), each run leaving 300 s for each one after it and TAIL
  # seconds (default 330: the GPU tests) after the last, and stopping 75 s before the lease's end whatever TAIL
  # (run.py --end; `wait` polls 45 s before it); triton_<i>.txt: the kernels in Triton's cache after run i (and
  # whether inductor's folder got any: run.py names TRITON_CACHE_DIR so that it gets none)
  END=$(( $(date +%s) + ${LEASE_LEFT:-900} ))
  install
  shift 1
  cat > $S/pipeline.sh <<PIPE
set -x
cd $PWD
date -u +%FT%TZ > $S/t_start
rm -rf /tmp/h2assets && cp -r .h200/assets /tmp/h2assets
for i in \$(seq 1 ${RUNS:-1}); do
  N=\$([ \$i -gt 1 ] && echo \$i); R=$S/run\$N; W=/tmp/h200_main_ppo\${N:+/run\$N}
  B=\$(( $END - \$(date +%s) - ${TAIL:-330} - 300 * (${RUNS:-1} - i) ))
  [ \$B -gt 200 ] || break
  rm -f \$R/*.log
  bash benchmarks/h200_main_ppo/spy_warmup.sh \$R $S/spy_warmup\$N.txt & SP=\$!
  python3 benchmarks/h200_main_ppo/run.py run --stack te --assets /tmp/h2assets --out \$R --workdir \$W \
    --modes online --budget \$B --run-timeout \$(( B - 10 )) --silence-s 300 --end $END $* \
    > $S/driver\$N.log 2>&1
  pkill -P \$SP 2>/dev/null; kill \$SP 2>/dev/null
  { date -u +%FT%TZ; echo "triton cache \$TRITON_CACHE_DIR:"
    find \$TRITON_CACHE_DIR -name '*.json' ! -name '__grp__*' 2>/dev/null | xargs -r -n1 basename | sort | uniq -c
    echo "inductor's triton folder: \$(find /tmp/torchinductor_* -path '*triton*' -name '*.json' 2>/dev/null | wc -l) kernels"
  } > $S/triton_\$i.txt
done
date -u +%FT%TZ > $S/t_run
[ \$(( $END - \$(date +%s) )) -gt 120 ] && timeout \$(( $END - \$(date +%s) - 30 )) \
  python3 tests/gpu/run_all.py > $S/gpu_tests.log 2>&1
date -u +%FT%TZ > $S/t_end
PIPE
  launch
  ;;
drift)
  # drift.py gpu (the objectives ranked under drift over seeds): one vLLM engine per drafting method built first,
  # then pretraining and GRPO with the four objectives' MTP blocks, the engines measuring each version as it is
  # stored and pruning what both measured; then the report. Arguments after the lease's seconds left go to every
  # drift.py call (e.g. --seeds 0,1,2)
  case "${2:-1500}" in ''|*[!0-9]*) echo "drift: the lease's seconds left first, then drift.py's arguments"; exit 2 ;; esac
  END=$(( $(date +%s) + ${2:-1500} ))
  install
  shift 2 || shift $#
  cat > $S/pipeline.sh <<PIPE
set -x
cd $PWD
export PYTHONPATH=$PWD:$PWD/cpu_runtime:/tmp/site VLLM_USE_V2_MODEL_RUNNER=1
date -u +%FT%TZ > $S/t_start
G="python3 benchmarks/drift.py gpu --work /tmp/dg --out $S/dg --tag ${CARD}_gpu $*"
left() { echo \$(( $END - \$(date +%s) - 150 )); }   # each job's --budget: the lease's end less 150 s
\$G --budget \$(left) measure --method greedy --follow --prune > $S/greedy.log 2>&1 & P1=\$!
\$G --budget \$(left) measure --method probabilistic --follow --prune > $S/probabilistic.log 2>&1 & P2=\$!
# the engines take their memory first (vLLM checks the free memory as it starts), then the trainer the rest; an
# engine that did not come up ends the pipeline (its log says why) instead of idling until the lease's end
for i in \$(seq 400); do grep -q "built in" $S/greedy.log && grep -q "built in" $S/probabilistic.log && break
  kill -0 \$P1 2>/dev/null && kill -0 \$P2 2>/dev/null || break; sleep 1; done
if ! (grep -q "built in" $S/greedy.log && grep -q "built in" $S/probabilistic.log); then
  echo "an engine did not start" > $S/failed; kill \$P1 \$P2 2>/dev/null; exit 7; fi
\$G --budget \$(left) train --max-unmeasured 4 > $S/train.log 2>&1 || { echo "train rc \$?" > $S/failed; kill \$P1 \$P2; }
wait
date -u +%FT%TZ > $S/t_run
python3 benchmarks/drift.py gpu report --out $S/dg --tag ${CARD}_gpu $* > $S/report.log 2>&1
date -u +%FT%TZ > $S/t_end
PIPE
  launch
  ;;
wait)
  # sleep on the device until the pipeline ends (its t_end, or its process gone: a pipeline that failed early writes
  # none) or SECONDS (default 270) pass, at most until 45 s before the lease's end, then poll: the machine goes back
  # 30 s after a call returns, so polls are device calls back to back, and one that ends early wastes no device time
  case "${2:-270}" in ''|*[!0-9]*) echo "wait: SECONDS, a whole number"; exit 2 ;; esac
  T=$(( $(date +%s) + ${2:-270} ))
  E=$(cat $S/lease_end 2>/dev/null || echo 0)
  [ "$E" -gt 0 ] && [ $(( E - 45 )) -lt $T ] && T=$(( E - 45 ))
  P=$(cat $S/pipeline.pid 2>/dev/null || echo 0)
  while [ $(date +%s) -lt $T ] && [ ! -f $S/t_end ] && kill -0 $P 2>/dev/null; do sleep 5; done
  exec bash "$0" poll
  ;;
poll)
  # one archive (the device returns at most 8 files): the pipeline's logs, verl's per-step metrics and the plugin's
  # sync events of every mode so far, so a lease that ends mid-run still brings back every finished step
  # (derisk's later runs: /tmp/h200_main_ppo/run<i>/<mode>/, packed as run<i>_<mode>_*)
  mkdir -p $S/pack && for d in /tmp/h200_main_ppo/*/ /tmp/h200_main_ppo/run*/*/; do m=${d#/tmp/h200_main_ppo/}
    m=${m%/}; m=${m//\//_}
    for f in metrics events; do [ -f $d$f.jsonl ] && cp $d$f.jsonl $S/pack/${m}_$f.jsonl; done; done
  [ -d /tmp/dg ] && mkdir -p $S/dg && cp /tmp/dg/pretrain.json $S/dg/ 2>/dev/null && for d in /tmp/dg/seed*/; do
    [ -f ${d}done.json ] && cp ${d}done.json $S/dg/$(basename $d)_done.json; done
  # tar stops without finishing the archive on a -C into a missing folder (the drift lease has no /tmp/super)
  tar czf "$OUT/sess.tgz" -C $S $(cd $S && ls -d *.log *.jsonl spy_* t_* triton_* failed run* pack roll mem dg imports \
    2>/dev/null) \
    $([ -f /tmp/super/assets.json ] && echo -C /tmp/super assets.json) 2>/dev/null
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  ls $S; tail -5 $S/assets.log 2>/dev/null; echo ---; tail -25 $S/driver.log $S/rollout.log 2>/dev/null
  # the last step verl's trainer logged in each mode so far, and whether the pipeline has ended
  for f in $S/run*/*.log; do
    [ -f $f ] && echo "$(basename $f .log): last step $(grep -o 'training/global_step:[0-9]*' $f | tail -1 | cut -d: -f2)"
  done
  [ -f $S/t_end ] && echo "pipeline ended $(cat $S/t_end)"
  [ -f $S/pipeline.pid ] && ! kill -0 $(cat $S/pipeline.pid) 2>/dev/null && echo "pipeline process gone"
  # drift.py's own lines ("[   12.3s] ..."), not the libraries' warnings around them
  for f in train greedy probabilistic; do [ -f $S/$f.log ] && { echo "== $f"; grep '^\[ *[0-9.]*s\]' $S/$f.log | tail -4; }; done
  tail -6 $S/report.log 2>/dev/null
  # a failed job says why on its last lines (a refusal or a traceback has no "[ ...s]" prefix)
  [ -f $S/failed ] && { echo "== failed: $(cat $S/failed)"; tail -5 $S/train.log 2>/dev/null; }
  true
  ;;
cache)
  # Triton's, inductor's and vLLM's compile caches of this lease and the causal_conv1d wheel the shared tool built
  # here (sm_90; `install` then skips the build), for the next lease to carry as .h200-cache (`start` and `bench`
  # restore them when carried in their call; `restore` in a call of its own when they are large); at most ~60 MiB:
  # one carry holds 64 MiB with the tree, and the device returns at most 8 files
  W=$(ls /tmp/tmp.*/dist/causal_conv1d-*.whl 2>/dev/null | head -1)
  [ -n "$W" ] && mkdir -p /tmp/cc1d && cp "$W" /tmp/cc1d/
  # the first of these sets whose archive fits 60 MiB: all; without inductor's; then Triton's kernels without their
  # intermediate code (a cached kernel loads from its .json and .cubin: triton/compiler/compiler.py, CompiledKernel;
  # the .llir alone was 60 % of the 91 MB the trainer's kernels took); the wheel alone. run.py names
  # TRITON_CACHE_DIR=~/.triton/cache, so vLLM's worker's kernels are in it too
  W=$(cd / && ls -d tmp/cc1d 2>/dev/null); T=$(cd / && ls -d "${TRITON_CACHE_DIR#/}" 2>/dev/null)
  V=$(cd / && ls -d root/.cache/vllm 2>/dev/null); I=$(cd / && ls -d tmp/torchinductor_* 2>/dev/null)
  [ -n "$W$T$V$I" ] || { echo "no compile caches on this machine"; exit 6; }
  fit=""
  IR=(--exclude='*.llir' --exclude='*.ptx' --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.source')
  for choice in "all:$W $T $V $I" "all:$W $T $V" "noir:$W $T $V" "noir:$W $T" "all:$W"; do
    how=${choice%%:*}; paths=${choice#*:}
    [ -n "$(echo $paths)" ] || continue
    x=(); [ "$how" = noir ] && x=("${IR[@]}")
    tar czf /tmp/cache.tgz "${x[@]}" -C / $paths && [ $(stat -c%s /tmp/cache.tgz) -le $((60 << 20)) ] && { fit="$how: $paths"; break; }
    echo "$how: $(echo $paths): $(stat -c%s /tmp/cache.tgz) B, over 60 MiB"
  done
  [ -n "$fit" ] || { echo "cache over 60 MiB: not returned"; exit 6; }
  echo "returned: $(echo $fit)"
  ls -la /tmp/cache.tgz
  mkdir -p "$OUT/cache" && split -b 15M -a 1 /tmp/cache.tgz "$OUT/cache/cache.tgz.part"; ls -la "$OUT/cache"
  ;;
prebuild)
  # causal_conv1d built for sm_90 in the background while the other staging calls run (otherwise ~70-80 s of every
  # lease's install, after the staging): in the call that puts the TE part holding the shared tool's
  # build_causal_conv1d.sh (te_parts.py put .te-stage/t01 && super_session.sh prebuild); its wheel goes to /tmp/cc1d,
  # where `install` finds it (and `cache` returns it)
  # (TE_STAGE, CC1D: other folders than /tmp/te and /tmp/cc1d, for tests; `install` reads /tmp/cc1d)
  T=${TE_STAGE:-/tmp/te}; C=${CC1D:-/tmp/cc1d}
  [ -f $T/build_causal_conv1d.sh ] || { echo "no $T/build_causal_conv1d.sh: put the TE part holding it first"; exit 6; }
  ls $C/causal_conv1d-*.whl >/dev/null 2>&1 && { echo "a causal_conv1d wheel is already in $C"; exit 0; }
  [ -f $C.pid ] && [ ! -f $C.rc ] && kill -0 $(cat $C.pid) 2>/dev/null && { echo "causal_conv1d is building already"; exit 0; }
  # the build sees the image's packages only (the start call's install fills /tmp/site meanwhile); its status is
  # written whole (install and the tests read it once the file is there)
  rm -f $C.rc; mkdir -p $C $C.build
  setsid nohup env PYTHONPATH= bash -c "MAX_JOBS=16 OUT=$C.build bash $T/build_causal_conv1d.sh $C.site > $C.log 2>&1 \
    && cp $C.build/causal_conv1d-*.whl $C/; echo \$? > $C.rc.tmp && mv $C.rc.tmp $C.rc" > /dev/null 2>&1 < /dev/null &
  echo $! > $C.pid; echo "causal_conv1d building in the background: pid $!"
  ;;
restore)
  ls .h200-cache/cache.tgz.part* >/dev/null 2>&1 || { echo "no .h200-cache/cache.tgz.part* in this call's tree"; exit 6; }
  restore_caches
  ;;
*) echo "usage: super_session.sh start|bench|derisk|drift|poll|wait|cache|restore|prebuild"; exit 2 ;;
esac
