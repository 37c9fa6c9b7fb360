"""Megatron ``HybridModel`` MTP parameter names -> Hugging Face Nemotron-H names (what vLLM's drafter loads).

The name map of the trainer side of the MTP weight sync (:func:`~verl_mtp_plugin.export.gather.export_mtp_weights`
walks the model and uses it):

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

Also here: :func:`expected_hf_mtp_keys`, the HF MTP key set implied by a ``config.json`` (what the
drafter's loader expects; the sync checks every update against it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "WEIGHT_BUFFER_SUFFIXES",
    "MTPExportError",
    "expected_hf_mtp_keys",
    "fuse_qkv",
    "hf_mtp_pattern",
    "megatron_to_hf_name",
    "split_fused_qkv",
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
WEIGHT_BUFFER_SUFFIXES = (".expert_bias",)

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
