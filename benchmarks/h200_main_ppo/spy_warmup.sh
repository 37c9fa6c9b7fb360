#!/usr/bin/env bash
# py-spy's samples of vLLM's worker through its compile and profiling run, the longest of vLLM's start-up phases
# (it holds "Warming up Mamba2 SSD Triton kernels"; on a fresh machine mostly Triton compiling: RESULTS, "vLLM's
# profiling run is Triton compiling"): which Python code holds it. super_session.sh start runs it in the background
# when the py-spy wheel is carried (.h200-cache/py_spy-*.whl, unpacked by its install or `restore` into
# /tmp/pyspy); `startup.py spy OUT` reads the samples.
#   usage: spy_warmup.sh RUN_DIR OUT [SECONDS]   (RUN_DIR: run.py run's --out, where the mode's log grows)
set -u
RUN=${1:?usage: spy_warmup.sh RUN_DIR OUT [SECONDS]}; OUT=${2:?}; SECS=${3:-150}
SPY=${PYSPY:-$(ls /tmp/pyspy/py_spy-*.data/scripts/py-spy 2>/dev/null | head -1)}   # PYSPY: tests
[ -n "$SPY" ] || { echo "no py-spy in /tmp/pyspy" > "$OUT"; exit 0; }
pid=
for _ in $(seq 1 ${SPY_WAIT_S:-1800}); do   # the line comes ~3-5 min into a run (SPY_WAIT_S: tests)
  pid=$(cat "$RUN"/*.log 2>/dev/null | grep -a "Warming up Mamba2 SSD" | grep -o "Worker\(_[A-Za-z0-9_]*\)\? pid=[0-9]*" | head -1 | cut -d= -f2)
  [ -n "$pid" ] && break
  sleep 1
done
[ -n "$pid" ] || { echo "no warm-up line in $RUN/*.log" > "$OUT"; exit 0; }
[ -d /proc/$pid ] || { echo "vLLM's worker $pid is gone" > "$OUT"; exit 0; }
timeout $((SECS + 60)) "$SPY" record --pid "$pid" --duration "$SECS" --rate 20 --format raw --nonblocking \
  -o "$OUT" > "$OUT.log" 2>&1
