"""Core attention for packed (THD) sequences without Transformer Engine.

megatron-core takes packed sequences only through Transformer Engine's ``TEDotProductAttention``: its own
``DotProductAttention`` refuses them (``megatron/core/transformer/dot_product_attention.py:153``:
``assert packed_seq_params is None, "Packed sequence is not supported by DotProductAttention. Please use
TEDotProductAttention instead."``). :class:`ThdDotProductAttentionRef` is megatron's ``DotProductAttention``
(same math, same parameters: none) that also takes them the way ``TEDotProductAttention`` does:

* ``SelfAttention`` squeezes the batch dimension for ``qkv_format="thd"`` (``transformer/attention.py:1468-1471``):
  query ``[t, heads, dim]``, key / value ``[t, groups, dim]``; the result is ``[t, heads * dim]``
  (``attention.py:1597-1602`` reshapes it to ``[t, 1, hidden]``);
* sequence ``i`` occupies rows ``cu_seqlens_q_padded[i]`` .. ``+ (cu_seqlens_q[i+1] - cu_seqlens_q[i])`` (TE's
  padded layout); each attends causally to itself only; padding rows between sequences give 0.

Every sequence runs through megatron's own ``DotProductAttention.forward`` (one ``[n, 1, heads, dim]`` batch, an
explicit causal mask), so a packed batch computes exactly what the same sequences compute unpacked. Unpacked
input goes to ``DotProductAttention.forward`` unchanged. Used by the CPU hybrid spec
(:func:`verl_mtp_cpu.tiny._local_hybrid_stack_spec`); in verl's trainer workers, where Megatron-Bridge puts
megatron's plain ``DotProductAttention`` back for ``attention_backend=local``, the worker stand-in
``thd_local_attention`` (:mod:`verl_mtp_cpu.workers`) routes packed input through :func:`packed_attention`. A harness event ``packed_attention`` (sequences, rows)
records a packed forward in a run's events file whenever a process sees more sequences in one pack than before.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from verl_mtp_cpu.events import record_packed

__all__ = ["ThdDotProductAttentionRef", "packed_attention"]


def packed_attention(attend, query, key, value, attn_mask_type, packed_seq_params):
    """THD core attention from an unpacked one (see the module docstring).

    Args:
        attend: ``attend(q, k, v, mask, attn_mask_type=...) -> [n, 1, heads * dim]``, megatron's
            ``DotProductAttention.forward`` bound to the module.
        query (Tensor): ``[t, heads, dim]``; key, value: ``[t, groups, dim]``.
        attn_mask_type: passed on.
        packed_seq_params (PackedSeqParams): ``qkv_format="thd"``.

    Returns:
        Tensor: ``[t, heads * dim]``.
    """
    psp = packed_seq_params
    starts_q = psp.cu_seqlens_q_padded if psp.cu_seqlens_q_padded is not None else psp.cu_seqlens_q
    starts_kv = psp.cu_seqlens_kv_padded if psp.cu_seqlens_kv_padded is not None else psp.cu_seqlens_kv
    if starts_kv is not None and not torch.equal(starts_q.cpu(), starts_kv.cpu()):
        raise NotImplementedError("THD reference attention: self-attention only (query and key packing differ)")
    starts = starts_q.tolist()
    lengths = psp.cu_seqlens_q.diff().tolist()
    t = query.shape[0]
    if starts[-1] > t:
        raise ValueError(f"cu_seqlens end at {starts[-1]} but the packed tensor has {t} rows")
    record_packed("packed_attention", sum(1 for n in lengths if n > 0), t)
    out = query.new_zeros(t, 1, query.shape[1] * query.shape[2])
    for start, n in zip(starts[:-1], lengths):
        if n <= 0:
            continue
        end = start + n
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=query.device), diagonal=1)[None, None]
        seg = attend(query[start:end, None], key[start:end, None], value[start:end, None], causal,
                     attn_mask_type=attn_mask_type)  # [n, 1, heads * dim]
        out = torch.cat([out[:start], seg.to(out.dtype), out[end:]], dim=0)
    return out.squeeze(1)


class ThdDotProductAttentionRef(DotProductAttention):
    """megatron's local ``DotProductAttention`` plus packed (THD) sequences (see the module docstring)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if attention_bias is not None:
            raise NotImplementedError("THD reference attention: no attention bias")
        return packed_attention(super().forward, query, key, value, attn_mask_type, packed_seq_params)
