"""Megatron ``HybridModel`` MTP weights -> Hugging Face Nemotron-H names (what vLLM's drafter loads).

Trainer side of the MTP weight sync (issue 4). :func:`export_mtp_weights` walks the unwrapped model
and yields ``(hf_name, tensor)``:

* Megatron ``mtp.layers.{d}.mtp_model_layer.layers.{i}.*`` -> HF ``mtp.layers.{d*L+i}.*``
  (``L`` = length of the MTP pattern); the block-level ``enorm``/``hnorm``/``eh_proj`` go to the
  first inner layer ``d*L``, ``final_layernorm`` to the last ``d*L+L-1`` (Megatron-Bridge's
  ``_MTPFlatteningMapping``).
* Fused attention ``linear_qkv`` is split into ``q_proj``/``k_proj``/``v_proj``. Megatron stores it
  interleaved per query group ``g``: ``[q heads of g (np/ng * hn rows), k_g (hn), v_g (hn)]``
  (``Attention.get_query_key_value_tensors``); :func:`split_fused_qkv` undoes that.
* MoE: ``router.weight`` -> ``mixer.gate.weight``, the ``router.expert_bias`` **buffer** ->
  ``mixer.gate.e_score_correction_bias`` (dtype kept: fp32 in a bf16 model), latent projections,
  shared experts, routed experts (local ``SequentialMLP`` names and Transformer-Engine grouped
  ``linear_fc1.weight{e}`` names).
* Norms: local-spec ``input_layernorm`` / ``pre_mlp_layernorm`` / ``norm`` and the TE fused
  ``…layer_norm_weight`` names all become ``norm.weight``.
* A repeated MTP layer (``mtp_use_repeated_layer=True``; Nemotron 3 Super trains
  ``mtp_num_layers=2`` over one physical block) exists once in the model and is exported once, as
  the HF checkpoint and vLLM hold it.
* Shared tensors on request: ``backbone.embeddings.weight`` and ``lm_head.weight`` with Megatron's
  vocab padding trimmed to the HF vocab size; optionally the whole ``backbone.*``.

Every name is mapped before the first tensor is yielded; an MTP (or backbone) name without a
mapping raises :class:`MTPExportError` naming it: nothing is dropped silently.

Tensor/expert-parallel models (issue 8): shards are all-gathered over the model's own TP / expert-TP /
EP groups so that every rank gets the same full HF tensors as the unsharded model (vocab-parallel
embedding and output rows gathered then trimmed, column/row-parallel linears concatenated along
megatron's ``partition_dim``, routed expert ``e`` of EP rank ``r`` -> global ``r * E_local + e``).

Also here (pure torch, no vLLM import): :func:`expected_hf_mtp_keys` (the HF MTP key set implied by
a ``config.json``), :func:`drafter_layout` (HF tensors recomposed the way vLLM's ``NemotronHMTP``
stores them) and :func:`hf_mtp_digests` / :func:`tensor_digest` for the sync's checksum mode.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "MTPExportError",
    "canonical_drafter_name",
    "drafter_layout",
    "expected_hf_mtp_keys",
    "export_mtp_weights",
    "fuse_qkv",
    "hf_mtp_digests",
    "hf_mtp_pattern",
    "megatron_to_hf_name",
    "split_fused_qkv",
    "tensor_digest",
]


class MTPExportError(ValueError):
    """A parameter/buffer cannot be mapped to a Hugging Face Nemotron-H name (the message names it)."""


# --------------------------------------------------------------------------------------------
# Name mapping
# --------------------------------------------------------------------------------------------

_QKV = "<qkv>"  # marker: split into q_proj / k_proj / v_proj

# (megatron suffix inside one layer, HF suffix template, layer kind). Templates use {0} for the
# captured expert index. "any" rules apply to every layer kind.
_LAYER_RULES: list[tuple[re.Pattern, str, str]] = [
    (re.compile(p), hf, kind)
    for p, hf, kind in [
        # norms (local spec: separate norm modules; TE spec: fused into the next linear)
        (r"input_layernorm\.weight", "norm.weight", "attention"),
        (r"self_attention\.linear_qkv\.layer_norm_weight", "norm.weight", "attention"),
        (r"pre_mlp_layernorm\.weight", "norm.weight", "mlp"),
        (r"mlp\.linear_fc1\.layer_norm_weight", "norm.weight", "mlp"),
        (r"norm\.weight", "norm.weight", "mamba"),
        (r"mixer\.in_proj\.layer_norm_weight", "norm.weight", "mamba"),
        # attention
        (r"self_attention\.linear_qkv\.weight", _QKV, "attention"),
        (r"self_attention\.linear_proj\.weight", "mixer.o_proj.weight", "attention"),
        # dense MLP ('-')
        (r"mlp\.linear_fc1\.weight", "mixer.up_proj.weight", "mlp"),
        (r"mlp\.linear_fc2\.weight", "mixer.down_proj.weight", "mlp"),
        # MoE ('E')
        (r"mlp\.router\.weight", "mixer.gate.weight", "mlp"),
        (r"mlp\.router\.expert_bias", "mixer.gate.e_score_correction_bias", "mlp"),
        (r"mlp\.fc1_latent_proj\.weight", "mixer.fc1_latent_proj.weight", "mlp"),
        (r"mlp\.fc2_latent_proj\.weight", "mixer.fc2_latent_proj.weight", "mlp"),
        (r"mlp\.shared_experts\.linear_fc1\.weight", "mixer.shared_experts.up_proj.weight", "mlp"),
        (r"mlp\.shared_experts\.linear_fc2\.weight", "mixer.shared_experts.down_proj.weight", "mlp"),
        (r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.weight", "mixer.experts.{0}.up_proj.weight", "mlp"),
        (r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight", "mixer.experts.{0}.down_proj.weight", "mlp"),
        (r"mlp\.experts\.linear_fc1\.weight(\d+)", "mixer.experts.{0}.up_proj.weight", "mlp"),
        (r"mlp\.experts\.linear_fc2\.weight(\d+)", "mixer.experts.{0}.down_proj.weight", "mlp"),
        # Mamba ('M'); backbone only (HF Nemotron-H MTP has no Mamba layer)
        (r"mixer\.in_proj\.weight", "mixer.in_proj.weight", "mamba"),
        (r"mixer\.conv1d_weight", "mixer.conv1d.weight", "mamba"),
        (r"mixer\.conv1d_bias", "mixer.conv1d.bias", "mamba"),
        (r"mixer\.conv1d\.weight", "mixer.conv1d.weight", "mamba"),
        (r"mixer\.conv1d\.bias", "mixer.conv1d.bias", "mamba"),
        (r"mixer\.A_log", "mixer.A_log", "mamba"),
        (r"mixer\.D", "mixer.D", "mamba"),
        (r"mixer\.dt_bias", "mixer.dt_bias", "mamba"),
        (r"mixer\.norm\.weight", "mixer.norm.weight", "mamba"),
        (r"mixer\.out_proj\.weight", "mixer.out_proj.weight", "mamba"),
    ]
]

# Buffers that are weights (everything else, e.g. router.local_tokens_per_expert, is runtime state).
_WEIGHT_BUFFER_SUFFIXES = (".expert_bias",)

_MTP_BLOCK_RE = re.compile(r"mtp\.layers\.(\d+)\.(enorm\.weight|hnorm\.weight|eh_proj\.weight|final_layernorm\.weight)")
_MTP_INNER_RE = re.compile(r"mtp\.layers\.(\d+)\.mtp_model_layer\.layers\.(\d+)\.(.+)")
_DECODER_RE = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def _map_layer_suffix(suffix: str) -> tuple[str, str] | None:
    for rx, hf, kind in _LAYER_RULES:
        m = rx.fullmatch(suffix)
        if m:
            return (hf.format(*m.groups()) if hf != _QKV else _QKV), kind
    return None


def megatron_to_hf_name(name: str, mtp_pattern_len: int) -> str | tuple[str, str, str] | None:
    """HF Nemotron-H name(s) of one Megatron ``HybridModel`` parameter/buffer name.

    Args:
        name (str): name relative to the unwrapped model, e.g.
            ``mtp.layers.0.mtp_model_layer.layers.1.mlp.router.expert_bias``.
        mtp_pattern_len (int): ``L``, the number of inner layers per MTP depth.

    Returns:
        the HF name; a ``(q, k, v)`` name triple for a fused QKV weight; ``None`` when the name has
        no HF counterpart (e.g. a Mamba layer inside MTP, a bias). Vocab trimming and value
        transforms are applied by :func:`export_mtp_weights`.
    """
    m = _MTP_BLOCK_RE.fullmatch(name)
    if m:
        d, leaf = int(m.group(1)), m.group(2)
        inner = mtp_pattern_len - 1 if leaf.startswith("final_layernorm") else 0
        return f"mtp.layers.{d * mtp_pattern_len + inner}.{leaf}"
    m = _MTP_INNER_RE.fullmatch(name)
    if m:
        d, i, suffix = int(m.group(1)), int(m.group(2)), m.group(3)
        mapped = _map_layer_suffix(suffix)
        if mapped is None or mapped[1] == "mamba":
            return None
        prefix = f"mtp.layers.{d * mtp_pattern_len + i}."
    else:
        m = _DECODER_RE.fullmatch(name)
        if m:
            mapped = _map_layer_suffix(m.group(2))
            if mapped is None:
                return None
            prefix = f"backbone.layers.{int(m.group(1))}."
        else:
            return {
                "embedding.word_embeddings.weight": "backbone.embeddings.weight",
                "output_layer.weight": "lm_head.weight",
                "decoder.final_norm.weight": "backbone.norm_f.weight",
                "decoder.final_layernorm.weight": "backbone.norm_f.weight",
            }.get(name)
    hf, _ = mapped
    if hf == _QKV:
        return tuple(f"{prefix}mixer.{x}_proj.weight" for x in "qkv")  # type: ignore[return-value]
    return prefix + hf


# --------------------------------------------------------------------------------------------
# QKV layout
# --------------------------------------------------------------------------------------------


def split_fused_qkv(
    w: torch.Tensor, num_heads: int, num_query_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split Megatron's fused QKV weight into HF ``q_proj``, ``k_proj``, ``v_proj``.

    Args:
        w (Tensor): ``[ng * (np/ng + 2) * hn, ...]``, interleaved per query group ``g`` as
            ``[q heads of g, k_g, v_g]`` (np = ``num_heads``, ng = ``num_query_groups``,
            hn = ``head_dim``).

    Returns:
        q ``[np * hn, ...]``, k ``[ng * hn, ...]``, v ``[ng * hn, ...]`` (copies, dtype kept).
    """
    if num_heads % num_query_groups:
        raise MTPExportError(f"num_attention_heads={num_heads} is not a multiple of num_query_groups={num_query_groups}")
    per = num_heads // num_query_groups
    rows = num_query_groups * (per + 2) * head_dim
    if w.shape[0] != rows:
        raise MTPExportError(
            f"fused QKV has {w.shape[0]} rows, expected num_query_groups*(heads/groups+2)*head_dim = {rows}"
        )
    rest = tuple(w.shape[1:])
    g = w.reshape(num_query_groups, (per + 2) * head_dim, *rest)
    q = g[:, : per * head_dim].reshape(num_heads * head_dim, *rest)
    k = g[:, per * head_dim : (per + 1) * head_dim].reshape(num_query_groups * head_dim, *rest)
    v = g[:, (per + 1) * head_dim :].reshape(num_query_groups * head_dim, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """Inverse of :func:`split_fused_qkv`: HF q/k/v -> Megatron's per-group interleaved layout.

    Args:
        q (Tensor): ``[np * hn, ...]``; k, v (Tensor): ``[ng * hn, ...]``.

    Returns:
        Tensor: ``[ng * (np/ng + 2) * hn, ...]``.
    """
    ng = num_query_groups
    rest = tuple(q.shape[1:])
    return torch.cat(
        [q.reshape(ng, -1, *rest), k.reshape(ng, -1, *rest), v.reshape(ng, -1, *rest)], dim=1
    ).reshape(-1, *rest)


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


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
        if n.endswith(_WEIGHT_BUFFER_SUFFIXES):
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


# --------------------------------------------------------------------------------------------
# Expected HF keys (from config.json)
# --------------------------------------------------------------------------------------------

_BLOCK_TYPE_CHARS = {"attention": "*", "full_attention": "*", "moe": "E", "mlp": "-", "mamba": "M"}


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def hf_mtp_pattern(hf_config: Any) -> str:
    """The MTP layer pattern of a Nemotron-H config (``mtp_hybrid_override_pattern``, or
    transformers-5 ``mtp_layers_block_type`` such as ``["attention", "moe"]``); ``""`` if none."""
    pattern = _cfg_get(hf_config, "mtp_hybrid_override_pattern")
    if pattern:
        return str(pattern)
    types = _cfg_get(hf_config, "mtp_layers_block_type")
    if types:
        bad = [t for t in types if t not in _BLOCK_TYPE_CHARS]
        if bad:
            raise MTPExportError(f"mtp_layers_block_type has unknown entries {bad}; known: {sorted(_BLOCK_TYPE_CHARS)}")
        return "".join(_BLOCK_TYPE_CHARS[t] for t in types)
    return ""


def expected_hf_mtp_keys(hf_config: Any) -> set[str]:
    """The Hugging Face MTP tensor names a Nemotron-H checkpoint with this config holds.

    Nemotron 3 Super (``"*E"``, 512 experts, latent MoE, one shared expert): 1040 names.

    Args:
        hf_config: ``config.json`` content (dict) or a config object. Reads
            ``num_nextn_predict_layers``, the MTP pattern (:func:`hf_mtp_pattern`),
            ``n_routed_experts`` (``mtp_n_routed_experts`` for ``nemotron_h_puzzle``),
            ``n_shared_experts``, ``moe_latent_size``, ``attention_bias``, ``mlp_bias``.

    Returns:
        set[str]: e.g. ``mtp.layers.0.mixer.q_proj.weight``; empty without MTP.

    Raises:
        MTPExportError: unsupported MTP layer type (``M``) or biases.
    """
    n = int(_cfg_get(hf_config, "num_nextn_predict_layers", 0) or 0)
    pattern = hf_mtp_pattern(hf_config)
    if n == 0 or not pattern:
        return set()
    if _cfg_get(hf_config, "attention_bias", False) or _cfg_get(hf_config, "mlp_bias", False):
        raise MTPExportError("attention_bias/mlp_bias=True is not supported for Nemotron-H MTP")
    bad = sorted(set(pattern) - {"*", "E", "-"})
    if bad:
        raise MTPExportError(f"MTP pattern {pattern!r} has unsupported layer types {bad} (supported: '*', 'E', '-')")
    experts = _cfg_get(hf_config, "n_routed_experts")
    if _cfg_get(hf_config, "model_type") == "nemotron_h_puzzle":
        experts = _cfg_get(hf_config, "mtp_n_routed_experts", experts)
    shared = int(_cfg_get(hf_config, "n_shared_experts", 1) or 0)
    latent = _cfg_get(hf_config, "moe_latent_size") is not None
    L = len(pattern)
    keys: set[str] = set()
    for d in range(n):
        for i, ch in enumerate(pattern):
            p = f"mtp.layers.{d * L + i}."
            if i == 0:
                keys |= {p + "enorm.weight", p + "hnorm.weight", p + "eh_proj.weight"}
            if i == L - 1:
                keys.add(p + "final_layernorm.weight")
            keys.add(p + "norm.weight")
            if ch == "*":
                keys |= {f"{p}mixer.{x}_proj.weight" for x in "qkvo"}
            elif ch == "-":
                keys |= {p + "mixer.up_proj.weight", p + "mixer.down_proj.weight"}
            else:
                if experts is None:
                    raise MTPExportError("MTP pattern has 'E' but the config has no n_routed_experts")
                keys |= {p + "mixer.gate.weight", p + "mixer.gate.e_score_correction_bias"}
                if latent:
                    keys |= {p + "mixer.fc1_latent_proj.weight", p + "mixer.fc2_latent_proj.weight"}
                if shared:
                    keys |= {p + "mixer.shared_experts.up_proj.weight", p + "mixer.shared_experts.down_proj.weight"}
                for e in range(int(experts)):
                    keys |= {f"{p}mixer.experts.{e}.up_proj.weight", f"{p}mixer.experts.{e}.down_proj.weight"}
    return keys


# --------------------------------------------------------------------------------------------
# Drafter layout and digests (checksum mode)
# --------------------------------------------------------------------------------------------

_EXPERT_RE = re.compile(r"(model\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up|down)_proj\.weight")
_QKV_RE = re.compile(r"(model\.layers\.\d+\.mixer)\.([qkv])_proj\.(weight|bias)")
_SHARED_HF_TO_DRAFTER = {"backbone.embeddings.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}


def canonical_drafter_name(name: str) -> str:
    """vLLM drafter parameter name without version-dependent infixes (``experts.routed_experts.w13_weight``
    in vLLM 0.31/0.33 and ``experts.w13_weight`` in other revisions both become the latter)."""
    return name.replace(".experts.routed_experts.", ".experts.")


def _drafter_groups(names: Iterable[str]) -> dict[str, list[tuple[int, str]]]:
    """Canonical drafter name -> ordered HF names whose concatenation (dim 0) it stores."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for hf in names:
        if hf in _SHARED_HF_TO_DRAFTER:
            groups.setdefault(_SHARED_HF_TO_DRAFTER[hf], []).append((0, hf))
            continue
        if not hf.startswith("mtp.layers."):
            continue
        n = "model.layers." + hf[len("mtp.layers.") :]
        m = _QKV_RE.fullmatch(n)
        if m:
            groups.setdefault(f"{m.group(1)}.qkv_proj.{m.group(3)}", []).append(("qkv".index(m.group(2)), hf))
            continue
        m = _EXPERT_RE.fullmatch(n)
        if m:
            w = "w13_weight" if m.group(3) == "up" else "w2_weight"
            groups.setdefault(f"{m.group(1)}.{w}", []).append((int(m.group(2)), hf))
            continue
        groups.setdefault(n, []).append((0, hf))
    for v in groups.values():
        v.sort()
    return groups


def drafter_layout(hf_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF MTP tensors recomposed the way vLLM's ``NemotronHMTP`` stores them (TP=EP=1).

    ``mtp.layers.{i}.X`` -> ``model.layers.{i}.X``; ``qkv_proj = cat(q, k, v)``;
    ``experts.w13_weight = stack(up_proj over experts)`` ``[E, I, H]`` (non-gated: up only),
    ``experts.w2_weight = stack(down_proj)`` ``[E, H, I]``; ``backbone.embeddings.weight`` ->
    ``model.embed_tokens.weight``, ``lm_head.weight`` unchanged. Names are canonical
    (:func:`canonical_drafter_name`); other ``backbone.*`` names are ignored.
    """
    out: dict[str, torch.Tensor] = {}
    for name, parts in _drafter_groups(hf_tensors).items():
        ts = [hf_tensors[hf] for _, hf in parts]
        if name.endswith((".w13_weight", ".w2_weight")):
            out[name] = torch.stack(ts)
        elif len(ts) > 1:
            out[name] = torch.cat(ts)
        else:
            out[name] = ts[0]
    return out


_P = 2_147_483_647  # 2**31 - 1
_DIGEST_CHUNK = 1 << 22


class _Digest:
    """Position-weighted modular hash of float32 bit patterns, streamed over concatenated pieces."""

    def __init__(self) -> None:
        self.offset = 0
        self.h1 = 0
        self.h2 = 0

    def update(self, t: torch.Tensor) -> None:
        flat = t.detach().reshape(-1)
        for s in range(0, flat.numel(), _DIGEST_CHUNK):
            x = flat[s : s + _DIGEST_CHUNK].to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
            x = torch.remainder(x, _P)
            idx = torch.arange(self.offset + s, self.offset + s + x.numel(), device=x.device, dtype=torch.int64)
            w1 = torch.remainder(idx * 48271 + 11, _P)
            w2 = torch.remainder(torch.remainder(idx, 65521) * 69621 + 7 + idx // 65521, _P)
            self.h1 = (self.h1 + int(torch.remainder(x * w1, _P).sum())) % _P
            self.h2 = (self.h2 + int(torch.remainder(x * w2, _P).sum())) % _P
        self.offset += flat.numel()

    def hexdigest(self) -> str:
        return f"{self.offset}:{self.h1:08x}{self.h2:08x}"


def tensor_digest(t: torch.Tensor) -> str:
    """Exact-value digest of a tensor (its values as float32 bit patterns, position-weighted).

    Equal digests <=> equal float32 values (up to ~2^-62 collisions) regardless of the source dtype
    (bf16/fp16 upcast exactly) or device; computed on the tensor's device in 4M-element chunks.
    """
    d = _Digest()
    d.update(t)
    return d.hexdigest()


def hf_mtp_digests(hf_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Trainer-side digests of the drafter tensors these HF tensors produce (see :func:`drafter_layout`),
    without materialising the stacked/concatenated tensors.

    Returns:
        dict[str, str]: canonical drafter parameter name -> :func:`tensor_digest` value.
    """
    tensors = dict(hf_tensors.items() if isinstance(hf_tensors, Mapping) else hf_tensors)
    out: dict[str, str] = {}
    for name, parts in _drafter_groups(tensors).items():
        d = _Digest()
        for _, hf in parts:
            d.update(tensors[hf])
        out[name] = d.hexdigest()
    return out

