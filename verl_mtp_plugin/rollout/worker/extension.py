"""vLLM worker extension that runs the plugin's MTP drafter sync inside verl's weight update.

Set ``actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls`` to
``verl_mtp_plugin.rollout.worker_extension.MTPColocateWorkerExtension``. The class is a subclass of
verl's ``vLLMColocateWorkerExtension`` (verl's bucketed IPC transfer, quantisation and LoRA paths are
kept) whose target-model loading is verl's and whose drafter loading is
:class:`~verl_mtp_plugin.rollout.worker.drafter_sync.MTPDrafterSync` (MTP tensors to the drafter only, in one
verified load per update). It is built on first attribute access, so importing this module imports
neither verl nor vLLM.

Configuration: ``VERL_MTP_DRAFTER_SYNC=online|frozen`` (default ``online``),
``VERL_MTP_SYNC_CHECKSUM=1`` (default off), ``VERL_MTP_SYNC_STAGE=device|host`` (default ``device``),
``VERL_MTP_SYNC_RECV_TIMEOUT_S`` (default 300: how long the receiver waits for the trainer's next bucket
before it gives the update up), or the RPC ``mtp_configure_sync``. Extra RPCs: ``mtp_sync_metrics``,
``mtp_drafter_digests``, ``mtp_mark_drafter_stale``, ``mtp_drafter_place``.

The drafter is looked up on every vLLM model runner (V1 ``model_runner.drafter.model``, V2
``model_runner.get_draft_model()``; :mod:`verl_mtp_plugin.rollout.worker.drafter_lookup`); verl's own methods
that use the drafter (``_get_drafter_model``) see the same lookup. An engine that speculates with MTP but
whose drafter cannot be found fails its first update with the runner's class and the places looked at.

**A failed update fails fast, with its first cause.** verl's receiver hands each bucket to
``_update_weights``; if that raises, verl's receiver stops answering and the trainer's
``BucketedWeightSender`` waits for an acknowledgement forever (and verl's shared-memory clean-up then
raises ``BufferError`` over the real error). The extension instead records the first error, receives and
acknowledges the rest of the stream without loading it (the trainer's sender finishes at transfer speed),
and then raises :class:`~verl_mtp_plugin.rollout.worker.drafter_sync.MTPSyncError` from that error, naming the
bucket and what the engine now holds: the target has the buckets before the failing one, the drafter its
previous weights (it is loaded only after the whole stream has arrived and been checked). The next update
is a full update and reloads every tensor. If the trainer's sender dies mid-stream instead, the receiver
gives the update up after ``VERL_MTP_SYNC_RECV_TIMEOUT_S`` seconds without a bucket, and says so.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

from verl_mtp_plugin.config_keys import ENV_SYNC_RECV_TIMEOUT
from verl_mtp_plugin.export.names import hf_mtp_pattern
from verl_mtp_plugin.rollout.worker.drafter_lookup import DrafterNotFoundError, find_drafter_model, not_found_message
from verl_mtp_plugin.rollout.worker.drafter_sync import (
    DRAFTER_MODES,
    ENV_CHECKSUM,
    ENV_MODE,
    ENV_STAGE,
    STAGE_PLACES,
    MTPDrafterSync,
    MTPSyncError,
    cause_text,
    drafter_digests,
    text_config,
)

__all__ = ["MTPColocateWorkerExtension", "quantized_checkpoint_error"]  # noqa: F822 - lazy (__getattr__)

logger = logging.getLogger(__name__)


ENV_RECV_TIMEOUT = ENV_SYNC_RECV_TIMEOUT
DEFAULT_RECV_TIMEOUT_S = 300.0


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def recv_timeout_s() -> float:
    """``VERL_MTP_SYNC_RECV_TIMEOUT_S`` (seconds the receiver waits for the next bucket; > 0)."""
    raw = os.environ.get(ENV_RECV_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_RECV_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise MTPSyncError(f"{ENV_RECV_TIMEOUT}={raw!r}: must be a number of seconds > 0", phase="config")
    return value


class _ReceiveTimeout:
    """Within the block, new sockets of pyzmq's process-wide context (verl's receiver uses
    ``zmq.Context.instance()``) time out a receive after ``seconds`` instead of waiting forever."""

    def __init__(self, seconds: float):
        self.ms = max(1, int(seconds * 1000))

    def __enter__(self):
        import zmq

        self.ctx = zmq.Context.instance()
        self.previous = self.ctx.sockopts.get(zmq.RCVTIMEO)
        self.ctx.setsockopt(zmq.RCVTIMEO, self.ms)
        return self

    def __exit__(self, *exc):
        import zmq

        if self.previous is None:
            self.ctx.sockopts.pop(zmq.RCVTIMEO, None)
        else:
            self.ctx.setsockopt(zmq.RCVTIMEO, self.previous)
        return False


def _drafter_loaded_at_start(vllm_config: Any) -> bool:
    """vLLM loaded real drafter weights at start-up unless the draft load format is ``dummy``.

    vLLM 0.31 names the drafter's load config in ``get_draft_load_config``; earlier releases (0.26) have
    no such function and load the drafter with ``speculative_config.draft_load_config``, else the
    target's ``load_config``."""
    try:
        from vllm.model_executor.model_loader.utils import get_draft_load_config
    except ImportError:
        spec = getattr(vllm_config, "speculative_config", None)
        load_config = getattr(spec, "draft_load_config", None) or vllm_config.load_config
    else:
        load_config = get_draft_load_config(vllm_config)
    return "dummy" not in str(load_config.load_format).lower()


def quantized_checkpoint_error(vllm_config: Any) -> str | None:
    """Why the drafter sync refuses this engine's checkpoint, from the config vLLM loaded: a quantized
    checkpoint (``model_config.quantization``, or ``quantization_config`` in the HF config vLLM read), whose
    drafter cannot load the trainer's bf16 MTP tensors exactly. None when unquantized.

    The start-up check refuses a quantized local checkpoint (and a hub id in the local Hugging Face cache);
    a hub id it cannot resolve without network is refused here, at the first sync, before any weight is
    loaded."""
    model_config = getattr(vllm_config, "model_config", None)
    method = getattr(model_config, "quantization", None)
    hf = getattr(model_config, "hf_config", None)
    q = getattr(hf, "quantization_config", None) if hf is not None else None
    if q and not method:
        method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
        method = method or "unknown"
    if not method:
        return None
    model = getattr(model_config, "model", None)
    return (
        f"the checkpoint vLLM loaded ({model}) is quantized (quantization={method!r}): the trainer exports bf16 MTP "
        "tensors, which the quantized MTP drafter cannot load exactly; refused before any weight was loaded. "
        "Train and roll out from a bf16 checkpoint, or set actor_rollout_ref.model.mtp.enable_rollout=false"
    )


_DRAIN = object()  # active-sync marker: receive the stream, load nothing


class _FailedBucket(RuntimeError):
    """The first error of a failed update, as text (its traceback is in the worker's log)."""


def tensor_parallel_rank() -> int | None:
    """This vLLM worker's tensor-parallel rank (None where vLLM's parallel state is not initialised)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no parallel state (a worker built without one)
        return None


def _describe(weights) -> str:
    names = [n for n, _ in weights]
    return f"{len(names)} tensors {names[:3]}{' ...' if len(names) > 3 else ''}"


def _build_extension_class() -> type:
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    class MTPColocateWorkerExtension(vLLMColocateWorkerExtension):
        """verl's colocated worker extension with MTP-only, verified drafter sync.

        For the target model ``update_weights_from_ipc`` is verl's (bucketed IPC receive, per-bucket
        ``load_weights`` of the non-MTP names, one post-processing at the end); the drafter is
        handled by :class:`MTPDrafterSync` (see the module docstring). LoRA adapter-only updates,
        engines without an MTP drafter and non-Nemotron-H drafters take verl's path untouched.
        """

        # ---------------------------------------------------------- drafter lookup (V1 and V2 runners)
        def _get_drafter_model(self):
            """The drafter model on V1 (``.drafter.model``) and V2 (``get_draft_model()``) runners;
            verl's own ``_get_drafter_model`` knows V1 only."""
            return find_drafter_model(self.model_runner)[0]

        def mtp_drafter_place(self) -> dict:
            """Where this worker's drafter was found: ``{"place", "runner", "drafter"}`` (None without one)."""
            from verl_mtp_plugin.rollout.worker.drafter_lookup import runner_kind

            model, place = find_drafter_model(self.model_runner)
            return {
                "place": place,
                "runner": f"{type(self.model_runner).__module__}.{type(self.model_runner).__qualname__}",
                "runner_kind": runner_kind(self.model_runner),
                "drafter": type(model).__qualname__ if model is not None else None,
            }

        def _mtp_speculation_method(self) -> str | None:
            spec = getattr(self.model_runner.vllm_config, "speculative_config", None)
            return getattr(spec, "method", None) if spec is not None else None

        # ---------------------------------------------------------- helpers
        def _mtp_drafter_sync(self) -> MTPDrafterSync | None:
            """The sync object for this worker's drafter; None without MTP speculation or for a
            drafter that is not a Nemotron-H MTP (those keep verl's path, with a warning).

            Raises:
                DrafterNotFoundError: the engine speculates with MTP but no drafter model can be found.
            """
            if self._mtp_speculation_method() == "mtp" and self._get_drafter_model() is None:
                raise DrafterNotFoundError(not_found_message(self.model_runner, "mtp"))
            if not vLLMColocateWorkerExtension._use_mtp_drafter_weight_sync(self):
                return None
            target, drafter = self.model_runner.model, self._get_drafter_model()
            sync = getattr(self, "_mtp_sync_state", None)
            if sync is None or sync.drafter is not drafter or sync.target is not target:
                draft_config = self._get_draft_model_config()
                if not hf_mtp_pattern(text_config(draft_config)):
                    if not getattr(self, "_mtp_warned_unsupported", False):
                        logger.warning(
                            "MTP drafter %s has no Nemotron-H MTP pattern: verl's drafter sync is used unchanged",
                            type(drafter).__qualname__,
                        )
                        self._mtp_warned_unsupported = True
                    return None
                vc = self.model_runner.vllm_config
                opts = getattr(self, "_mtp_sync_options", {})
                sync = MTPDrafterSync(
                    target,
                    drafter,
                    draft_config,
                    vllm_config=vc,
                    mode=opts.get("mode") or os.environ.get(ENV_MODE, "online").strip().lower(),
                    drafter_loaded=_drafter_loaded_at_start(vc),
                    verify_checksums=opts.get("verify_checksums", _env_flag(ENV_CHECKSUM)),
                    stage=opts.get("stage") or os.environ.get(ENV_STAGE, "device").strip().lower(),
                )
                self._mtp_sync_state = sync
            return sync

        def _use_mtp_drafter_weight_sync(self):
            # While our sync runs, verl's per-bucket loading and post-processing see the target only.
            if getattr(self, "_mtp_active_sync", None) is not None:
                return False
            return super()._use_mtp_drafter_weight_sync()

        def _mtp_begin_update(self) -> MTPDrafterSync | None:
            if self._mtp_speculation_method() == "mtp":
                refusal = quantized_checkpoint_error(self.model_runner.vllm_config)
                if refusal is not None:
                    raise MTPSyncError(refusal, phase="setup")
            sync = self._mtp_drafter_sync()
            if sync is not None:
                sync.begin()
            self._mtp_active_sync = sync
            return sync

        def _mtp_finish_update(self) -> dict[str, float]:
            sync, self._mtp_active_sync = getattr(self, "_mtp_active_sync", None), None
            if sync is None or sync is _DRAIN:
                return {}
            metrics = sync.finish()
            logger.info("MTP drafter sync: %s", metrics)
            return metrics

        def _mtp_abort_update(self) -> None:
            sync, self._mtp_active_sync = getattr(self, "_mtp_active_sync", None), None
            if sync is not None and sync is not _DRAIN:
                sync.abort()

        # ---------------------------------------------------------- verl overrides
        def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
            """verl's bucketed IPC update; MTP tensors go to the drafter only, once, verified. A failure
            on the way drains the stream and raises its first cause (module docstring)."""
            if peft_config and base_sync_done:  # LoRA adapter-only update: no MTP weights
                return super().update_weights_from_ipc(peft_config, base_sync_done, use_shm)
            timeout = recv_timeout_s()
            self._mtp_failure = None
            self._mtp_buckets = 0
            self._mtp_in_update = True
            try:
                return self._mtp_update_weights_from_ipc(peft_config, base_sync_done, use_shm, timeout)
            except MTPSyncError as e:
                # vLLM's executor hands the trainer only the failing worker's message: name the worker
                where = self._mtp_worker_text()
                if where is None:
                    raise
                raise MTPSyncError(f"{where}: {e}", phase=e.phase) from e
            finally:
                self._mtp_in_update = False

        def _mtp_worker_text(self) -> str | None:
            """``vLLM worker rank R of W (tensor-parallel rank T)`` when the engine has several workers."""
            pc = getattr(getattr(self, "vllm_config", None), "parallel_config", None)
            world = int(getattr(pc, "world_size", 1) or 1)
            if world <= 1:
                return None
            text = f"vLLM worker rank {getattr(self, 'rank', '?')} of {world}"
            tp_rank = tensor_parallel_rank()
            return text if tp_rank is None else f"{text} (tensor-parallel rank {tp_rank})"

        def _mtp_update_weights_from_ipc(self, peft_config, base_sync_done, use_shm, timeout):
            try:
                self._mtp_begin_update()
            except Exception as e:  # e.g. no drafter to be found, an unknown drafter structure
                # Still receive (and drop) the stream, so the trainer's sender does not block, then fail.
                self._mtp_failure = ("setup", e, "before the first bucket", cause_text(e))
                self._mtp_active_sync = _DRAIN
            try:
                with _ReceiveTimeout(timeout):
                    result = super().update_weights_from_ipc(peft_config, base_sync_done, use_shm)
            except BaseException as e:
                failure = self._mtp_failure
                self._mtp_abort_update()
                if failure is not None:  # post-processing after a failed bucket: report the first cause
                    raise self._mtp_failure_error(failure) from failure[1]
                import zmq

                if isinstance(e, zmq.Again):
                    raise MTPSyncError(
                        f"weight update given up: no bucket from the trainer for {timeout:.0f} s after "
                        f"{self._mtp_buckets} bucket(s) ({ENV_RECV_TIMEOUT}); the trainer's sender stopped "
                        "mid-stream (its error is on the trainer side). " + self._mtp_state_after_failure(),
                        phase="transport",
                    ) from e
                raise
            failure = self._mtp_failure
            if failure is not None:
                self._mtp_abort_update()
                raise self._mtp_failure_error(failure) from failure[1]
            self._mtp_finish_update()
            return result

        def _mtp_state_after_failure(self) -> str:
            return (
                f"State: the target holds the {self._mtp_buckets} bucket(s) loaded before the failure (the "
                "rest of this update was not loaded); the drafter still holds its previous weights (it is "
                "loaded only after a complete, checked stream). The next update reloads every tensor."
            )

        def _mtp_failure_error(self, failure) -> MTPSyncError:
            phase, error, where, cause = failure
            if phase == "setup":
                return MTPSyncError(
                    f"MTP drafter sync setup failed; no weights were loaded ({cause}). "
                    "The stream was received and dropped, so the trainer's sender finished; target and drafter "
                    "still hold their previous weights.",
                    phase="setup",
                )
            return MTPSyncError(
                f"weight update failed (loading into vLLM, {where}): {cause}. "
                "The rest of the stream was received and dropped, so the trainer's sender finished. "
                + self._mtp_state_after_failure(),
                phase="load",
            )

        def _update_weights(self, weights, peft_config, base_sync_done):
            sync = getattr(self, "_mtp_active_sync", None)
            if sync is _DRAIN:
                return None
            try:
                if sync is None or (peft_config and base_sync_done):
                    out = super()._update_weights(weights, peft_config, base_sync_done)
                else:
                    target_part = sync.route(weights)
                    out = super()._update_weights(target_part, peft_config, base_sync_done) if target_part else None
            except Exception as e:
                if not getattr(self, "_mtp_in_update", False):  # called outside update_weights_from_ipc
                    raise
                where = f"bucket {self._mtp_buckets + 1}: {_describe(weights)}"
                cause = cause_text(e)
                logger.error("weight update failed at %s: %s; draining the rest of the stream\n%s", where, cause,
                             "".join(traceback.format_exception(e)))
                # Keep no reference to the exception: its traceback's frames hold this bucket's tensors,
                # views of verl's transfer buffer, and verl's shared-memory clean-up would then raise
                # BufferError over the real error. The trainer gets the cause's text; the worker log, the
                # traceback.
                self._mtp_failure = ("load", _FailedBucket(cause), where, cause)
                del e
                if sync is not None:
                    sync.abort()
                self._mtp_active_sync = _DRAIN
                return None
            # counted for the failure report (also when called without update_weights_from_ipc around it)
            self._mtp_buckets = getattr(self, "_mtp_buckets", 0) + 1
            return out

        # ---------------------------------------------------------- RPCs (collective_rpc)
        def mtp_configure_sync(
            self, mode: str | None = None, verify_checksums: bool | None = None, stage: str | None = None
        ) -> dict:
            """Set the drafter sync mode (``online``/``frozen``) and checksum mode; returns the settings."""
            opts = dict(getattr(self, "_mtp_sync_options", {}))
            if mode is not None:
                if mode not in DRAFTER_MODES:
                    raise ValueError(f"mode={mode!r}; allowed: {list(DRAFTER_MODES)}")
                opts["mode"] = mode
            if verify_checksums is not None:
                opts["verify_checksums"] = bool(verify_checksums)
            if stage is not None:
                if stage not in STAGE_PLACES:
                    raise ValueError(f"stage={stage!r}; allowed: {list(STAGE_PLACES)}")
                opts["stage"] = stage
            self._mtp_sync_options = opts
            sync = self._mtp_drafter_sync()
            if sync is None:
                raise MTPSyncError("this worker has no vLLM MTP drafter (speculative_config.method != 'mtp')",
                                   phase="setup")
            sync.mode = opts.get("mode", sync.mode)
            sync.verify_checksums = opts.get("verify_checksums", sync.verify_checksums)
            sync.stage = opts.get("stage", sync.stage)
            return {
                "mode": sync.mode,
                "verify_checksums": sync.verify_checksums,
                "stage": sync.stage,
                "drafter_loaded": sync.drafter_loaded,
            }

        def mtp_sync_metrics(self) -> dict[str, float]:
            """Metrics of the last update (``sync/bytes_target``, ``sync/bytes_drafter``, ...)."""
            sync = getattr(self, "_mtp_sync_state", None)
            return dict(sync.last_metrics) if sync is not None else {}

        def mtp_drafter_digests(self) -> dict[str, str]:
            """Digests of the drafter's own parameters (compare with ``export.hf_mtp_digests``)."""
            drafter = self._get_drafter_model()
            if drafter is None:
                raise MTPSyncError("this worker has no vLLM MTP drafter", phase="setup")
            return drafter_digests(drafter, self.model_runner.model)

        def mtp_mark_drafter_stale(self) -> None:
            """Make the next update load the drafter even in ``frozen`` mode (e.g. after its weights
            were discarded by a level-2 sleep)."""
            sync = self._mtp_drafter_sync()
            if sync is not None:
                sync.drafter_loaded = False

    MTPColocateWorkerExtension.__module__ = __name__
    MTPColocateWorkerExtension.__qualname__ = "MTPColocateWorkerExtension"
    return MTPColocateWorkerExtension


def __getattr__(name: str):
    if name == "MTPColocateWorkerExtension":
        cls = globals().get(name) or _build_extension_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
