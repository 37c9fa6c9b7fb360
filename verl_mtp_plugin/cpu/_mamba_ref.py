"""Pure-torch stand-ins for the two Mamba pieces megatron-core only runs as GPU (Triton) kernels.

Substitutions allowed by the project's standards (a GPU kernel): the fused
``mamba_split_conv1d_scan_combined`` training kernel and mamba_ssm's gated RMSNorm. Both are the
same math written as plain torch, run step by step (a sequential selective scan), so they are
slow but obviously correct. Used only by :mod:`verl_mtp_plugin.cpu.tiny` on machines without CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def selective_scan_sequential(x, dt, A, B, C, initial_state=None, return_final_state=False):
    """Mamba-2 SSD recurrence, one step at a time.

    Args:
        x (Tensor): ``[b, l, h, p]`` inputs.
        dt (Tensor): ``[b, l, h]`` step sizes (already softplus'ed).
        A (Tensor): ``[h]`` (negative) decay rates.
        B (Tensor): ``[b, l, g, n]`` input projections.
        C (Tensor): ``[b, l, g, n]`` output projections.

    Returns:
        Tensor: ``[b, l, h, p]`` with ``state_t = exp(dt A) state_{t-1} + dt B_t x_t`` and
        ``y_t = C_t . state_t``.
    """
    b, l, h, p = x.shape
    g = B.shape[2]
    B = B.repeat_interleave(h // g, dim=2)  # [b, l, h, n]
    C = C.repeat_interleave(h // g, dim=2)
    state = x.new_zeros(b, h, p, B.shape[-1]) if initial_state is None else initial_state.float()  # [b, h, p, n]
    ys = []
    for t in range(l):
        decay = torch.exp(dt[:, t] * A.view(1, h))  # [b, h]
        inp = (dt[:, t, :, None, None] * x[:, t, :, :, None]) * B[:, t, :, None, :]  # [b, h, p, n]
        state = decay[:, :, None, None] * state + inp
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    y = torch.stack(ys, dim=1)
    return (y, state) if return_final_state else y


def mamba_chunk_scan_combined_ref(
    x, dt, A, B, C, chunk_size=None, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
    cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **_unused,
):
    """Same math as mamba_ssm's ``mamba_chunk_scan_combined`` (the non-fused path megatron takes in
    inference mode): ``x [b, l, h, p]``, ``dt [b, l, h]``, ``B, C [b, l, g, n]`` -> ``y [b, l, h, p]``."""
    if seq_idx is not None or cu_seqlens is not None:
        raise NotImplementedError("reference Mamba scan: no packed sequences")
    dtype = x.dtype
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    y, last = selective_scan_sequential(
        x.float(), dt, A.float(), B.float(), C.float(), initial_state=initial_states, return_final_state=True
    )
    if D is not None:
        Df = D.float()
        y = y + x.float() * (Df.view(1, 1, *Df.shape) if Df.dim() == 2 else Df.view(1, 1, -1, 1))
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(dtype)
    return (y, last) if return_final_states else y


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
    (no fused norm/out-projection, no packed ``seq_idx``, no initial states)."""
    if initial_states is not None or seq_idx is not None or return_final_states:
        raise NotImplementedError("reference Mamba scan: no initial states, seq_idx or final states")
    if rmsnorm_weight is not None or outproj_weight is not None:
        raise NotImplementedError("reference Mamba scan: no fused rmsnorm / out projection")
    nheads = D.shape[0]
    if D.dim() == 2:
        headdim = D.shape[1]
    dim = nheads * headdim
    bsz, seqlen, _ = zxbcdt.shape
    dstate = (zxbcdt.shape[-1] - 2 * dim - nheads) // ngroups // 2
    z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    width = conv1d_weight.shape[-1]
    xBC = F.conv1d(
        xBC.transpose(1, 2), conv1d_weight.unsqueeze(1), conv1d_bias, padding=width - 1, groups=xBC.shape[-1]
    )[..., :seqlen].transpose(1, 2)
    xBC = F.silu(xBC)
    x, Bm, Cm = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.reshape(bsz, seqlen, nheads, headdim).float()
    Bm = Bm.reshape(bsz, seqlen, ngroups, dstate).float()
    Cm = Cm.reshape(bsz, seqlen, ngroups, dstate).float()
    dt = F.softplus(dt.float() + dt_bias.float())
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    y = selective_scan_sequential(x, dt, A.float(), Bm, Cm)
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
