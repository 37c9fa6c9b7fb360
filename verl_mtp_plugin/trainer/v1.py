"""verl v1 trainers that log rollout speculation metrics and run the MTP drafter-desync guard.

verl 0.9.x computes a step's metrics inside its trainer (``PPOTrainer._compute_metrics``) and offers
two extension points there: trainer hooks (``on_train_begin``, ``on_validate_begin/end``, ...) and a
registry of trainer classes keyed by ``trainer.v1.trainer_mode`` (``@register_trainer``). This module
registers one subclass per verl trainer, each adding :class:`~verl_mtp_plugin.rollout.monitor.spec_monitor.RolloutSpecMonitor`
to the hooks:

=========================================  ======================  ==================================
``trainer.v1.trainer_mode``                behaves as verl's       validation rollouts
=========================================  ======================  ==================================
``mtp_sync``                               ``sync``                not counted
``mtp_colocate_async``                     ``colocate_async``      counted (rollouts overlap)
``mtp_separate_async``                     ``separate_async``      counted (rollouts overlap)
=========================================  ======================  ==================================

In ``mtp_colocate_async`` a step's counters end when verl samples the step's batch (verl pauses generation there
until the step's weight update): a step counts the generation under one weight version, the one its trainer
estimate is for; what is generated after the update counts toward the next step.

Everything else is verl's: the class's ``trainer_mode`` attribute reads as the base mode, so verl's
mode-dependent code (replay buffer kind, checkpoint layout, ``trainer.v1.<mode>.*`` settings) runs
exactly as for the base trainer and reads the base mode's settings block; for verl code that reads
``trainer.v1.<trainer.v1.trainer_mode>`` from the config itself, the constructor adds
``trainer.v1.mtp_<mode>`` as a copy of ``trainer.v1.<mode>`` when it is absent.

Per step the metric dict verl logs gains ``rollout/spec_accept_rate``, ``rollout/spec_accept_length``
(kept from verl when it computed them from per-request statistics),
``rollout/spec_accept_rate_pos_{k}``, ``rollout/spec_num_*``, ``rollout/spec_counter_reset`` and
the guard's ``mtp_guard/*``. The counters come from each rollout replica's ``/metrics``
(``actor_rollout_ref.rollout.disable_log_stats=false``). With ``verl_mtp_plugin.mtp_guard.action=fail`` a
desync stops training after verl has logged that step's metrics (:class:`MTPDesyncError` from the next
``on_step_begin``, or from ``fit`` when it was the last step).

The registry lives in the process that runs verl's ``TaskRunnerV1`` (a Ray actor). Start training
with ``python -m verl_mtp_plugin.main_ppo`` (its task runner imports this module), or keep
``python -m verl.trainer.main_ppo`` and import this module in every Ray process with
``VERL_USE_EXTERNAL_MODULES=verl_mtp_plugin.trainer.v1`` in
``ray_kwargs.ray_init.runtime_env.env_vars``. Importing this module imports verl's v1 trainer stack
(and so TransferQueue).
"""

from __future__ import annotations

import copy
import logging

from omegaconf import open_dict

from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from verl_mtp_plugin.rollout.monitor.desync_guard import guard_from_verl_config
from verl_mtp_plugin.rollout.monitor.spec_monitor import RolloutSpecMonitor
from verl_mtp_plugin.rollout.replica import install as install_rollout_server
from verl_mtp_plugin.compat.verl_entry import install as install_startup_check
from verl_mtp_plugin.compat.verl_replay_buffer import sample_poll_s, set_sample_poll
from verl_mtp_plugin.config_keys import TRAINER_MODES
from verl_mtp_plugin.trainer.config import startup_check

__all__ = [
    "MTPPPOTrainerColocateAsync",
    "MTPPPOTrainerSeparateAsync",
    "MTPPPOTrainerSync",
    "MTPRolloutMetricsMixin",
    "build_rollout_monitor",
]

logger = logging.getLogger(__name__)

# verl's entry point with VERL_USE_EXTERNAL_MODULES=verl_mtp_plugin.trainer.v1: the start-up check runs in the task
# runner before the trainer builds any worker (the same check as python -m verl_mtp_plugin.main_ppo)
install_startup_check(startup_check)
# every task runner of the plugin imports this module before its trainer builds the rollout (the plugin's entry point,
# verl's with VERL_USE_EXTERNAL_MODULES; verl's with external_lib installs it from the package __init__): verl's
# rollout registry then starts the plugin's vLLM server (rollout/replica.py)
install_rollout_server()


def build_rollout_monitor(config, addresses, *, exclude_validation: bool = True) -> RolloutSpecMonitor:
    """The monitor for a composed verl trainer config.

    Speculation is on when ``actor_rollout_ref.model.mtp.enable`` and ``.enable_rollout`` are true (or a
    speculative config is given under ``engine_kwargs.vllm``); the guard reads
    ``verl_mtp_plugin.mtp_guard`` (:func:`~verl_mtp_plugin.rollout.monitor.desync_guard.guard_from_verl_config`, which
    also warns when ``actor_rollout_ref.rollout.disable_log_stats`` leaves vLLM without counters).

    Raises:
        MTPConfigError: an invalid guard block.
    """
    from verl_mtp_plugin import verl_config

    guard = guard_from_verl_config(config)
    depths = verl_config.speculation_depths(config) if guard.speculation else ()
    return RolloutSpecMonitor(
        addresses,
        guard=guard if guard.config.action != "off" else None,
        speculation=guard.speculation,
        exclude_validation=exclude_validation,
        depths=depths or None,  # k chosen by batch size (num_speculative_tokens_per_batch_size), else (k,)
    )


def _refuse_weight_paths(config) -> None:
    """The start-up check's weight-path part (:func:`verl_mtp_plugin.trainer.config._weight_path_errors`), for
    runs started by ``python -m verl.trainer.main_ppo``: raises MTPConfigError before any worker starts."""
    from verl_mtp_plugin.config_keys import MTP, as_bool, get_key
    from verl_mtp_plugin.policy import MTPConfigError
    from verl_mtp_plugin.trainer.config import _weight_path_errors

    speculation = as_bool(get_key(config, f"{MTP}.enable", False)) and as_bool(get_key(config, f"{MTP}.enable_rollout", False))
    errors = _weight_path_errors(config, speculation=speculation)
    if errors:
        raise MTPConfigError("invalid verl config for verl_mtp_plugin:\n  - " + "\n  - ".join(errors))


class MTPRolloutMetricsMixin:
    """Adds the rollout speculation monitor to a verl v1 trainer (put it before the verl class).

    Class attributes:
        mtp_base_mode (str): the verl trainer mode this class behaves as.
        mtp_exclude_validation (bool): drop validation rollouts from the step's counters.
        mtp_close_window_at_sample_end (bool): the step's counters end when verl samples the step's batch (verl
            pauses generation there until the step's weight update): see
            :meth:`~verl_mtp_plugin.rollout.monitor.spec_monitor.RolloutSpecMonitor.close_window`.
    """

    mtp_mode: str = ""
    mtp_base_mode: str = ""
    mtp_exclude_validation: bool = True
    mtp_close_window_at_sample_end: bool = False

    # verl reads self.trainer_mode for its mode-dependent code; it must see the base mode.
    @property
    def trainer_mode(self) -> str:
        return self.mtp_base_mode

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        if value not in (self.mtp_base_mode, self.mtp_mode):
            raise ValueError(
                f"{type(self).__name__} runs as trainer.v1.trainer_mode={self.mtp_mode} "
                f"(verl's {self.mtp_base_mode}); got trainer.v1.trainer_mode={value!r}"
            )

    def __init__(self, config):
        # the weight path must reach the drafter also when verl's own entry point (no start-up check) built us
        _refuse_weight_paths(config)
        # verl code that reads the settings block by the configured mode name (rollout skip cache:
        # trainer.v1.<trainer_mode>.parameter_sync_step) must find the base mode's block
        with open_dict(config):
            if self.mtp_mode not in config.trainer.v1:
                config.trainer.v1[self.mtp_mode] = copy.deepcopy(config.trainer.v1.get(self.mtp_base_mode, {}))
        # built here so an invalid verl_mtp_plugin.mtp_guard block fails before any GPU work (init())
        self.mtp_monitor = build_rollout_monitor(
            config, self._mtp_server_addresses, exclude_validation=self.mtp_exclude_validation
        )
        super().__init__(config)

    def _build_replay_buffer(self):
        # verl's buffer sleeps 2 s between its checks for finished samples (no config key): timing_s/gen would come
        # in 2-s multiples and each step would wait ~1 s after its rollout (compat/verl_replay_buffer.py)
        buffer = super()._build_replay_buffer()
        set_sample_poll(buffer, sample_poll_s(self.config))
        return buffer

    def _mtp_server_addresses(self) -> list[str]:
        out: list[str] = []
        for manager in self._rollout_server_managers():
            out.extend(getattr(manager, "server_addresses", None) or [])
        return out

    def fit(self, agent_loop_manager):
        super().fit(agent_loop_manager)
        # a desync on the last step (action=fail): verl has logged that step; stop with the error now
        self.mtp_monitor.raise_pending()

    def on_train_begin(self):
        # before the async trainers queue their warm-up rollouts (prompts re-issued from a checkpoint
        # are dispatched earlier, in fit(), and their first tokens are not counted)
        self.mtp_monitor.begin()
        super().on_train_begin()

    def on_validate_begin(self):
        self.mtp_monitor.pause()
        super().on_validate_begin()

    def on_validate_end(self):
        super().on_validate_end()
        self.mtp_monitor.resume()

    def on_step_begin(self):
        # a desync with action=fail stops the run here, after verl logged the step that found it
        self.mtp_monitor.raise_pending()
        super().on_step_begin()

    def on_sample_end(self):
        # before verl aborts the replicas' requests: what they generated after this point (from the weight update
        # at the step's end on) runs under the next weight version and counts toward the next step
        if self.mtp_close_window_at_sample_end:
            self.mtp_monitor.close_window()
        super().on_sample_end()

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        self.mtp_monitor.step_metrics(metrics, global_steps, raise_now=False)


@register_trainer("mtp_sync")
class MTPPPOTrainerSync(MTPRolloutMetricsMixin, PPOTrainerSync):
    """verl's ``sync`` trainer + rollout speculation metrics and the desync guard."""

    mtp_mode = "mtp_sync"
    mtp_base_mode = "sync"
    mtp_exclude_validation = True


@register_trainer("mtp_colocate_async")
class MTPPPOTrainerColocateAsync(MTPRolloutMetricsMixin, PPOTrainerColocateAsync):
    """verl's ``colocate_async`` trainer + rollout speculation metrics and the desync guard."""

    mtp_mode = "mtp_colocate_async"
    mtp_base_mode = "colocate_async"
    mtp_exclude_validation = False
    mtp_close_window_at_sample_end = True


@register_trainer("mtp_separate_async")
class MTPPPOTrainerSeparateAsync(MTPRolloutMetricsMixin, PPOTrainerSeparateAsync):
    """verl's ``separate_async`` trainer + rollout speculation metrics and the desync guard."""

    mtp_mode = "mtp_separate_async"
    mtp_base_mode = "separate_async"
    mtp_exclude_validation = False


_CLASSES = (MTPPPOTrainerSync, MTPPPOTrainerColocateAsync, MTPPPOTrainerSeparateAsync)
if {c.mtp_mode: c.mtp_base_mode for c in _CLASSES} != TRAINER_MODES:  # pragma: no cover - a coding error
    raise RuntimeError("verl_mtp_plugin.config_keys.TRAINER_MODES is out of date")
