#!/usr/bin/env bash
# GRPO on Nemotron 3 Super with MTP speculative rollouts (verl 0.9.x, Megatron-Core HybridModel, vLLM).
#   MODE=frozen|online|joint  (default online)   NNODES (default 8)   extra Hydra overrides as arguments
# Run on the Ray head node of an 8 x 8 H200 cluster, with verl_mtp_plugin installed on every node.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODE=${MODE:-online}
CONFIG_NAME=grpo_${MODE}
MODEL_PATH=${MODEL_PATH:-nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/dapo-math-17k/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/aime-2024/test.parquet}
NNODES=${NNODES:-8}

ARGS=(
    actor_rollout_ref.model.path="$MODEL_PATH"
    data.train_files="$TRAIN_FILES"
    data.val_files="$VAL_FILES"
    trainer.nnodes="$NNODES"
    trainer.n_gpus_per_node=8
    "$@"
)

# Pre-flight: the same composition, checked by the plugin (exits non-zero naming the keys).
python3 -m verl_mtp_plugin.trainer.config --config-path "$HERE/config" --config-name "$CONFIG_NAME" "${ARGS[@]}"

# verl's main_ppo with the plugin's task runner (registers trainer.v1.trainer_mode=mtp_sync in it)
python3 -m verl_mtp_plugin.main_ppo --config-path "$HERE/config" --config-name "$CONFIG_NAME" "${ARGS[@]}"
