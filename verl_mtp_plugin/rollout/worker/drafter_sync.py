"""vLLM side of the MTP weight sync: MTP tensors to the drafter only, verified, once per update.

verl's colocated worker extension (``vLLMColocateWorkerExtension``) hands every received bucket to
``load_weights`` of every model in ``_iter_all_models()``: the target *and* the MTP drafter, so the
drafter parses the whole model each sync, per bucket (vLLM loaders that need every MTP layer in one
call break), relies on its loader to drop what it does not know (silently), and is post-processed
by ``process_weights_after_loading`` after every update.

This module replaces that for the drafter:

* :func:`route_weights` / :class:`MTPDrafterSync` — plain code over a target model and a drafter
  model object (CPU tests drive it with real vLLM models from vLLM's own ``get_model``):

  - non-MTP names go to the target only; ``mtp.*`` names go to the drafter only; the embedding and
    ``lm_head`` also go to the drafter only when the drafter does not share them with the target,
    decided by module identity (vLLM 0.31's ``NemotronHMTP`` owns ``model.embed_tokens`` and
    ``lm_head`` until the proposer swaps in the target's; 0.33 has none);
  - the MTP tensors of one update are accumulated (copied out of the reused transfer buffer) and
    loaded in **one** drafter ``load_weights`` call inside vLLM's layerwise-reload lifecycle
    (``initialize_layerwise_reload`` -> ``load_weights`` -> ``finalize_layerwise_reload``), scoped to
    the drafter's own modules: checkpoint-format weights are processed exactly once, parameter
    storage is kept (CUDA graphs stay valid) and the shared target modules are not touched;
  - every update is verified: the names sent must equal the HF MTP key set of the drafter's config
    (checked *before* loading) and the names the drafter reports loaded must cover its own
    parameters; otherwise :class:`MTPSyncError` names the missing and unexpected keys. Optional
    checksum mode compares a digest of every drafter tensor with the digest of the HF tensors
    recomposed like vLLM stores them (``qkv = cat(q, k, v)``, ``w13 = stack(up_proj)``,
    ``w2 = stack(down_proj)``);
  - ``frozen`` mode loads the drafter once (from the checkpoint, or the first sync when vLLM
    started from dummy weights) and skips it afterwards: no copy, no load, no post-processing;
  - per-sync metrics: ``sync/bytes_target``, ``sync/bytes_drafter``, ``sync/drafter_seconds``, ...

The vLLM worker extension that drives it inside verl's weight update is
:mod:`verl_mtp_plugin.rollout.worker_extension`. This module imports only torch (and vLLM lazily,
inside a sync).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch

from verl_mtp_plugin.config_keys import ENV_DRAFTER_SYNC, ENV_SYNC_CHECKSUM, ENV_SYNC_STAGE
from verl_mtp_plugin.export.drafter import canonical_drafter_name, hf_mtp_digests, tensor_digest
from verl_mtp_plugin.export.names import expected_hf_mtp_keys

__all__ = [
    "DRAFTER_MODES",
    "ENV_CHECKSUM",
    "ENV_MODE",
    "ENV_STAGE",
    "STAGE_PLACES",
    "MTPDrafterSync",
    "MTPSyncError",
    "cause_text",
    "drafter_digests",
    "drafter_shared_param_names",
    "drafter_tensors",
    "is_mtp_name",
    "loaded_layout_readers",
    "register_loaded_layout_reader",
    "route_weights",
    "text_config",
]

logger = logging.getLogger(__name__)

ENV_MODE = ENV_DRAFTER_SYNC
ENV_CHECKSUM = ENV_SYNC_CHECKSUM
ENV_STAGE = ENV_SYNC_STAGE
STAGE_PLACES = ("device", "host")
DRAFTER_MODES = ("online", "frozen")

# Drafter parameters outside the MTP layers that a drafter may own, and their HF names.
_DRAFTER_SHARED_TO_HF = {"model.embed_tokens.weight": "backbone.embeddings.weight", "lm_head.weight": "lm_head.weight"}

WeightList = list[tuple[str, torch.Tensor]]


class MTPSyncError(RuntimeError):
    """The drafter would not hold exactly the trained MTP weights (the message names the keys).

    ``phase`` says where the update failed: ``"verify"`` (names, loaded set or checksums did not match:
    the data arrived, it is wrong), ``"load"`` (vLLM raised while loading a tensor), ``"transport"``
    (the stream stopped), ``"setup"`` (no drafter, unknown drafter structure), ``"config"``.
    """

    def __init__(self, message: str, *, phase: str = "verify"):
        super().__init__(message)
        self.phase = phase


def sharded_drafter(vllm_config: Any) -> str | None:
    """Why this vLLM rank holds only a shard of the drafter's parameters (``tensor_parallel_size=2``, expert
    parallel), or None when it holds whole tensors (what checksum mode compares)."""
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is None:
        return None
    why = []
    tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    if tp > 1:
        why.append(f"tensor_parallel_size={tp}")
    if getattr(pc, "enable_expert_parallel", False):
        why.append("enable_expert_parallel=true")
    return ", ".join(why) or None


_HF_EXPERT_RE = re.compile(r"mtp\.layers\.(\d+)\.mixer\.experts\.(\d+)\.")
_DRAFTER_EXPERTS_RE = re.compile(r"model\.layers\.(\d+)\.mixer\.experts$")


def local_experts(drafter: torch.nn.Module, vllm_config: Any = None) -> dict[int, frozenset[int]] | None:
    """The routed experts this vLLM rank keeps in each MoE layer of the drafter under expert parallelism:
    ``{MTP layer index: global expert ids}`` read from vLLM's own expert map (``expert_map[global] = local id, or
    -1 when another rank holds it``), or None when every rank keeps every expert (no expert parallelism, no MoE
    in the drafter, or an expert map this vLLM does not expose). With vLLM's expert load balancing
    (``enable_eplb``) experts move between ranks at run time: None (every expert is staged, as without EP)."""
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is not None and (not getattr(pc, "enable_expert_parallel", False) or getattr(pc, "enable_eplb", False)):
        return None
    out: dict[int, frozenset[int]] = {}
    for name, module in drafter.named_modules():
        m = _DRAFTER_EXPERTS_RE.fullmatch(name)
        if m is None:
            continue
        try:
            emap = getattr(module, "expert_map", None)
        except Exception:  # a property of a vLLM revision that cannot answer here: stage every expert
            return None
        if not isinstance(emap, torch.Tensor):
            return None
        out[int(m.group(1))] = frozenset(int(i) for i in torch.nonzero(emap.cpu() >= 0).flatten().tolist())
    return out or None


def cause_text(error: BaseException) -> str:
    """``Type: message`` of ``error``; for a bare ``assert`` (no message) the failing line instead."""
    text = str(error)
    if not text:
        tb = error.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None:
            import linecache

            frame = tb.tb_frame
            code = linecache.getline(frame.f_code.co_filename, tb.tb_lineno).strip()
            text = f"{code} at {frame.f_code.co_filename}:{tb.tb_lineno}"
    return f"{type(error).__name__}: {text}"


def is_mtp_name(name: str) -> bool:
    """True for HF MTP names (``mtp.*``, also under a VL ``language_model.`` prefix)."""
    return name.removeprefix("language_model.").startswith("mtp.")


def route_weights(
    weights: Iterable[tuple[str, torch.Tensor]], drafter_extra: Iterable[str] = ()
) -> tuple[WeightList, WeightList]:
    """Split HF-named tensors between the target and the drafter.

    Args:
        weights: ``(hf_name, tensor)`` pairs (one bucket or a whole stream).
        drafter_extra: non-MTP HF names the drafter also needs (``backbone.embeddings.weight`` /
            ``lm_head.weight`` when it does not share them with the target).

    Returns:
        (target, drafter): ``mtp.*`` only in ``drafter``; everything else in ``target``; names in
        ``drafter_extra`` in both.
    """
    extra = frozenset(drafter_extra)
    target: WeightList = []
    drafter: WeightList = []
    for name, t in weights:
        if is_mtp_name(name):
            drafter.append((name, t))
        else:
            target.append((name, t))
            if name.removeprefix("language_model.") in extra:
                drafter.append((name, t))
    return target, drafter


def drafter_shared_param_names(drafter: torch.nn.Module, target: torch.nn.Module | None) -> set[str]:
    """Names of drafter parameters that are the target's parameter objects (shared by identity)."""
    if target is None:
        return set()
    ids = {id(p) for p in target.parameters()}
    return {n for n, p in drafter.named_parameters() if id(p) in ids}


#: ``reader(module, attr, param, name)``: the tensor ``param`` (attribute ``attr`` of ``module``) as vLLM's loader
#: stored it, where a platform's post-processing moved it out of its parameter; ``None`` when it is not the reader's
#: kind. It raises :class:`MTPSyncError` when it cannot read the tensor back.
LoadedLayoutReader = Callable[[torch.nn.Module, str, torch.Tensor, str], "torch.Tensor | None"]

#: The registered readers, asked in order (the first answer counts). Nothing is registered on CUDA: vLLM keeps the
#: weights in their parameters there, and they are read directly. vLLM's CPU build repacks linear weights into its
#: CPU kernels: the CPU runtime (``verl_mtp_cpu``, the repository's second distribution) registers its reader when
#: it installs itself in a vLLM process.
_LOADED_LAYOUT_READERS: list[LoadedLayoutReader] = []


def register_loaded_layout_reader(reader: LoadedLayoutReader) -> None:
    """Add ``reader`` to the readers :func:`drafter_tensors` asks (once; registering it again is a no-op)."""
    if reader not in _LOADED_LAYOUT_READERS:
        _LOADED_LAYOUT_READERS.append(reader)


def loaded_layout_readers() -> tuple[LoadedLayoutReader, ...]:
    """The registered readers, in the order they are asked."""
    return tuple(_LOADED_LAYOUT_READERS)


def _loaded_layout(module: torch.nn.Module, attr: str, param: torch.Tensor, name: str) -> torch.Tensor:
    """``param`` (attribute ``attr`` of ``module``) as vLLM's loader stored it, before the platform's
    post-processing replaced it: the first registered reader's answer (:func:`register_loaded_layout_reader`),
    else the parameter itself.

    Raises:
        MTPSyncError: the tensor was emptied and no reader reads it back (never skipped).
    """
    for reader in _LOADED_LAYOUT_READERS:
        out = reader(module, attr, param, name)
        if out is not None:
            return out
    if param.numel() == 0:
        raise MTPSyncError(
            f"{name}: empty after vLLM's post-processing of {type(module).__qualname__} and no loaded-layout reader "
            "reads it back; cannot verify it (checksum mode)"
        )
    return param


def drafter_tensors(drafter: torch.nn.Module, target: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Every drafter-owned parameter in vLLM's *loaded* layout, by canonical name.

    The loaded layout is what ``load_weights`` writes from the checkpoint (``qkv_proj = cat(q, k, v)``,
    ``w13 = stack(up_proj)``, ``w2 = stack(down_proj)``; compare with
    :func:`~verl_mtp_plugin.export.drafter_layout` / :func:`~verl_mtp_plugin.export.hf_mtp_digests`).
    Platform post-processing that moves a weight out of its parameter (vLLM's CPU GEMM dispatch) is
    undone by the registered loaded-layout readers (see :func:`register_loaded_layout_reader`);
    parameters shared with ``target`` (embedding, ``lm_head``) are left out.
    """
    shared = drafter_shared_param_names(drafter, target)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()  # a parameter registered on two modules counts once (as in named_parameters)
    for mod_name, module in drafter.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{attr}" if mod_name else attr
            if name in shared or id(p) in seen:
                continue
            seen.add(id(p))
            out[canonical_drafter_name(name)] = _loaded_layout(module, attr, p, name)
    return out


def drafter_digests(drafter: torch.nn.Module, target: torch.nn.Module | None = None) -> dict[str, str]:
    """:func:`~verl_mtp_plugin.export.tensor_digest` of every drafter-owned parameter in vLLM's loaded
    layout (platform repacks undone, see :func:`drafter_tensors`), by canonical name; compare with the
    trainer's :func:`~verl_mtp_plugin.export.hf_mtp_digests`."""
    return {n: tensor_digest(t) for n, t in drafter_tensors(drafter, target).items()}


def _nbytes(weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in weights)


def _owned_roots(drafter: torch.nn.Module, target: torch.nn.Module | None) -> list[torch.nn.Module]:
    """Maximal drafter submodules that contain no module of the target (the reload scope)."""
    if target is None:
        return [drafter]
    target_ids = {id(m) for m in target.modules()}
    roots: list[torch.nn.Module] = []

    def walk(m: torch.nn.Module, name: str) -> None:
        if id(m) in target_ids:
            return
        if not any(id(s) in target_ids for s in m.modules()):
            roots.append(m)
            return
        direct = list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False))
        if direct:
            raise MTPSyncError(
                f"drafter module {name or '<root>'} holds tensors {[n for n, _ in direct]} next to modules "
                "shared with the target; cannot scope the reload to the drafter's own modules",
                phase="setup",
            )
        for child_name, c in m.named_children():
            walk(c, f"{name}.{child_name}" if name else child_name)

    walk(drafter, "")
    return roots


def _consume(pending: WeightList):
    """Yield ``pending``'s items in order, removing each from the list as it is handed out."""
    pending.reverse()
    while pending:
        yield pending.pop()


def text_config(model_config: Any) -> Any:
    """The text (language-model) HF config of a vLLM/HF model config."""
    hf = getattr(model_config, "hf_config", model_config)
    get_text = getattr(hf, "get_text_config", None)
    return get_text() if callable(get_text) else hf


class MTPDrafterSync:
    """Routes one update's tensors, loads the MTP drafter once per update and verifies it.

    One object per (target, drafter) pair, reused across updates (it remembers whether the
    drafter holds real weights, for ``frozen`` mode). Per update::

        sync.begin()
        for bucket in buckets:
            target_part = sync.route(bucket)   # load into the target as before
        metrics = sync.finish()                # drafter: one load_weights call + checks

    or ``sync.sync(named_tensors, load_target=...)`` for all three.

    Args:
        target (nn.Module | None): vLLM's target model (``model_runner.model``); used to detect the
            modules the drafter shares with it.
        drafter (nn.Module): vLLM's drafter model (``model_runner.drafter.model``).
        draft_model_config: vLLM ``ModelConfig`` of the drafter (``speculative_config.draft_model_config``).
        vllm_config: vLLM config made current while loading (optional).
        mode (str): ``"online"`` (load every update) or ``"frozen"`` (load once).
        drafter_loaded (bool): the drafter already holds real MTP weights (vLLM loaded them from the
            checkpoint, i.e. ``load_format`` is not ``"dummy"``). ``frozen`` still loads it on the first update:
            the trainer's frozen block is the one to draft with, and after a resume of a checkpoint trained
            online it is not the HF checkpoint's; later updates skip it.
        verify_checksums (bool): compare tensor digests after every drafter load.
        stage (str): where the MTP part of an update waits until the drafter is loaded: ``"device"``
            (a copy on the tensors' device, the default) or ``"host"`` (a copy in host memory, pinned
            when CUDA is available: the update then costs the rollout GPU no extra memory for the
            staged payload, at the price of one device-to-host and one host-to-device copy of it).
    """

    def __init__(
        self,
        target: torch.nn.Module | None,
        drafter: torch.nn.Module,
        draft_model_config: Any,
        *,
        vllm_config: Any = None,
        mode: str = "online",
        drafter_loaded: bool = False,
        verify_checksums: bool = False,
        stage: str = "device",
    ) -> None:
        if mode not in DRAFTER_MODES:
            raise ValueError(f"{ENV_MODE}/mode={mode!r}; allowed: {list(DRAFTER_MODES)}")
        if stage not in STAGE_PLACES:
            raise ValueError(f"{ENV_STAGE}/stage={stage!r}; allowed: {list(STAGE_PLACES)}")
        self.stage = stage
        self.target = target
        self.drafter = drafter
        self.draft_model_config = draft_model_config
        self.vllm_config = vllm_config
        self.mode = mode
        self.drafter_loaded = bool(drafter_loaded)
        self.synced = False  # an update loaded the drafter (frozen: once)
        self.verify_checksums = verify_checksums
        self.expected_mtp_keys = frozenset(expected_hf_mtp_keys(text_config(draft_model_config)))
        if not self.expected_mtp_keys:
            raise MTPSyncError("the drafter's config declares no MTP layers (num_nextn_predict_layers=0)")
        self.post_process_count = 0  # drafter reload/post-processing cycles run
        self.sync_count = 0
        self.last_metrics: dict[str, float] = {}
        self._active = False
        self._pending: WeightList = []

    @property
    def verify_checksums(self) -> bool:
        """Checksum mode (:data:`ENV_CHECKSUM`): compare a digest of every drafter tensor after each load."""
        return self._verify_checksums

    @verify_checksums.setter
    def verify_checksums(self, on: bool) -> None:
        why = sharded_drafter(self.vllm_config) if on else None
        if why:
            raise MTPSyncError(
                f"{ENV_CHECKSUM}=1 (checksum mode) compares whole tensors, but this vLLM rank holds a shard of the "
                f"drafter ({why}): every update would fail; unset {ENV_CHECKSUM} (every update still checks names, "
                "shapes and the exact loaded set, and the desync guard judges generation)",
                phase="config",
            )
        self._verify_checksums = bool(on)

    # ---------------------------------------------------------------- structure
    def drafter_structure(self) -> tuple[set[str], set[str], dict[str, str]]:
        """``(own, shared, extra)``: drafter-owned parameter names, names shared with the target,
        and the HF name -> parameter name of owned non-MTP parameters (embedding / ``lm_head``)."""
        shared = drafter_shared_param_names(self.drafter, self.target)
        own = {n for n, _ in self.drafter.named_parameters()} - shared
        extra: dict[str, str] = {}
        for n in sorted(own):
            if n.startswith("model.layers."):
                continue
            hf = _DRAFTER_SHARED_TO_HF.get(n)
            if hf is None:
                raise MTPSyncError(
                    f"drafter parameter {n!r} is neither an MTP layer parameter nor the embedding/lm_head "
                    f"({type(self.drafter).__qualname__}); unknown drafter structure",
                    phase="setup",
                )
            extra[hf] = n
        return own, shared, extra

    # ---------------------------------------------------------------- update lifecycle
    def begin(self) -> None:
        """Start an update (decides whether the drafter is loaded this time)."""
        if self._active:
            raise MTPSyncError("begin() called twice without finish()/abort()")
        self._own, self._shared, self._extra = self.drafter_structure()
        self._load = self.mode == "online" or not (self.drafter_loaded and self.synced)
        self._pending = []
        self._not_local: list[str] = []  # MTP expert names received, kept by another vLLM rank (not staged)
        self._local_experts = local_experts(self.drafter, self.vllm_config) if self._load else None
        self._bytes = {"received": 0, "target": 0, "drafter": 0, "skipped": 0, "not_local": 0}
        self._ntensors = {"target": 0, "drafter": 0}
        self._t0 = time.perf_counter()
        self._active = True

    def route(self, weights: Iterable[tuple[str, torch.Tensor]]) -> WeightList:
        """Route one bucket: returns the target's part; keeps a copy of the drafter's part.

        The copy is needed because transfer buffers are reused between buckets; it is made on the
        tensors' device and lives until :meth:`finish` (Nemotron 3 Super: ~5.5 GiB of MTP weights in
        bf16 per rollout rank; ``benchmarks/sync_cost.py memory`` measures the peak). Nothing is copied when
        the drafter is skipped (``frozen``).

        Why the MTP part is not streamed into the drafter bucket by bucket: the update must be checked
        against the drafter's key set before anything is loaded (vLLM's loaders drop unknown names
        silently), and a missing name is known only after the last bucket (verl's bucketed transfer
        sends no name list ahead of the data). vLLM's layerwise reload writes a layer into the live
        drafter parameters as soon as that layer's tensors are complete (``online_process_loader`` ->
        ``_layerwise_process``), so per-bucket loading would leave earlier layers updated when a later
        name turns out missing; and it keeps references to the tensors of a layer that spans buckets
        (``info.loaded_weights``), which a reused transfer buffer would overwrite. So one copy of the
        MTP part stays; :meth:`finish` releases each staged tensor as soon as vLLM has consumed it.
        """
        if not self._active:
            raise MTPSyncError("route() outside begin()/finish()")
        weights = list(weights)
        target, drafter = route_weights(weights, self._extra)
        self._bytes["received"] += _nbytes(weights)
        self._bytes["target"] += _nbytes(target)
        self._ntensors["target"] += len(target)
        if self._load:
            if self._local_experts is not None:
                local = [self._is_local(n) for n, _ in drafter]
                elsewhere = [w for w, here in zip(drafter, local) if not here]
                self._not_local.extend(n for n, _ in elsewhere)
                self._bytes["not_local"] += _nbytes(elsewhere)
                drafter = [w for w, here in zip(drafter, local) if here]
            self._pending.extend((n, self._stage_copy(t)) for n, t in drafter)
            self._bytes["drafter"] += _nbytes(drafter)
            self._ntensors["drafter"] += len(drafter)
        else:
            self._bytes["skipped"] += _nbytes(drafter)
        return target

    def _is_local(self, name: str) -> bool:
        """False for a routed expert of the drafter that another vLLM expert-parallel rank keeps: vLLM's expert
        weight loader would drop it here (``expert_map[id] == -1``), so it is neither copied nor loaded. Its name
        still counts in the update's name check (a missing expert fails on every rank)."""
        m = _HF_EXPERT_RE.match(name.removeprefix("language_model."))
        if m is None:
            return True
        kept = self._local_experts.get(int(m.group(1)))
        return kept is None or int(m.group(2)) in kept

    def _stage_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` that outlives the transfer buffer: on its device, or in host memory."""
        t = t.detach()
        if self.stage == "host" and t.device.type != "cpu":
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
            out.copy_(t)  # blocking: the transfer buffer is reused as soon as route() returns
            return out
        return t.clone()

    def abort(self) -> None:
        """Drop an update in progress (the drafter is untouched)."""
        self._active = False
        self._pending = []
        self._not_local = []

    def finish(self) -> dict[str, float]:
        """Load the accumulated MTP tensors into the drafter (one call), verify, return metrics.

        Raises:
            MTPSyncError: names missing/unexpected (before loading), parameters not loaded, or a
                checksum mismatch.
        """
        if not self._active:
            raise MTPSyncError("finish() without begin()")
        t1 = time.perf_counter()
        try:
            if self._load:
                try:
                    self._load_drafter(self._pending)
                except MTPSyncError:
                    raise
                except Exception as e:
                    self.drafter_loaded = False  # frozen mode too: the next update loads it in full
                    raise MTPSyncError(
                        f"loading the MTP drafter failed: {cause_text(e)}. State: the target holds this update; "
                        "the drafter may hold part of it (vLLM's layerwise reload writes each layer as it "
                        "completes); the next update reloads the drafter in full.",
                        phase="load",
                    ) from e
                self.drafter_loaded = self.synced = True
        finally:
            self._active = False
            self._pending = []
            self._not_local = []
        t2 = time.perf_counter()
        self.sync_count += 1
        received = self._bytes["received"]
        self.last_metrics = {
            "sync/bytes_received": float(received),
            "sync/bytes_target": float(self._bytes["target"]),
            "sync/bytes_drafter": float(self._bytes["drafter"]),
            "sync/bytes_drafter_skipped": float(self._bytes["skipped"]),
            "sync/bytes_drafter_not_local": float(self._bytes["not_local"]),
            "sync/drafter_share": float(self._bytes["drafter"]) / received if received else 0.0,
            "sync/tensors_target": float(self._ntensors["target"]),
            "sync/tensors_drafter": float(self._ntensors["drafter"]),
            "sync/drafter_loaded": 1.0 if self._load else 0.0,
            "sync/drafter_seconds": t2 - t1,
            "sync/seconds": t2 - self._t0,
            "sync/count": float(self.sync_count),
        }
        return dict(self.last_metrics)

    def sync(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        load_target: Callable[[WeightList], Any] | None = None,
        bucket_tensors: int | None = None,
    ) -> dict[str, float]:
        """One whole update from ``(hf_name, tensor)`` pairs: :meth:`begin`, :meth:`route` (in buckets
        of ``bucket_tensors`` tensors, like a bucketed transport; default one bucket), the target's
        part of each bucket to ``load_target``, :meth:`finish`. Returns the metrics."""
        self.begin()
        try:
            # stream: only the current bucket (and the staged MTP part) is held, never the whole update
            it = iter(weights)
            while True:
                bucket = list(itertools.islice(it, bucket_tensors)) if bucket_tensors else list(it)
                if not bucket:
                    break
                part = self.route(bucket)
                del bucket
                if load_target is not None and part:
                    load_target(part)
                del part
                if not bucket_tensors:
                    break
        except BaseException:
            self.abort()
            raise
        return self.finish()

    # ---------------------------------------------------------------- drafter load
    def _check_names(self, names: list[str]) -> None:
        sent = [n.removeprefix("language_model.") for n in names]
        dup = sorted(n for n, c in Counter(sent).items() if c > 1)
        expected = set(self.expected_mtp_keys) | set(self._extra)
        missing = sorted(expected - set(sent))
        unexpected = sorted(set(sent) - expected)
        if missing or unexpected or dup:
            raise MTPSyncError(
                "MTP update does not match the drafter (nothing was loaded): "
                f"{len(missing)} missing {missing[:20]}{' ...' if len(missing) > 20 else ''}; "
                f"{len(unexpected)} unexpected {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}"
                f"{f'; duplicated {dup}' if dup else ''}. Expected the HF MTP keys of the drafter's config"
                f"{' plus ' + str(sorted(self._extra)) if self._extra else ''}."
            )

    def _vllm_context(self):
        if self.vllm_config is None:
            return contextlib.nullcontext()
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)

    def _load_drafter(self, pending: WeightList) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        self._check_names([n for n, _ in pending] + self._not_local)
        roots = _owned_roots(self.drafter, self.target)
        with self._vllm_context():
            for r in roots:
                initialize_layerwise_reload(r)
            # Without checksum mode nothing needs the staged tensors after vLLM has consumed them:
            # hand them over one by one (vLLM keeps a layer's tensors only until it processes the layer).
            feed = iter(pending) if self.verify_checksums else _consume(pending)
            try:
                loaded = set(self.drafter.load_weights(feed))
            finally:
                # Always finalize: it processes what was loaded and puts the kept tensors back.
                for r in roots:
                    finalize_layerwise_reload(r, self.draft_model_config)
                self.post_process_count += 1
        params = {n for n, _ in self.drafter.named_parameters()}
        missing = sorted(self._own - loaded)
        unexpected = sorted(loaded - params)
        if missing or unexpected:
            raise MTPSyncError(
                f"drafter {type(self.drafter).__qualname__} did not load exactly its own parameters: "
                f"missing {missing}; unexpected {unexpected} (vLLM drops unknown names silently)"
            )
        if self.verify_checksums:
            self._verify_digests(pending)

    def _verify_digests(self, pending: WeightList) -> None:
        """Compare a digest of every drafter-owned tensor, read back in vLLM's loaded layout (a platform's
        repack undone by the registered readers, :func:`drafter_tensors`),
        with the digest of the sent HF tensors recomposed into that layout. A tensor that cannot be
        read back raises; nothing is skipped."""
        expected = hf_mtp_digests([(n.removeprefix("language_model."), t) for n, t in pending])
        own = {canonical_drafter_name(n) for n in self._own}
        actual = {n: t for n, t in drafter_tensors(self.drafter, self.target).items() if n in own}
        problems = []
        for name in sorted(set(expected) | set(actual)):
            if name not in actual or name not in expected:
                problems.append(f"{name}: {'no drafter parameter' if name not in actual else 'nothing sent'}")
                continue
            got = tensor_digest(actual[name])
            if got.split(":")[0] != expected[name].split(":")[0]:
                problems.append(
                    f"{name}: {actual[name].numel()} elements, sent {expected[name].split(':')[0]} "
                    "(a shard? checksum mode compares whole tensors)"
                )
            elif got != expected[name]:
                problems.append(f"{name}: digest {got} != sent {expected[name]}")
        if problems:
            raise MTPSyncError(f"drafter checksum mismatch for {len(problems)} tensor(s): {problems}")
