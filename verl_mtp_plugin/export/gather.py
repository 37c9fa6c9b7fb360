"""Megatron ``HybridModel`` MTP weights -> ``(hf_name, tensor)`` pairs, gathered over TP / expert-TP / EP.

Trainer side of the MTP weight sync. :func:`export_mtp_weights` walks the unwrapped model, maps every
name with :mod:`verl_mtp_plugin.export.names` before the first tensor is yielded (an MTP or backbone
name without a mapping raises :class:`~verl_mtp_plugin.export.names.MTPExportError` naming it: nothing
is dropped silently) and yields the HF tensors:

* A repeated MTP layer (``mtp_use_repeated_layer=True``; Nemotron 3 Super trains
  ``mtp_num_layers=2`` over one physical block) exists once in the model and is exported once, as
  the HF checkpoint and vLLM hold it.
* Shared tensors on request: ``backbone.embeddings.weight`` and ``lm_head.weight`` with Megatron's
  vocab padding trimmed to the HF vocab size; optionally the whole ``backbone.*``.
* Tensor/expert-parallel models: shards are all-gathered over the model's own TP / expert-TP / EP
  groups so that every rank gets the same full HF tensors as the unsharded model (vocab-parallel
  embedding and output rows gathered then trimmed, column/row-parallel linears concatenated along
  megatron's ``partition_dim``, routed expert ``e`` of EP rank ``r`` -> global ``r * E_local + e``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from verl_mtp_plugin.export.names import (
    WEIGHT_BUFFER_SUFFIXES,
    MTPExportError,
    megatron_to_hf_name,
    split_fused_qkv,
)

__all__ = ["export_mtp_weights"]


def _unwrap(model: Any) -> torch.nn.Module:
    from verl_mtp_plugin.control import unwrap_model

    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise MTPExportError(
                f"export_mtp_weights takes one model chunk, got {len(model)} (virtual pipeline stages are not supported)"
            )
        model = model[0]
    return unwrap_model(model)


def _named_weights(module: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(prefix=prefix)
    for n, b in module.named_buffers(prefix=prefix):
        if n.endswith(WEIGHT_BUFFER_SUFFIXES):
            yield n, b


_EXPERT_LOCAL_RE = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")
_EXPERT_GROUPED_RE = re.compile(r"(\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


class _Shards:
    """The model's tensor-, expert-tensor- and expert-parallel groups (``None`` / size 1 when unsharded).

    Taken from the model's own ``pg_collection`` (what its layers were built with), falling back to
    megatron's ``parallel_state`` when the model has none.
    """

    def __init__(self, inner: torch.nn.Module):
        pgc = getattr(inner, "pg_collection", None)
        dist = torch.distributed
        on = dist.is_available() and dist.is_initialized()

        def group(attr: str, getter: str):
            g = getattr(pgc, attr, None) if pgc is not None else None
            if g is None and on:
                from megatron.core import parallel_state

                if parallel_state.model_parallel_is_initialized():
                    g = getattr(parallel_state, getter)(check_initialized=False)
            return g

        self.tp = group("tp", "get_tensor_model_parallel_group")
        self.etp = group("expt_tp", "get_expert_tensor_parallel_group")
        self.ep = group("ep", "get_expert_model_parallel_group")

        def size(g) -> int:
            return dist.get_world_size(group=g) if (on and g is not None) else 1

        self.tp_size, self.etp_size, self.ep_size = size(self.tp), size(self.etp), size(self.ep)

    @property
    def sharded(self) -> bool:
        return max(self.tp_size, self.etp_size, self.ep_size) > 1


def _check_sharding(cfg: Any, shards: _Shards, include_backbone: bool) -> None:
    """The config's parallel sizes must be the sizes of the groups the export gathers over."""
    etp_cfg = getattr(cfg, "expert_tensor_parallel_size", None)
    has_experts = bool(getattr(cfg, "num_moe_experts", None))
    expected = {
        "tensor_model_parallel_size": (getattr(cfg, "tensor_model_parallel_size", 1) or 1, shards.tp_size, "tensor"),
    }
    if has_experts:
        expected["expert_model_parallel_size"] = (
            getattr(cfg, "expert_model_parallel_size", 1) or 1, shards.ep_size, "expert")
        expected["expert_tensor_parallel_size"] = (
            etp_cfg if etp_cfg is not None else expected["tensor_model_parallel_size"][0], shards.etp_size,
            "expert-tensor")
    bad = {k: v for k, v in expected.items() if v[0] != v[1]}
    if bad:
        raise NotImplementedError(
            "export_mtp_weights gathers shards over the model's own process groups, and the config disagrees "
            "with them: "
            + "; ".join(f"config.{k}={c} but the {kind}-parallel group has {g} rank(s)" for k, (c, g, kind) in bad.items())
            + ". A model whose config does not match the groups it was built with is not supported."
        )
    pp = getattr(cfg, "pipeline_model_parallel_size", 1) or 1
    if include_backbone and pp > 1:
        raise NotImplementedError(
            f"export_mtp_weights(include_backbone=True) needs the whole backbone on this rank; "
            f"pipeline_model_parallel_size={pp} splits it across stages. Export the MTP block (and shared "
            "tensors) on the last stage instead."
        )


def _all_gather(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(size)]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return parts


def _gather_tp(name: str, p: torch.Tensor, t: torch.Tensor, group, size: int) -> torch.Tensor:
    """Reassemble a tensor-parallel shard ``t`` of parameter ``p`` over ``group`` (all ranks get it).

    Megatron marks sharded parameters with ``tensor_model_parallel``/``partition_dim``
    (``ColumnParallelLinear``: 0, ``RowParallelLinear``: 1, ``VocabParallelEmbedding``: 0). A
    ``partition_sizes`` attribute (Mamba ``in_proj`` = ``[z, x, B, C, dt]``, ``conv1d`` = ``[x, B, C]``)
    means every rank holds one block of each component: the full tensor is component by component,
    rank by rank.
    """
    if size == 1 or not getattr(p, "tensor_model_parallel", False):
        return t
    dim = p.partition_dim  # partition_stride == 1 was checked before the first tensor was yielded
    parts = _all_gather(t, group, size)
    sizes = getattr(p, "partition_sizes", None)
    if sizes is None:
        return torch.cat(parts, dim)
    sizes = [int(x) for x in sizes]
    if sum(sizes) != t.shape[dim]:
        raise MTPExportError(f"{name}: partition_sizes {sizes} do not add up to the shard's {t.shape[dim]} rows")
    blocks = [x.split(sizes, dim) for x in parts]
    return torch.cat([blocks[r][j] for j in range(len(sizes)) for r in range(size)], dim)


def _expert_local_index(name: str) -> re.Match | None:
    """The match of a routed expert's local index (group 2) in a megatron name, ``None`` for other names."""
    return _EXPERT_LOCAL_RE.search(name) or _EXPERT_GROUPED_RE.search(name)


def _with_expert_index(name: str, m: re.Match, index: int) -> str:
    return name[: m.start(2)] + str(index) + name[m.end(2) :]


def _mtp_pattern_len(inner: torch.nn.Module) -> int | None:
    mtp = getattr(inner, "mtp", None)
    if mtp is None or not getattr(inner, "mtp_process", True) or len(getattr(mtp, "layers", ())) == 0:
        return None
    first = mtp.layers[0]
    mml = getattr(first, "mtp_model_layer", None)
    if mml is None or not hasattr(mml, "layers"):
        raise MTPExportError(
            f"{type(first).__qualname__} has no hybrid mtp_model_layer.layers: only HybridModel MTP is supported"
        )
    return len(mml.layers)


def export_mtp_weights(
    model: Any,
    *,
    vocab_size: int | None = None,
    include_shared: bool = False,
    include_backbone: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the model's MTP weights (and optionally the shared/base ones) under HF Nemotron-H names.

    Args:
        model: a megatron-core ``HybridModel``, possibly wrapped (DDP, ``Float16Module``) or a
            one-element list of model chunks. On a pipeline rank without the MTP block nothing
            MTP is yielded. Tensor/expert-parallel models are gathered (see *Sharded models*).
        vocab_size (int | None): the HF vocab size; Megatron's padded rows of the embedding and
            output layer are trimmed to it (``None``: no trimming).
        include_shared (bool): also yield ``backbone.embeddings.weight`` and ``lm_head.weight``
            (what a drafter that does not share them with the target needs).
        include_backbone (bool): also yield every ``backbone.*`` tensor and ``lm_head.weight``
            (the full HF stream; implies ``include_shared``).

    Yields:
        (str, Tensor): ``(hf_name, tensor)``; tensors are detached, on the model's device, in the
        model's dtype; the router's ``e_score_correction_bias`` is always fp32 (megatron keeps the
        ``expert_bias`` buffer in fp32; a bf16 copy, e.g. right after ``Float16Module`` wrapping,
        is upcast losslessly).
        Shapes: ``eh_proj [H, 2H]``, ``q_proj [np*hn, H]``, ``k_proj``/``v_proj [ng*hn, H]``,
        ``experts.{e}.up_proj [I, H or latent]``, embeddings/lm_head ``[vocab_size, H]``.

    Sharded models (TP, EP, expert-TP > 1):
        every shard is gathered with ``torch.distributed.all_gather`` over the process groups the
        model was built with (its ``pg_collection``: ``tp`` for dense layers, shared experts and the
        vocab-parallel embedding/output layer; ``expt_tp`` then ``ep`` for routed experts; megatron's
        ``parallel_state`` groups when the model has no collection). **Every rank of those groups
        gets the same full HF tensors**, identical to what the TP=EP=1 model yields. The generator
        issues collectives while it is consumed, so every rank of the model's TP/EP groups must
        iterate it completely and in lockstep (e.g. ``dict(export_mtp_weights(m))`` on all ranks).
        Layouts: parameters marked ``tensor_model_parallel`` are concatenated along megatron's
        ``partition_dim`` (fused QKV: each rank holds whole query groups ``[q, k, v]``, so the
        concatenation is the TP=1 fused layout, split afterwards); ``partition_sizes``
        (Mamba ``in_proj``/``conv1d``) are reassembled component by component; unmarked tensors
        (norms, router, expert bias, latent projections) are replicated and taken as they are.
        Routed expert ``e`` on EP rank ``r`` is global expert ``r * E_local + e``; with EP > 1 the
        experts are yielded local index by local index (global order ``0, E_local, ..., 1,
        E_local + 1, ...``), so compare by name. With TP=EP=1 nothing is gathered and the output
        is exactly the unsharded path's.

    Raises:
        MTPExportError: a parameter/buffer has no HF name (all such names are listed), or
            ``vocab_size`` exceeds the model's vocabulary.
        NotImplementedError: the config's parallel sizes disagree with the model's process
            groups; ``include_backbone`` with pipeline parallelism (the backbone is split across
            stages); a strided (``partition_stride != 1``) TP layout.
    """
    inner = _unwrap(model)
    cfg = getattr(inner, "config", None)
    shards = _Shards(inner)
    _check_sharding(cfg, shards, include_backbone)
    if getattr(cfg, "attention_output_gate", False):
        raise MTPExportError("attention_output_gate=True has no HF Nemotron-H counterpart")
    L = _mtp_pattern_len(inner)
    heads = cfg.num_attention_heads
    groups = cfg.num_query_groups or heads
    head_dim = cfg.kv_channels or cfg.hidden_size // heads
    num_experts = getattr(cfg, "num_moe_experts", None)
    local_experts = (num_experts // shards.ep_size) if num_experts else 0

    plan: list[tuple[str | tuple[str, str, str], str, torch.Tensor]] = []
    unknown: list[str] = []

    def add(name: str, t: torch.Tensor) -> None:
        hf = megatron_to_hf_name(name, L or 1)
        if hf is None:
            unknown.append(name)
            return
        if shards.sharded and getattr(t, "tensor_model_parallel", False) and getattr(t, "partition_stride", 1) != 1:
            raise NotImplementedError(
                f"{name}: partition_stride={t.partition_stride} (strided tensor-parallel layout) is not supported")
        if shards.ep_size > 1:
            found = _expert_local_index(name)
            if found is not None:
                e = int(found.group(2))
                if e >= local_experts:
                    raise MTPExportError(
                        f"{name}: local expert {e} >= num_moe_experts/expert_model_parallel_size = {local_experts}"
                    )
        plan.append((hf, name, t))

    if include_backbone:
        for name, t in _named_weights(inner, ""):
            if not name.startswith("mtp."):
                add(name, t)
    elif include_shared:
        for name, t in _named_weights(inner, ""):
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                add(name, t)
    if L is not None:
        for name, t in _named_weights(inner.mtp, "mtp"):
            add(name, t)
    if unknown:
        raise MTPExportError(
            f"{len(unknown)} parameter/buffer name(s) have no Hugging Face Nemotron-H mapping "
            f"(Mamba/bias/unknown modules inside MTP are not supported): {sorted(unknown)}"
        )

    def finish(hf: str | tuple[str, str, str], name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(hf, tuple):
            yield from zip(hf, split_fused_qkv(t, heads, groups, head_dim))
            return
        if name.endswith(".expert_bias") and t.dtype != torch.float32:
            t = t.float()  # HF/vLLM keep e_score_correction_bias in fp32 (lossless upcast)
        if hf in ("backbone.embeddings.weight", "lm_head.weight") and vocab_size is not None:
            if t.shape[0] < vocab_size:
                raise MTPExportError(f"{name} has {t.shape[0]} rows < vocab_size={vocab_size}")
            t = t[:vocab_size]
        yield hf, t

    def produce() -> Iterator[tuple[str, torch.Tensor]]:
        for hf, name, p in plan:
            t = p.detach()
            if not shards.sharded:
                yield from finish(hf, name, t)
                continue
            found = _expert_local_index(name)
            if found is None:  # dense / shared-expert / router / norm: tensor-parallel group
                yield from finish(hf, name, _gather_tp(name, p, t, shards.tp, shards.tp_size))
                continue
            # routed expert: expert-tensor-parallel shards, then one local expert per EP rank
            t = _gather_tp(name, p, t, shards.etp, shards.etp_size)
            if shards.ep_size == 1:
                yield from finish(hf, name, t)
                continue
            e = int(found.group(2))
            for r, part in enumerate(_all_gather(t, shards.ep, shards.ep_size)):
                global_name = _with_expert_index(name, found, r * local_experts + e)
                yield from finish(megatron_to_hf_name(global_name, L or 1), global_name, part)

    return produce()
