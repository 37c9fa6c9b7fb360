#!/usr/bin/env bash
# PPO (GAE + critic) on Nemotron 3 Super with MTP speculative rollouts.
#   MODE=frozen|online  (default online)   NNODES (default 16)   extra Hydra overrides as arguments
# Actor, reference model and critic are all 120B: 16 x 8 H200.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODE=${MODE:-online}
CONFIG_NAME=ppo_${MODE}
MODEL_PATH=${MODEL_PATH:-nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/dapo-math-17k/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/aime-2024/test.parquet}
NNODES=${NNODES:-16}

ARGS=(
    actor_rollout_ref.model.path="$MODEL_PATH"
    data.train_files="$TRAIN_FILES"
    data.val_files="$VAL_FILES"
    trainer.nnodes="$NNODES"
    trainer.n_gpus_per_node=8
    "$@"
)

python3 -m verl_mtp_plugin.trainer.config --config-path "$HERE/config" --config-name "$CONFIG_NAME" "${ARGS[@]}"

# verl's main_ppo with the plugin's task runner (registers trainer.v1.trainer_mode=mtp_sync in it)
python3 -m verl_mtp_plugin.main_ppo --config-path "$HERE/config" --config-name "$CONFIG_NAME" "${ARGS[@]}"
