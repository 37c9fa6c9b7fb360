"""verl's PPO/GRPO entry point with the plugin's trainers (run as ``python -m verl_mtp_plugin.main_ppo``).

Takes exactly the arguments of ``python -m verl.trainer.main_ppo`` (same Hydra config, same
``--config-path/--config-name``; a relative ``--config-path`` is relative to ``verl/trainer`` as it is
for verl's entry point, else to the working directory or the package, and a shipped recipe name needs no
``--config-path``: :func:`verl_relative_config_path`) and differs in three ways:

1. the plugin's start-up check (:func:`verl_mtp_plugin.trainer.config.startup_check`) runs first, in the
   driver, and stops with every problem listed by key (under verl's own entry point the same check runs in
   the task runner before any worker: :mod:`verl_mtp_plugin.compat.verl_entry`); the config it passed is
   marked, so the task runner's hook does not check it again;
2. the task runner (verl's ``TaskRunnerV1`` Ray actor, through ``run_ppo``'s ``task_runner_class``
   argument, which verl keeps for recipes) registers the plugin's trainers in its own process
   before verl looks ``trainer.v1.trainer_mode`` up, so ``mtp_sync`` / ``mtp_colocate_async`` /
   ``mtp_separate_async`` resolve (:mod:`verl_mtp_plugin.trainer.v1`);
3. the legacy trainer (``trainer.use_v1=false``) is refused (after the start-up check, whose problems the
   message lists first): the rollout metrics and the desync guard hook into the v1 trainers only.
"""

from __future__ import annotations

import importlib
import logging
import sys

import hydra
import ray
from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config
from verl.utils.device import auto_set_device

from verl_mtp_plugin.compat.verl_entry import mark_checked
from verl_mtp_plugin.config_keys import TRAINER_MODES, as_bool, get_key
from verl_mtp_plugin.policy import MTPConfigError
from verl_mtp_plugin.trainer.config import startup_check

__all__ = [
    "MTPTaskRunner",
    "MTPTaskRunnerV1",
    "check",
    "main",
    "register_plugin_trainers",
    "shared_weight_socket_warning",
    "verl_relative_config_path",
]

logger = logging.getLogger(__name__)


def register_plugin_trainers() -> dict[str, str]:
    """Import :mod:`verl_mtp_plugin.trainer.v1` (registers its trainers with verl's
    ``register_trainer``) and return ``{plugin mode: verl mode}``."""
    importlib.import_module("verl_mtp_plugin.trainer.v1")
    return dict(TRAINER_MODES)


class MTPTaskRunner(TaskRunnerV1.__ray_actor_class__):
    """verl's ``TaskRunnerV1`` that registers the plugin's trainers in the actor process first."""

    def run(self, config):
        # the driver (main) ran the start-up check and marked the config: the verl-entry hook skips it here
        register_plugin_trainers()
        return super().run(config)


MTPTaskRunnerV1 = ray.remote(MTPTaskRunner)


def shared_weight_socket_warning(config, environ=None) -> str | None:
    """The hazard of a job that starts its own Ray cluster, in words (None when it joins an existing one).

    verl 0.9.1 names its colocated weight-transfer socket after the Ray job id
    (``/tmp/rl-colocate-zmq-{job id}-replica-{r}-rank-{k}.sock``: ``ServerAdapter.zmq_handle`` on the trainer side,
    the worker extension's ``_get_zmq_handle`` from ``VERL_RAY_JOB_ID`` on vLLM's side), and Ray numbers jobs per
    cluster: the first job of every fresh cluster is ``01000000``. Ray has no way to choose a job id, and verl
    derives both ends from it, so the plugin cannot give the run a handle of its own; a job that joins a running
    cluster (``ray_kwargs.ray_init.address`` or ``RAY_ADDRESS``) gets a job id no other job of that cluster has.
    """
    import os

    environ = os.environ if environ is None else environ
    address = config.get("ray_kwargs", {}).get("ray_init", {}).get("address") if hasattr(config, "get") else None
    if address or environ.get("RAY_ADDRESS"):
        return None
    return (
        "this run starts its own Ray cluster (ray_kwargs.ray_init.address and RAY_ADDRESS unset), whose first job id "
        "is the same in every fresh cluster; verl names its weight-transfer socket after it "
        "(/tmp/rl-colocate-zmq-<Ray job id>-replica-<r>-rank-<k>.sock), so a second job started the same way on "
        "this host shares the socket: a weight update can hang or load the other job's weights. One job per host "
        "is safe; for more, start one Ray cluster per host (ray start --head) and pass "
        "+ray_kwargs.ray_init.address=auto (every job then gets its own job id), or give each job its own /tmp "
        "(a container or a mount namespace)"
    )


def check(config) -> None:
    """The plugin's start-up checks for this entry point (raises :class:`MTPConfigError`): the start-up check every
    entry point runs (:func:`startup_check`), then this entry's refusal of the legacy trainer (its line comes after
    the start-up check's, so the other entry points' message for the same config is this one's first part)."""
    legacy = (
        "trainer.use_v1=false: python -m verl_mtp_plugin.main_ppo runs verl's v1 trainers (rollout speculation "
        "metrics and the MTP desync guard hook into them); set trainer.use_v1=true or run python -m "
        "verl.trainer.main_ppo without them"
    )
    use_v1 = as_bool(get_key(config, "trainer.use_v1", True))
    try:
        settings = startup_check(config)
    except MTPConfigError as e:
        if use_v1:
            raise
        raise MTPConfigError(f"{e}\n  - {legacy}") from None
    if not use_v1:
        raise MTPConfigError(f"invalid verl config for verl_mtp_plugin:\n  - {legacy}")
    hazard = shared_weight_socket_warning(config)
    if hazard:
        logger.warning("verl_mtp_plugin: %s", hazard)
    mode = str(config.trainer.v1.trainer_mode)
    if settings.rollout_speculation and mode not in TRAINER_MODES:
        logger.warning(
            "trainer.v1.trainer_mode=%s: MTP rollout speculation is on but verl's own trainer logs no per-position "
            "acceptance and runs no desync guard; use trainer.v1.trainer_mode=%s",
            mode,
            next((m for m, base in TRAINER_MODES.items() if base == mode), "mtp_sync"),
        )


@hydra.main(config_path="pkg://verl.trainer.config", config_name="ppo_trainer", version_base=None)
def main(config):
    """verl's ``main_ppo.main`` with the plugin's check and task runner."""
    auto_set_device(config)
    try:
        check(config)
    except MTPConfigError as e:
        print(f"verl_mtp_plugin: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    mark_checked(config)  # checked once: the task runner's verl-entry hook skips a marked config
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    run_ppo(config, task_runner_class=MTPTaskRunnerV1)


def verl_relative_config_path(argv: list[str]) -> list[str]:
    """Make ``--config-path``/``--config-name`` mean what users write.

    Hydra resolves a relative ``--config-path`` against the directory of the main module. A relative path
    means, in this order, the first that exists: ``verl/trainer/<path>`` (what it means for
    ``python -m verl.trainer.main_ppo``), ``<working directory>/<path>``, ``<package>/<path>`` (the
    documented ``recipes/nemotron3_super_mtp/config`` is shipped in the package). Without
    ``--config-path``, a shipped recipe name (``--config-name grpo_online``) reads the shipped folder
    (:data:`verl_mtp_plugin.recipe_paths.CONFIG_DIR`).
    """
    from verl_mtp_plugin.recipe_paths import CONFIG_DIR, resolve_path, shipped

    out, i, has_path, name = [], 0, False, None
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config-path", "-cp") and i + 1 < len(argv):
            out += [arg, resolve_path(argv[i + 1])]
            has_path = True
            i += 2
            continue
        if arg in ("--config-name", "-cn") and i + 1 < len(argv):
            name = argv[i + 1]
        for flag in ("--config-path=", "-cp="):
            if arg.startswith(flag):
                arg = flag + resolve_path(arg[len(flag) :])
                has_path = True
        for flag in ("--config-name=", "-cn="):
            if arg.startswith(flag):
                name = arg[len(flag) :]
        out.append(arg)
        i += 1
    if not has_path and name is not None and shipped(name):
        out = ["--config-path", str(CONFIG_DIR), *out]
    return out

