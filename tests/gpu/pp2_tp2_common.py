"""Helpers shared by the two-rank parallelism checks (issue 8): ``tests/test_export_tp.py`` (CPU, gloo)
and ``tests/gpu/pp2_tp2_parallel.py`` (two GPUs, NCCL, ``torchrun``). Not a test module.

The idea: every rank builds the unsharded (TP=PP=EP=1) reference model from one seed, keeps its full
tensors, then re-initialises megatron's parallel state for the sharded layout, builds the sharded
model and copies *its* shard of every reference tensor into it, using the attributes megatron puts
on its parameters (``tensor_model_parallel``, ``partition_dim``, ``partition_sizes``) and its expert
placement (local expert ``e`` on EP rank ``r`` = global expert ``r * E_local + e``). A forward that
matches the reference shows the shards are megatron's layout; the export is then compared exactly.
"""

from __future__ import annotations

import os
import re
import socket

import torch

EXPERT_RE = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")
WEIGHT_BUFFERS = (".expert_bias",)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def set_dist_env(rank: int, world: int, port: int) -> None:
    """The env:// variables ``init_megatron`` reads (what torchrun sets)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))


def named_weights(model) -> dict[str, torch.Tensor]:
    """Parameters plus the weight buffers (router ``expert_bias``), by megatron name."""
    out = dict(model.named_parameters())
    out.update({n: b for n, b in model.named_buffers() if n.endswith(WEIGHT_BUFFERS)})
    return out


def full_copy(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in named_weights(model).items()}


def shard_of(full: torch.Tensor, param: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's tensor-parallel shard of ``full`` for a parameter laid out like ``param``.

    Contiguous chunk along ``partition_dim``; with ``partition_sizes`` (Mamba ``in_proj`` /
    ``conv1d``, local block sizes) the full tensor is a concatenation of components each split
    over the ranks, so the shard takes its slice of every component.
    """
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    sizes = getattr(param, "partition_sizes", None)
    if sizes is None:
        n = full.shape[dim] // size
        return full.narrow(dim, rank * n, n)
    comps = full.split([int(s) * size for s in sizes], dim)
    return torch.cat([c.narrow(dim, rank * int(s), int(s)) for c, s in zip(comps, sizes)], dim)


def groups_info():
    """(tp rank, tp size, expert-tp rank, expert-tp size, ep rank, ep size) from megatron's parallel state."""
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
        ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
    )


def decoder_name_map(model):
    """Stage-local ``decoder.layers.{i}`` -> global ``decoder.layers.{layer_number - 1}`` (pipeline stages)."""
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    local_to_global = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}

    def rename(name: str) -> str:
        m = re.match(r"decoder\.layers\.(\d+)\.(.+)", name)
        if m:
            return f"decoder.layers.{local_to_global[int(m.group(1))]}.{m.group(2)}"
        return name

    return rename


@torch.no_grad()
def load_shards(model, reference: dict[str, torch.Tensor], *, num_experts: int | None = None, rename=None) -> int:
    """Copy this rank's shard of every reference tensor into ``model`` (strict: every model tensor
    must get one, with the exact shard shape). Returns the number of tensors copied."""
    tp_rank, tp_size, etp_rank, etp_size, ep_rank, ep_size = groups_info()
    local_experts = (num_experts // ep_size) if num_experts else 0
    rename = rename or (lambda n: n)
    copied = 0
    for name, p in named_weights(model).items():
        src = rename(name)
        m = EXPERT_RE.search(src)
        if m:
            g = ep_rank * local_experts + int(m.group(2))
            src = src[: m.start(2)] + str(g) + src[m.end(2):]
            rank, size = etp_rank, etp_size
        else:
            rank, size = tp_rank, tp_size
        if src not in reference:
            raise KeyError(f"{name} (reference name {src}) is not in the reference model")
        shard = shard_of(reference[src], p, rank, size)
        if tuple(shard.shape) != tuple(p.shape):
            raise ValueError(f"{name}: shard {tuple(shard.shape)} != parameter {tuple(p.shape)}")
        p.copy_(shard.to(device=p.device, dtype=p.dtype))
        copied += 1
    return copied


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
