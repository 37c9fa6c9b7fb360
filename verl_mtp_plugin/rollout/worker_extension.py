"""vLLM worker extension that runs the plugin's MTP drafter sync inside verl's weight update.

Set ``actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls`` to
``verl_mtp_plugin.rollout.worker_extension.MTPColocateWorkerExtension``. The class is a subclass of
verl's ``vLLMColocateWorkerExtension`` (verl's bucketed IPC transfer, quantisation and LoRA paths are
kept) whose target-model loading is verl's and whose drafter loading is
:class:`~verl_mtp_plugin.rollout.drafter_sync.MTPDrafterSync` (MTP tensors to the drafter only, in one
verified load per update). It is built on first attribute access, so importing this module imports
neither verl nor vLLM.

Configuration: ``VERL_MTP_DRAFTER_SYNC=online|frozen`` (default ``online``),
``VERL_MTP_SYNC_CHECKSUM=1`` (default off), ``VERL_MTP_SYNC_STAGE=device|host`` (default ``device``),
or the RPC ``mtp_configure_sync``. Extra RPCs: ``mtp_sync_metrics``, ``mtp_drafter_digests``,
``mtp_mark_drafter_stale``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from verl_mtp_plugin.export.names import hf_mtp_pattern
from verl_mtp_plugin.rollout.drafter_sync import (
    DRAFTER_MODES,
    ENV_CHECKSUM,
    ENV_MODE,
    ENV_STAGE,
    STAGE_PLACES,
    MTPDrafterSync,
    MTPSyncError,
    drafter_digests,
    text_config,
)

__all__ = ["MTPColocateWorkerExtension"]

logger = logging.getLogger(__name__)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _drafter_loaded_at_start(vllm_config: Any) -> bool:
    """vLLM loaded real drafter weights at start-up unless the draft load format is ``dummy``."""
    from vllm.model_executor.model_loader.utils import get_draft_load_config

    return "dummy" not in str(get_draft_load_config(vllm_config).load_format).lower()


_DRAIN = object()  # active-sync marker: receive the stream, load nothing


def _build_extension_class() -> type:
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    class MTPColocateWorkerExtension(vLLMColocateWorkerExtension):
        """verl's colocated worker extension with MTP-only, verified drafter sync.

        For the target model ``update_weights_from_ipc`` is verl's (bucketed IPC receive, per-bucket
        ``load_weights`` of the non-MTP names, one post-processing at the end); the drafter is
        handled by :class:`MTPDrafterSync` (see the module docstring). LoRA adapter-only updates,
        engines without an MTP drafter and non-Nemotron-H drafters take verl's path untouched.
        """

        # ---------------------------------------------------------- helpers
        def _mtp_drafter_sync(self) -> MTPDrafterSync | None:
            """The sync object for this worker's drafter; None without an MTP drafter or for a
            drafter that is not a Nemotron-H MTP (those keep verl's path, with a warning)."""
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
            """verl's bucketed IPC update; MTP tensors go to the drafter only, once, verified."""
            if peft_config and base_sync_done:  # LoRA adapter-only update: no MTP weights
                return super().update_weights_from_ipc(peft_config, base_sync_done, use_shm)
            try:
                self._mtp_begin_update()
                setup_error = None
            except Exception as e:  # e.g. an unknown drafter structure
                # Still receive (and drop) the stream, so the trainer's sender does not block, then fail.
                setup_error, self._mtp_active_sync = e, _DRAIN
            try:
                result = super().update_weights_from_ipc(peft_config, base_sync_done, use_shm)
            except BaseException:
                self._mtp_abort_update()
                raise
            if setup_error is not None:
                self._mtp_active_sync = None
                raise MTPSyncError(f"MTP drafter sync setup failed; no weights were loaded: {setup_error}") from setup_error
            self._mtp_finish_update()
            return result

        def _update_weights(self, weights, peft_config, base_sync_done):
            sync = getattr(self, "_mtp_active_sync", None)
            if sync is _DRAIN:
                return None
            if sync is None or (peft_config and base_sync_done):
                return super()._update_weights(weights, peft_config, base_sync_done)
            target_part = sync.route(weights)
            if target_part:
                return super()._update_weights(target_part, peft_config, base_sync_done)
            return None

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
                raise MTPSyncError("this worker has no vLLM MTP drafter (speculative_config.method != 'mtp')")
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
                raise MTPSyncError("this worker has no vLLM MTP drafter")
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
