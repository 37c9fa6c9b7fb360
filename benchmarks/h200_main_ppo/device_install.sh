#!/usr/bin/env bash
# On the GPU machine (checkout root): gather the N staged parts (.stage/s1..sN, N in .h200/parts.txt, carried by
# earlier calls and copied to /tmp/stage), verify them against .h200/manifest.txt, install into /tmp/site. Idempotent: on a
# machine that has it already, it only says so. Then: export PYTHONPATH=.h200/src:/tmp/site (the source sync_src.sh
# staged from another worktree), or PYTHONPATH=$PWD:$PWD/cpu_runtime:/tmp/site for the checkout's own (the product
# and the CPU runtime's verl_mtp_cpu; run.py and super_assets.py put both on their path themselves).
set -u
mkdir -p /tmp/stage
for d in .stage/s*/; do [ -d "$d" ] && cp -n "$d"/* /tmp/stage/ 2>/dev/null; done
if [ -f /tmp/site/.h200-installed ]; then echo "h200 stack already in /tmp/site"; exit 0; fi
[ "${1:-}" = "--copy-only" ] && { ls -la /tmp/stage; exit 0; }
N=$(cat .h200/parts.txt 2>/dev/null || echo 3); HAVE=$(ls /tmp/stage/bundle.part* 2>/dev/null | wc -l)
[ "$HAVE" -eq "$N" ] || { echo "$HAVE of $N parts in /tmp/stage (machine went cold?): carry .stage/s1..s$N again"; exit 3; }
t0=$(date +%s)
cat /tmp/stage/bundle.part* > /tmp/bundle.bin
off=0
while read -r f size sha; do
  tail -c +$((off + 1)) /tmp/bundle.bin | head -c "$size" > "/tmp/$f"
  echo "$sha  /tmp/$f" | sha256sum -c --quiet || { echo "sha256 mismatch: $f"; exit 3; }
  off=$((off + size))
done < .h200/manifest.txt
rm -f /tmp/bundle.bin
mkdir -p /tmp/site /tmp/deps
tar -C /tmp/deps -xJf /tmp/deps.tar.xz || exit 5
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/deps/wheels/*.whl || exit 4
tar -C /tmp/site -xJf /tmp/vllm-slim.tar.xz || exit 5
tar -C /tmp/site -xJf /tmp/ray-slim.tar.xz || exit 5
cp -a /tmp/deps/site/. /tmp/site/ || exit 5
touch /tmp/site/.h200-installed
echo "installed in $(( $(date +%s) - t0 )) s"
PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 python3 -c "
import torch, transformers, ray, verl, megatron.core, transfer_queue, vllm
print('torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'verl', verl.__version__,
      'mcore', megatron.core.__version__, 'transformers', transformers.__version__)" 2>&1 | tail -3
