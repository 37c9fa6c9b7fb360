"""Helpers shared by the two-rank parallelism checks: ``tests/test_export_tp.py`` (CPU, gloo)
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

import torch

EXPERT_RE = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")
WEIGHT_BUFFERS = (".expert_bias",)


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


# ------------------------------------------------------------------------------------------------
# TP / EP export check (CPU test and GPU script)
# ------------------------------------------------------------------------------------------------

#: (tensor-parallel, expert-parallel, expert-tensor-parallel) layouts of two ranks.
TP_CASES = {"tp2": (2, 1, 2), "tp2_ep2": (2, 2, 1)}


def mtp_forward(model, batch):
    """Logits ``[b, s, V]`` (gathered over TP) and the MTP block's output hidden states ``[s, b, h]`` of
    one forward through ``hybrid_forward(run_mtp_forward=True)``.

    Eval mode: megatron refuses MoE + TP *training* forwards without sequence parallelism, which
    megatron's local (non-TE) norms do not support; the weights and the math are the same.
    """
    from verl_mtp_plugin import hybrid_forward

    seen = []
    hook = model.mtp.register_forward_hook(lambda mod, args, out: seen.append(out.detach().float()))
    model.eval()
    try:
        with torch.no_grad():
            logits = hybrid_forward(model, batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                                    run_mtp_forward=True, runtime_gather_output=True)
    finally:
        hook.remove()
        model.train()
    assert len(seen) == 1, "the MTP block did not run"
    s = batch["input_ids"].shape[1]
    return logits.float(), seen[0][s:]  # [main | depth 1] along the sequence: the MTP depth's hidden states


def exports(model, vocab_size: int):
    """(MTP only, MTP + shared, full backbone) HF dicts from ``export_mtp_weights``."""
    from verl_mtp_plugin.export import export_mtp_weights

    return (
        dict(export_mtp_weights(model)),
        dict(export_mtp_weights(model, vocab_size=vocab_size, include_shared=True)),
        dict(export_mtp_weights(model, vocab_size=vocab_size, include_backbone=True)),
    )


def assert_same_export(got, ref, tag: str) -> None:
    for g, r, kind in zip(got, ref, ("mtp", "shared", "backbone")):
        assert set(g) == set(r), f"{tag}/{kind}: names differ: {sorted(set(g) ^ set(r))[:8]}"
        for n in r:
            assert g[n].dtype == r[n].dtype and g[n].shape == r[n].shape, (
                f"{tag}/{kind}: {n} {g[n].dtype}{tuple(g[n].shape)} vs {r[n].dtype}{tuple(r[n].shape)}")
            assert torch.equal(g[n], r[n]), f"{tag}/{kind}: {n} differs (max {float((g[n] - r[n]).abs().max())})"


def reinit_parallel(seed: int, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> None:
    """Replace megatron's parallel state (the process group stays) and re-seed."""
    from megatron.core import parallel_state as ps

    from verl_mtp_plugin.testing import init_megatron

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    init_megatron(seed=seed)  # groups exist: only the RNG is (re)seeded


def broadcast_weights(model, src: int = 0) -> None:
    """Make every rank's copy of ``model`` identical to rank ``src``'s (the reference must be one model)."""
    for t in named_weights(model).values():
        torch.distributed.broadcast(t.data, src)


def tp_export_check(build, spec: dict, batch: dict, *, vocab_size: int, seed: int, fwd_rtol: float,
                    dtypes=(torch.float32,), cases=TP_CASES) -> list[str]:
    """Unsharded reference vs every layout in ``cases``: forward within ``fwd_rtol`` (fp32 only), export exact.

    Args:
        build: ``build(spec_fields, config_overrides) -> HybridModel`` (CPU or GPU builder).
        spec (dict): ``TinyHybridSpec`` fields (vocab padded so that TP divides it; query groups,
            Mamba groups and experts divisible by 2).
        batch (dict): ``make_batch`` output on the model's device.

    Returns:
        list[str]: one log line per check.
    """
    log = []
    for dtype in dtypes:
        fields = dict(spec, params_dtype=dtype)
        reinit_parallel(seed)
        ref = build(fields, {})
        broadcast_weights(ref)
        reference = full_copy(ref)
        ref_logits, ref_mtp = mtp_forward(ref, batch) if dtype == torch.float32 else (None, None)
        ref_export = exports(ref, vocab_size)
        num_experts = ref.config.num_moe_experts
        del ref
        for tag, (tp, ep, etp) in cases.items():
            tag = f"{tag}/{str(dtype).split('.')[-1]}"
            reinit_parallel(seed, tp=tp, ep=ep, etp=etp)
            model = build(fields, dict(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                       expert_tensor_parallel_size=etp))
            qkv = model.mtp.layers[0].mtp_model_layer.layers[0].self_attention.linear_qkv.weight
            cfg = model.config
            per_rank_groups = cfg.num_query_groups // tp
            assert qkv.shape[0] == per_rank_groups * (cfg.num_attention_heads // cfg.num_query_groups + 2) * cfg.kv_channels
            experts = model.mtp.layers[0].mtp_model_layer.layers[1].mlp.experts.local_experts
            assert len(experts) == num_experts // ep
            n = load_shards(model, reference, num_experts=num_experts)
            line = f"{tag}: {n} tensors sharded"
            if ref_logits is not None:
                logits, mtp = mtp_forward(model, batch)
                e_l, e_m = rel_err(logits, ref_logits), rel_err(mtp, ref_mtp)
                line += f"; forward vs TP=1: logits rel err {e_l:.2e}, MTP hidden rel err {e_m:.2e} (tol {fwd_rtol:g})"
                assert e_l <= fwd_rtol and e_m <= fwd_rtol, line
            got = exports(model, vocab_size)
            assert_same_export(got, ref_export, tag)
            line += f"; export == TP=1 export bitwise ({len(got[0])} MTP, {len(got[1])} MTP+shared, {len(got[2])} full)"
            log.append(line)
            del model
    return log
