"""How often verl's v1 trainer looks for the rollout's finished samples.

verl 0.9.1's v1 trainers take a step's batch from their replay buffer (``ReplayBuffer.sample``), which checks the
TransferQueue for finished rollouts and, until enough are there, sleeps ``poll_interval`` seconds between checks
(``ReplayBuffer._wait_for_next_poll``; the constructor's default is 2.0 and verl's config has no key for it). So
verl's ``timing_s/gen`` comes in whole multiples of the interval (measured on an H200: 2.04, 6.15, 8.15, 10.16 s),
and every step waits on average half an interval after its rollout ended: at 2 s that hides what speculation saves
on a rollout of a few seconds and costs ~1 s per step. The plugin's trainers set the interval from
``verl_mtp_plugin.sample_poll_s`` (:data:`SAMPLE_POLL_KEY`, default :data:`DEFAULT_SAMPLE_POLL_S`).
"""

from __future__ import annotations

import math
from typing import Any

from verl_mtp_plugin.config_keys import get_key
from verl_mtp_plugin.verl_config import _float_value

__all__ = ["DEFAULT_SAMPLE_POLL_S", "SAMPLE_POLL_KEY", "sample_poll_errors", "sample_poll_s", "set_sample_poll"]

#: The plugin's config key for the interval (top-level plugin namespace, like ``verl_mtp_plugin.mtp_guard``).
SAMPLE_POLL_KEY = "verl_mtp_plugin.sample_poll_s"
#: 50 ms: one TransferQueue snapshot per check (a Ray call to its controller) at 20 Hz is negligible next to a
#: rollout, and a step's batch is taken at most 50 ms after its last sample finished.
DEFAULT_SAMPLE_POLL_S = 0.05


def sample_poll_errors(config: Any) -> list[str]:
    """Start-up check of :data:`SAMPLE_POLL_KEY`: a positive finite number of seconds."""
    value = get_key(config, SAMPLE_POLL_KEY, None)
    if value is None:
        return []
    seconds = _float_value(value)  # the start-up check's reading of a number (not a bool, a numeric string)
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        return [f"{SAMPLE_POLL_KEY}={value!r}: the seconds between the trainer's checks for finished rollout samples "
                f"(verl's replay buffer poll interval) must be a number > 0 (default {DEFAULT_SAMPLE_POLL_S})"]
    return []


def sample_poll_s(config: Any) -> float:
    """The interval a checked config asks for (:data:`DEFAULT_SAMPLE_POLL_S` when unset)."""
    value = get_key(config, SAMPLE_POLL_KEY, None)
    return DEFAULT_SAMPLE_POLL_S if value is None else float(value)


def set_sample_poll(replay_buffer: Any, seconds: float) -> None:
    """Set verl's replay buffer poll interval (its private ``poll_interval``, read by ``_wait_for_next_poll``).

    A replay buffer without the attribute (a user's ``trainer.v1.sampler.custom_sampler`` or another verl) is left
    as it is: the attribute would do nothing there.
    """
    if hasattr(replay_buffer, "poll_interval"):
        replay_buffer.poll_interval = float(seconds)
