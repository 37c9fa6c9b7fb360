#!/usr/bin/env bash
# Stage what the lent H200's image lacks for `python -m verl_mtp_plugin.main_ppo` (no GPU time; ~10 min on 2 cores).
#   usage: bash benchmarks/h200_main_ppo/stage.sh CHECKOUT [ASSETS_DIR]
#     CHECKOUT: the checkout the device calls send (its .git/info/exclude gets /.h200/ and /.stage/)
#     ASSETS_DIR: built with `python benchmarks/h200_main_ppo/run.py assets DIR` (copied into .h200/assets)
#   env: VENV (default CHECKOUT/.venv: the stack of constraints.txt: verl 0.9.1, megatron-core 0.19.2,
#        Megatron-Bridge 0.6.2, TransferQueue 0.1.11, ray 2.60.0, transformers 5.10.4),
#        WORK (download/build folder, default ~/.cache/h200-main-ppo)
# Writes:
#   CHECKOUT/.stage/s1 .. sN  N equal parts of one byte stream (part + .h200 + the tree that travels <= 63 MiB):
#       vllm-slim.tar.xz (vLLM 0.26.0, from ../shared/tools/h200-vllm/prepare_stage.sh)
#     + ray-slim.tar.xz  (ray 2.60.0 without jars, dashboard client, rllib, tests)
#     + deps.tar.xz      (verl, megatron-core, Megatron-Bridge, TransferQueue, hydra/omegaconf, datasets,
#                         tensordict, megatron-energon + multi-storage-client (Megatron-Bridge's training config
#                         imports them: megatron/bridge/data/energon/base_energon_datamodule.py:19), vLLM's HTTP
#                         server imports (watchfiles, prometheus_fastapi_instrumentator, python-multipart,
#                         model_hosting_container_standards), transformers 5.10.4 + tokenizers 0.22.2 (verl <5.11, Bridge <=5.12.1;
#                         the image has 5.17), jsonschema (ray), mamba_ssm 2.3.2.post1 built pure-Python,
#                         and the 20 wheels vLLM 0.26 imports that the image lacks)
#   CHECKOUT/.h200/        manifest.txt (file names, byte sizes, sha256), parts.txt (N), device_install.sh, assets/, src/ when
#                          CHECKOUT is another worktree (sync_src.sh: this worktree's verl_mtp_plugin with its recipes,
#                          the CPU runtime's verl_mtp_cpu, benchmarks/*.py and benchmarks/h200_main_ppo)
# On the device: calls 1..N carry .stage/sK and .h200 (`mkdir -p /tmp/stage && cp .stage/sK/* /tmp/stage/`);
# then every run call carries .h200 and starts with `bash .h200/device_install.sh` (idempotent).
set -euo pipefail
CO=$(cd "${1:?usage: stage.sh CHECKOUT [ASSETS_DIR]}" && pwd)
ASSETS=${2:-}
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(cd "$HERE/../.." && pwd)
VENV=${VENV:-$CO/.venv}
SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
W=${WORK:-$HOME/.cache/h200-main-ppo}; mkdir -p "$W/dl"
for p in /.h200/ /.stage/; do grep -qx "$p" "$CO/.git/info/exclude" 2>/dev/null || echo "$p" >> "$CO/.git/info/exclude"; done

# 1. vLLM 0.26.0 (the shared tool's slim tarball)
VW=${XDG_CACHE_HOME:-$HOME/.cache}/h200-vllm
[ -f "$VW/vllm-slim.tar.xz" ] || PYTHON="$VENV/bin/python" bash "$SRC/../shared/tools/h200-vllm/prepare_stage.sh" "$CO"
[ -f "$VW/vllm-slim.tar.xz" ] || { echo "no $VW/vllm-slim.tar.xz"; exit 2; }

DL="$VENV/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $W/dl"
# 2. ray, slimmed
if [ ! -f "$W/ray-slim.tar.xz" ]; then
  ls "$W"/dl/ray-2.60.0-*.whl >/dev/null 2>&1 || $DL ray==2.60.0
  rm -rf "$W/ray" && mkdir -p "$W/ray" && (cd "$W/ray" && python3 -m zipfile -e "$W"/dl/ray-2.60.0-*.whl . \
    && rm -rf ray/jars ray/dashboard/client/build ray/rllib ray/tests ray/serve/tests ray/data/tests ray/tune/tests ray/train/tests \
    && find . -name __pycache__ -prune -exec rm -rf {} + && find . -name '*.so' -exec chmod +x {} + \
    && chmod +x ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet \
    && tar -cf - ray ray-2.60.0.dist-info | xz -6 -T0 > "$W/ray-slim.tar.xz")
fi

# 3. the rest, from the venv (same versions as the CPU runs) + mamba_ssm + vLLM's extra wheels
if [ ! -f "$W/deps.tar.xz" ]; then
  ls "$W"/dl/mamba_ssm-2.3.2.post1-*.whl >/dev/null 2>&1 || MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
    "$VENV/bin/python" -m pip wheel -q --no-deps --no-build-isolation mamba_ssm==2.3.2.post1 -w "$W/dl"
  rm -rf "$W/deps" && mkdir -p "$W/deps/site" "$W/deps/wheels"
  PKGS="jsonschema jsonschema_specifications referencing rpds transfer_queue verl megatron/core megatron/training
        megatron/bridge hydra omegaconf antlr4 datasets dill multiprocess _multiprocess tensordict pyvers orjson
        codetiming torchdata pylatexenc nvtx uvicorn jmespath transformers tokenizers
        megatron/energon multistorageclient multistorageclient_rust xattr cffi _cffi_backend.cpython-312-x86_64-linux-gnu.so
        deprecation.py interegular webdataset braceexpand filetype ryml lark wcmatch bracex opentelemetry
        watchfiles prometheus_fastapi_instrumentator multipart python_multipart model_hosting_container_standards supervisor"
  DISTS="jsonschema-*.dist-info jsonschema_specifications-*.dist-info referencing-*.dist-info rpds_py-*.dist-info
         transferqueue-*.dist-info verl-0.9.1.dist-info megatron_core-*.dist-info megatron_bridge-*.dist-info
         hydra_core-*.dist-info omegaconf-*.dist-info antlr4_python3_runtime-*.dist-info datasets-*.dist-info
         dill-*.dist-info multiprocess-*.dist-info tensordict-*.dist-info pyvers-*.dist-info orjson-*.dist-info
         codetiming-*.dist-info torchdata-*.dist-info pylatexenc-*.dist-info nvtx-*.dist-info uvicorn-*.dist-info
         jmespath-*.dist-info transformers-*.dist-info tokenizers-*.dist-info megatron_energon-*.dist-info
         multi_storage_client-*.dist-info xattr-*.dist-info cffi-*.dist-info deprecation-*.dist-info
         interegular-*.dist-info webdataset-*.dist-info braceexpand-*.dist-info filetype-*.dist-info
         rapidyaml-*.dist-info lark-*.dist-info wcmatch-*.dist-info bracex-*.dist-info opentelemetry_api-*.dist-info
         watchfiles-*.dist-info prometheus_fastapi_instrumentator-*.dist-info python_multipart-*.dist-info
         model_hosting_container_standards-*.dist-info supervisor-*.dist-info"
  (cd "$SP" && tar -cf - --exclude=__pycache__ $PKGS $DISTS) | tar -xf - -C "$W/deps/site"
  (cd "$W/deps/site" && python3 -m zipfile -e "$W"/dl/mamba_ssm-2.3.2.post1-*.whl .)
  cp "$VW"/extra/*.whl "$W/deps/wheels/"
  (cd "$W/deps" && tar -cf - site wheels | xz -6 -T0 > "$W/deps.tar.xz")
fi

# 4. one stream in N equal parts .stage/s1..sN, N from the tree that travels beside each (a call carries one part,
#    .h200 and the checkout's tracked and untracked-not-ignored files: <= 64 MiB; 1 MiB kept as margin).
#    .h200/parts.txt holds N; device_install.sh checks all N arrived.
rm -rf "$CO"/.stage/h[0-9] "$CO"/.stage/s[0-9]* "$CO/.h200" && mkdir -p "$CO/.h200"
cp "$HERE/device_install.sh" "$CO/.h200/"
# staging from another worktree: the calls send CO, so carry this one's source
if [ "$SRC" != "$CO" ]; then bash "$HERE/sync_src.sh" "$CO"; fi
[ -n "$ASSETS" ] && cp -r "$ASSETS" "$CO/.h200/assets"
(cd "$W" && cp "$VW/vllm-slim.tar.xz" . && for f in vllm-slim.tar.xz ray-slim.tar.xz deps.tar.xz; do
   echo "$f $(stat -c %s $f) $(sha256sum $f | cut -d' ' -f1)"; done > "$CO/.h200/manifest.txt"
 cat vllm-slim.tar.xz ray-slim.tar.xz deps.tar.xz > bundle.bin && rm -f bundle.part* vllm-slim.tar.xz)
TREE=$(cd "$CO" && git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null \
  | awk '{s += $1} END {print s + 0}')
H200=$(du -sb "$CO/.h200" | cut -f1); TOTAL=$(stat -c %s "$W/bundle.bin")
ROOM=$(( 63 * 1048576 - TREE - H200 )); [ "$ROOM" -gt 4194304 ] || { echo "tree $TREE B leaves no room for a part"; exit 2; }
N=$(( (TOTAL + ROOM - 1) / ROOM )); PART=$(( (TOTAL + N - 1) / N ))
(cd "$W" && split -b "$PART" -a 2 bundle.bin bundle.part && rm bundle.bin)
k=1; for f in "$W"/bundle.part*; do mkdir -p "$CO/.stage/s$k"; mv "$f" "$CO/.stage/s$k/"; k=$((k + 1)); done
echo "$N" > "$CO/.h200/parts.txt"
echo "tree $TREE B + .h200 $H200 B travel with each part: $N parts of $PART B"
du -sb "$CO"/.stage/s* "$CO"/.h200 | awk '{printf "%s %.1f MiB\n", $2, $1/1048576}'
cat "$CO/.h200/manifest.txt"
# 5. preflight, here: each mode's start-up check with the Super runs' overrides (a CPU dry-run checkpoint of
#    super_assets.py's config) against the staged vLLM (0.26), not the venv's: a refusal would otherwise stop the
#    first run on the GPU after the lease's staging, install and pretraining
rm -rf "$W/super_dry"
PYTHONPATH="$SRC:$SRC/cpu_runtime" VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" "$SRC/benchmarks/h200_main_ppo/super_assets.py" \
  "$W/super_dry" --cpu-dry-run --steps 1 --mtp-steps 1 --train-rows 64 > "$W/super_dry.log" 2>&1 || { tail -20 "$W/super_dry.log"; exit 2; }
PYTHONPATH="$VW/slim" VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" "$SRC/benchmarks/h200_main_ppo/run.py" run --preflight \
  --stack te --assets "$W/super_dry" --out "$W/preflight" --modes online,frozen,off --response-len 400 \
  --reward "$SRC/benchmarks/h200_main_ppo/reward_long.py" 2>&1 | grep -A30 "^==="
