"""Pure-torch stand-ins for the two Mamba pieces megatron-core only runs as GPU (Triton) kernels.

Substitutions allowed by the project's standards (a GPU kernel): the fused
``mamba_split_conv1d_scan_combined`` training kernel and mamba_ssm's gated RMSNorm. Both are the
same math written as plain torch, run step by step (a sequential selective scan), so they are
slow but obviously correct. Used only by :mod:`verl_mtp_cpu.tiny` on machines without CUDA.

Packed sequences (``seq_idx``), as the GPU kernels take them (megatron passes
``PackedSeqParams.seq_idx`` ``[1, T]`` to the fused kernel, ``ssm/mamba_mixer.py`` ``_ssm_training``):

* the causal conv1d adds a tap only from a position of the same sequence, and a position whose
  ``seq_idx`` is negative outputs 0 (causal-conv1d ``csrc/causal_conv1d_fwd.cu``, v1.5.3.post1 l.321-330:
  ``seq_idx_thread[i + w] == seq_idx_cur ? weight * x : 0``);
* the scan starts from a zero state wherever ``seq_idx`` changes (mamba_ssm ``ops/triton/ssd_state_passing.py``,
  v2.3.0 l.78: ``scale = tl.where(seq_idx_new == seq_idx, scale, 0.0)``, and the same masking inside a chunk in
  ``ssd_bmm.py`` / ``ssd_chunk_scan.py``);
* ``seq_idx`` must be ``[batch, seqlen]`` (mamba_ssm ``ops/triton/ssd_combined.py`` v2.3.0 l.357:
  ``assert seq_idx.shape == (batch, seqlen)``): a shorter or longer index fails here as it does on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_seq_idx(seq_idx, batch: int, seqlen: int):
    """``seq_idx`` as the kernels take it: ``[batch, seqlen]`` integers, non-decreasing along the sequence
    (each packed sequence one contiguous run), or None."""
    if seq_idx is None:
        return None
    if tuple(seq_idx.shape) != (batch, seqlen):
        raise ValueError(
            f"seq_idx shape {tuple(seq_idx.shape)} != (batch, seqlen) = {(batch, seqlen)} "
            "(mamba_ssm ssd_combined.py asserts the same)"
        )
    if seqlen > 1 and bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
        raise ValueError("seq_idx must be non-decreasing: each packed sequence one contiguous run")
    return seq_idx


def causal_conv1d_ref(x, weight, bias=None, seq_idx=None):
    """Depthwise causal conv1d: ``x [b, l, d]``, ``weight [d, w]`` -> ``[b, l, d]`` (no activation).

    With ``seq_idx [b, l]``: a tap reads only positions of the output position's sequence; positions whose
    ``seq_idx`` is negative output 0 (causal_conv1d's kernel semantics, see the module docstring).
    """
    b, l, d = x.shape  # noqa: E741 - l: the sequence length, as in the shapes above
    width = weight.shape[-1]
    if seq_idx is None:
        out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=d)[..., :l]
        return out.transpose(1, 2)
    out = x.new_zeros(b, l, d) if bias is None else bias.to(x.dtype).expand(b, l, d).clone()
    for w in range(width):
        shift = width - 1 - w  # tap w reads position t - shift
        if shift >= l:
            continue
        src = x[:, : l - shift]  # positions t - shift for t = shift..l-1
        same = (seq_idx[:, shift:] == seq_idx[:, : l - shift]).unsqueeze(-1)  # [b, l - shift, 1]
        tap = torch.zeros_like(out)
        tap[:, shift:] = torch.where(same, src * weight[:, w], torch.zeros_like(src))
        out = out + tap
    return torch.where((seq_idx < 0).unsqueeze(-1), torch.zeros_like(out), out)


def selective_scan_sequential(x, dt, A, B, C, initial_state=None, return_final_state=False, seq_idx=None,
                              return_states=False):
    """Mamba-2 SSD recurrence, one step at a time.

    Args:
        x (Tensor): ``[b, l, h, p]`` inputs.
        dt (Tensor): ``[b, l, h]`` step sizes (already softplus'ed).
        A (Tensor): ``[h]`` (negative) decay rates.
        B (Tensor): ``[b, l, g, n]`` input projections.
        C (Tensor): ``[b, l, g, n]`` output projections.
        seq_idx (Tensor | None): ``[b, l]`` packed-sequence index: the state restarts from zero wherever
            it changes (so no state crosses from one packed sequence into the next).
        return_states (bool): also return every step's state ``[b, l, h, p, n]``.

    Returns:
        Tensor: ``[b, l, h, p]`` with ``state_t = exp(dt A) state_{t-1} + dt B_t x_t`` and
        ``y_t = C_t . state_t`` (plus the final state / all states when asked).
    """
    b, l, h, p = x.shape  # noqa: E741 - l: the sequence length, as in the shapes above
    g = B.shape[2]
    seq_idx = check_seq_idx(seq_idx, b, l)
    if seq_idx is not None and initial_state is not None:
        raise NotImplementedError("reference Mamba scan: initial states with packed sequences (seq_idx)")
    B = B.repeat_interleave(h // g, dim=2)  # [b, l, h, n]
    C = C.repeat_interleave(h // g, dim=2)
    state = x.new_zeros(b, h, p, B.shape[-1]) if initial_state is None else initial_state.float()  # [b, h, p, n]
    ys, states = [], []
    for t in range(l):
        if seq_idx is not None and t > 0:
            keep = (seq_idx[:, t] == seq_idx[:, t - 1]).to(state.dtype)  # [b]: 0 where a new sequence starts
            state = state * keep[:, None, None, None]
        decay = torch.exp(dt[:, t] * A.view(1, h))  # [b, h]
        inp = (dt[:, t, :, None, None] * x[:, t, :, :, None]) * B[:, t, :, None, :]  # [b, h, p, n]
        state = decay[:, :, None, None] * state + inp
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
        if return_states:
            states.append(state)
    y = torch.stack(ys, dim=1)
    out = (y, state) if return_final_state else (y,)
    if return_states:
        out = (*out, torch.stack(states, dim=1))
    return out if len(out) > 1 else out[0]


def mamba_chunk_scan_combined_ref(
    x, dt, A, B, C, chunk_size=None, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
    cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
    return_varlen_states=False, **_unused,
):
    """Same math as mamba_ssm's ``mamba_chunk_scan_combined`` (the non-fused path megatron takes in
    inference mode): ``x [b, l, h, p]``, ``dt [b, l, h]``, ``B, C [b, l, g, n]`` -> ``y [b, l, h, p]``.

    ``seq_idx [b, l]`` restarts the state at every packed sequence; ``cu_seqlens`` is read only with
    ``return_varlen_states`` (as in mamba_ssm): the state at each sequence's last token, ``[n_seq, h, p, n]``
    (batch 1). Returns ``y``, ``(y, final)``, ``(y, varlen)`` or ``(y, final, varlen)`` like mamba_ssm."""
    if return_varlen_states:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens must be provided if return_varlen_states is True")
        if x.shape[0] != 1:
            raise ValueError("varlen states need batch 1 (as in mamba_ssm)")
    dtype = x.dtype
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    y, last, *all_states = selective_scan_sequential(
        x.float(), dt, A.float(), B.float(), C.float(), initial_state=initial_states, return_final_state=True,
        seq_idx=seq_idx, return_states=return_varlen_states,
    )
    if D is not None:
        Df = D.float()
        y = y + x.float() * (Df.view(1, 1, *Df.shape) if Df.dim() == 2 else Df.view(1, 1, -1, 1))
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(dtype)
    out = (y, last) if return_final_states else (y,)
    if return_varlen_states:
        ends = cu_seqlens[1:].to(torch.long) - 1
        out = (*out, all_states[0][0, ends])
    return out if len(out) > 1 else out[0]


def mamba_split_conv1d_scan_combined_ref(
    zxbcdt,
    conv1d_weight,
    conv1d_bias,
    dt_bias,
    A,
    D,
    chunk_size=None,
    initial_states=None,
    seq_idx=None,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    activation="silu",
    rmsnorm_weight=None,
    rmsnorm_eps=1e-6,
    outproj_weight=None,
    outproj_bias=None,
    headdim=None,
    ngroups=1,
    norm_before_gate=True,
    **_unused,
):
    """Same signature and math as mamba_ssm's fused kernel, for the subset megatron uses in training
    (no fused norm/out-projection, no initial states, no final states); packed sequences through
    ``seq_idx [b, l]`` (conv and scan restart at every sequence, see the module docstring)."""
    if initial_states is not None or return_final_states:
        raise NotImplementedError("reference Mamba scan: no initial states or final states")
    if rmsnorm_weight is not None or outproj_weight is not None:
        raise NotImplementedError("reference Mamba scan: no fused rmsnorm / out projection")
    nheads = D.shape[0]
    if D.dim() == 2:
        headdim = D.shape[1]
    dim = nheads * headdim
    bsz, seqlen, _ = zxbcdt.shape
    dstate = (zxbcdt.shape[-1] - 2 * dim - nheads) // ngroups // 2
    z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    seq_idx = check_seq_idx(seq_idx, bsz, seqlen)
    if seq_idx is not None:
        from verl_mtp_cpu.events import record_packed

        record_packed("packed_mamba", int(seq_idx.max()) - int(seq_idx.min()) + 1, seqlen)
    xBC = F.silu(causal_conv1d_ref(xBC, conv1d_weight, conv1d_bias, seq_idx=seq_idx))
    x, Bm, Cm = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.reshape(bsz, seqlen, nheads, headdim).float()
    Bm = Bm.reshape(bsz, seqlen, ngroups, dstate).float()
    Cm = Cm.reshape(bsz, seqlen, ngroups, dstate).float()
    dt = F.softplus(dt.float() + dt_bias.float())
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    y = selective_scan_sequential(x, dt, A.float(), Bm, Cm, seq_idx=seq_idx)
    Df = D.float()
    y = y + x * (Df.view(1, 1, nheads, -1) if Df.dim() == 2 else Df.view(1, 1, nheads, 1))
    y = y.reshape(bsz, seqlen, dim) * F.silu(z.float())
    return y.to(zxbcdt.dtype)


class GatedRMSNormRef(torch.nn.Module):
    """Plain-torch gated RMSNorm with mamba_ssm's ``RMSNorm`` constructor and parameter (``weight``)."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate

    def forward(self, x, z=None):
        dtype = x.dtype
        x = x.float()
        if z is not None and not self.norm_before_gate:
            x = x * F.silu(z.float())
        gs = self.group_size or x.shape[-1]
        xg = x.reshape(*x.shape[:-1], x.shape[-1] // gs, gs)
        xg = xg * torch.rsqrt(xg.square().mean(-1, keepdim=True) + self.eps)
        out = xg.reshape(x.shape) * self.weight.float()
        if z is not None and self.norm_before_gate:
            out = out * F.silu(z.float())
        return out.to(dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        tp_group = getattr(self, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"weight": 0},
            sharded_offsets,
            tp_group=tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )
