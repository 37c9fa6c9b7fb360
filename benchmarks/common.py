"""Shared pieces of the benchmark drivers (``phase_cost.py``, ``sync_cost.py``): the subcommand parser,
environment setup, the GPU benchmark shape, timing with CUDA events in alternating rounds, analytic
matmul-FLOP counts, and result files.

The GPU benchmarks run through the plugin's public API (``verl_mtp_plugin.hybrid_forward``,
``freeze_mtp``, ``configure_transformer_config``, ``testing.build_tiny_hybrid`` via
``testing.gpu.build_gpu_hybrid``). ``BENCH_TINY=1`` shrinks every shape so they can be checked
on a CPU (timings then mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, os.path.join(ROOT, "cpu_runtime")):  # the product and its CPU runtime (verl_mtp_cpu)
    if _p not in sys.path:
        sys.path.insert(0, _p)

TINY = os.environ.get("BENCH_TINY", "0") == "1"
CUDA = torch.cuda.is_available()

#: Main pattern of the benchmark model: 16 layers, Nemotron-3 style alternation of Mamba (M) and MoE
#: (E) with two attention layers (*); MTP depth 1 = attention + MoE ("*E"), like Nemotron 3 Super.
MAIN_PATTERN = "MEMEM*EMEMEM*EME"
MTP_PATTERN = "*E"
#: environment.md section 9 baseline (dense MLP, no MoE), reproduced for the log-prob phase.
BASELINE_DENSE_PATTERN = "M-M*M-M-M*M-M-/*-"


def run_subcommands(doc: str, commands: dict, argv=None):
    """Parse ``argv`` (default ``sys.argv[1:]``) as ``COMMAND [options]`` and run the command.

    ``commands``: name -> ``(fn, add_arguments, call)``. The command's help is the first line of ``fn``'s
    docstring, its description the whole docstring; ``add_arguments(parser)`` (or None) declares its options;
    ``call(args)`` runs it (None: ``fn(args)``). ``args.argv`` holds the command's own arguments.
    """
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (fn, add_arguments, call) in commands.items():
        text = inspect.cleandoc(fn.__doc__ or "")
        p = sub.add_parser(name, help=text.split("\n")[0], description=text,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if add_arguments is not None:
            add_arguments(p)
        p.set_defaults(_call=call or fn)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    args.argv = argv[1:]
    return args._call(args)


def setup(seed: int = 1234) -> None:
    """Mamba Triton kernels importable (GPU), NCCL/gloo world of 1, megatron parallel state, seeds."""
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    if CUDA:
        from verl_mtp_cpu.mamba_triton import install_mamba_ssm_triton

        install_mamba_ssm_triton()
    from verl_mtp_plugin.testing import init_megatron

    init_megatron(seed=seed)


def bench_spec(**fields):
    """The benchmark shape: a Nemotron-3-like hybrid at hidden 1536 (environment.md section 9 sizes),
    V = 131072, bf16. ``BENCH_TINY=1``: a CPU-sized version with the same layer types."""
    from verl_mtp_plugin.testing import TinyHybridSpec

    if TINY:
        base = dict(
            pattern=f"MEM*E/{MTP_PATTERN}", vocab_size=512, hidden_size=64, ffn_hidden_size=128,
            num_attention_heads=4, num_query_groups=2, num_experts=4, moe_topk=2, moe_ffn_hidden_size=32,
            moe_shared_expert_intermediate_size=64, moe_latent_size=None, mamba_state_dim=16,
            mamba_head_dim=16, mamba_num_groups=2, max_sequence_length=128, params_dtype=torch.float32,
        )
    else:
        base = dict(
            pattern=f"{MAIN_PATTERN}/{MTP_PATTERN}", vocab_size=131072, hidden_size=1536, ffn_hidden_size=6144,
            num_attention_heads=12, num_query_groups=2, num_experts=16, moe_topk=4, moe_ffn_hidden_size=1024,
            moe_shared_expert_intermediate_size=2048, moe_latent_size=None, mamba_state_dim=128,
            mamba_head_dim=64, mamba_num_groups=8, max_sequence_length=4096, params_dtype=torch.bfloat16,
        )
    base.update(fields)
    return TinyHybridSpec(**base)


def seq_len() -> int:
    return 64 if TINY else 4096


def build(spec, config_overrides=None, **fields):
    """GPU: ``testing.gpu.build_gpu_hybrid``; CPU (BENCH_TINY): ``testing.build_tiny_hybrid``."""
    if CUDA:
        from verl_mtp_plugin.testing.gpu import build_gpu_hybrid

        return build_gpu_hybrid(spec, config_overrides=config_overrides, **fields)
    from verl_mtp_plugin.testing import build_tiny_hybrid

    return build_tiny_hybrid(spec, config_overrides=config_overrides, **fields)


def device():
    return torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")


def batch(spec, seq: int, b: int = 1, seed: int = 0):
    """Random token ids / positions; the mask is None on GPU (megatron's causal default), explicit on CPU."""
    from verl_mtp_plugin.testing import causal_mask

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab_size, (b, seq), generator=g).to(device())
    pos = torch.arange(seq).unsqueeze(0).expand(b, seq).contiguous().to(device())
    mask = None if CUDA else causal_mask(seq, device())
    return ids, pos, mask


def sync():
    if CUDA:
        torch.cuda.synchronize()


class _Timer:
    def __init__(self):
        if CUDA:
            self.a = torch.cuda.Event(enable_timing=True)
            self.b = torch.cuda.Event(enable_timing=True)

    def start(self):
        if CUDA:
            self.a.record()
        else:
            self.t = time.perf_counter()

    def stop(self):
        if CUDA:
            self.b.record()
        else:
            self.dt = (time.perf_counter() - self.t) * 1e3

    def ms(self):
        return self.a.elapsed_time(self.b) if CUDA else self.dt


def time_variants(fns: dict, *, rounds: int = 3, warmup: int = 2, iters: int = 5, interleave: bool = False):
    """Time each callable in ``fns`` (name -> fn) with one CUDA event pair per call.

    ``interleave=False``: every round runs every variant as a block (``warmup`` untimed calls, then
    ``iters`` timed calls); the order of the variants rotates each round.
    ``interleave=True``: ``warmup`` untimed calls of each variant, then ``rounds * iters`` cycles that
    each time one call of every variant, the order rotating every cycle; slow drift of the machine
    (host jitter, clocks) then hits all variants alike, and call ``i`` of two variants forms a pair.

    Returns:
        dict: name -> {"ms": [per-call ms], "min", "median", "peak_gib", "peak_over_start_gib"}.
    """
    names = list(fns)
    out = {n: {"ms": [], "peak_gib": 0.0, "peak_over_start_gib": 0.0} for n in names}

    def timed(n, timer):
        if CUDA:
            start_alloc = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        timer.start()
        fns[n]()
        timer.stop()
        if CUDA:
            peak = torch.cuda.max_memory_allocated()
            out[n]["peak_gib"] = max(out[n]["peak_gib"], peak / 2**30)
            out[n]["peak_over_start_gib"] = max(out[n]["peak_over_start_gib"], (peak - start_alloc) / 2**30)

    if interleave:
        for n in names:
            for _ in range(warmup):
                fns[n]()
        sync()
        timers = {n: [] for n in names}
        for i in range(rounds * iters):
            order = names[i % len(names):] + names[: i % len(names)]
            for n in order:
                t = _Timer()
                timed(n, t)
                timers[n].append(t)
        sync()
        for n in names:
            out[n]["ms"] = [t.ms() for t in timers[n]]
    else:
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for n in order:
                for _ in range(warmup):
                    fns[n]()
                sync()
                timers = [_Timer() for _ in range(iters)]
                for t in timers:
                    timed(n, t)
                sync()
                out[n]["ms"] += [t.ms() for t in timers]
    for n in names:
        ms = out[n]["ms"]
        out[n]["min"] = min(ms)
        out[n]["median"] = statistics.median(ms)
        out[n]["ms"] = [round(x, 3) for x in ms]
        out[n]["peak_gib"] = round(out[n]["peak_gib"], 3)
        out[n]["peak_over_start_gib"] = round(out[n]["peak_over_start_gib"], 3)
    return out


def paired_ratio(res, a, b) -> float:
    """Median over calls ``i`` of ``ms_a[i] / ms_b[i]`` (interleaved timings)."""
    return statistics.median(x / y for x, y in zip(res[a]["ms"], res[b]["ms"]))


def ratio(res, a, b, key):
    return res[a][key] / res[b][key]


def param_counts(model) -> dict:
    """Total / MTP / embedding+output parameter counts (MTP shares embedding and output layer)."""
    from verl_mtp_plugin.control import unwrap_model

    inner = unwrap_model(model)
    total = mtp = emb_out = 0
    for n, p in inner.named_parameters():
        total += p.numel()
        if n.startswith("mtp."):
            mtp += p.numel()
        if n.startswith("embedding.") or n.startswith("output_layer."):
            emb_out += p.numel()
    return {"total": total, "mtp": mtp, "embedding_and_output": emb_out, "trunk_without_emb_out": total - mtp - emb_out}


# --------------------------------------------------------------------------------------------------
# Analytic matmul FLOPs
# --------------------------------------------------------------------------------------------------


def _linear_weights(inner):
    """(name, numel, token_fraction) for every weight used as a matmul operand (embedding excluded)."""
    cfg = inner.config
    topk = getattr(cfg, "moe_router_topk", 1) or 1
    n_exp = getattr(cfg, "num_moe_experts", None) or 1
    for n, p in inner.named_parameters():
        if p.dim() != 2 or n.startswith("embedding.") or "conv1d" in n:
            continue
        frac = topk / n_exp if ".local_experts." in n else 1.0
        yield n, p.numel(), frac


def matmul_flops(model, tokens: int, seq: int) -> dict:
    """Matmul FLOPs of one training step (forward + backward) by component, for ``tokens`` tokens in
    sequences of length ``seq``.

    Counted: every 2-D weight (``2 * tokens * numel`` forward; routed experts get ``tokens * topk / E``
    tokens), attention scores and values (``4 * b * s^2 * heads * head_dim`` forward, the full square
    as megatron's local ``DotProductAttention`` computes it), and the Mamba-2 SSD chunked scan
    (``tokens * (2 * G * Q * N + heads * (2 * Q * P + 4 * N * P))`` forward, Q = chunk size). Backward
    = 2x forward (input and weight gradients), except the MTP logits matmul with
    ``mtp_detach_heads=True`` (output weight detached: input gradient only, 1x). Not counted: norms,
    softmax / cross-entropy, elementwise ops, the optimizer.

    Returns:
        dict: FLOPs of the step with the MTP forward skipped (``base``), the extra FLOPs of the MTP
        forward + backward (``mtp``) split into ``mtp_block`` and ``mtp_logits``, and ratios.
    """
    from verl_mtp_plugin.control import unwrap_model

    inner = unwrap_model(model)
    cfg = inner.config
    b = tokens // seq
    base_fwd = 0.0
    mtp_block_fwd = 0.0
    out_fwd = 0.0
    for n, numel, frac in _linear_weights(inner):
        f = 2.0 * tokens * frac * numel
        if n.startswith("output_layer."):
            out_fwd += f
        elif n.startswith("mtp."):
            mtp_block_fwd += f
        else:
            base_fwd += f
    heads_dim = cfg.num_attention_heads * (cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads)
    attn_core = 4.0 * b * seq * seq * heads_dim
    ssd = 0.0
    for mod_name, mod in inner.named_modules():
        if type(mod).__name__ == "MambaMixer":
            q, nst, p_, g, h = mod.chunk_size, mod.d_state, mod.headdim, mod.ngroups, mod.nheads
            f = tokens * (2.0 * g * q * nst + h * (2.0 * q * p_ + 4.0 * nst * p_))
            if mod_name.startswith("mtp."):
                mtp_block_fwd += f
            else:
                ssd += f
        if type(mod).__name__ == "SelfAttention":
            if mod_name.startswith("mtp."):
                mtp_block_fwd += attn_core
            else:
                base_fwd += attn_core
    base_fwd += ssd
    base = 3.0 * (base_fwd + out_fwd)
    detach = bool(getattr(cfg, "mtp_detach_heads", False))
    depths = cfg.mtp_num_layers or 0
    mtp_block = 3.0 * mtp_block_fwd
    mtp_logits = depths * out_fwd * (2.0 if detach else 3.0)
    mtp = mtp_block + mtp_logits
    return {
        "base_step": base,
        "base_fwd": base_fwd + out_fwd,
        "mtp_block": mtp_block,
        "mtp_logits": mtp_logits,
        "mtp_extra": mtp,
        "mtp_extra_over_base": mtp / base,
        "mtp_share_of_online_step": mtp / (base + mtp),
        "mtp_fwd_extra_over_base_fwd": (mtp_block_fwd + depths * out_fwd) / (base_fwd + out_fwd),
        "ssd_fwd": ssd,
        "attn_core_fwd_per_layer": attn_core,
    }


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


def env_info() -> dict:
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if CUDA else "cpu",
        "tiny": TINY,
    }
    try:
        import megatron.core

        info["megatron_core"] = megatron.core.__version__
    except Exception:
        pass
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        pass
    if CUDA:
        from verl_mtp_cpu.mamba_triton import has_causal_conv1d_cuda, mamba_kernels_active

        info["mamba_triton_kernels"] = mamba_kernels_active()
        info["causal_conv1d_cuda"] = has_causal_conv1d_cuda()
    return info


def spec_dict(spec) -> dict:
    d = dataclasses.asdict(spec)
    d["params_dtype"] = str(spec.params_dtype)
    return d


def out_dir() -> str:
    d = os.environ.get("OUT") or os.path.join(HERE, "results")
    os.makedirs(d, exist_ok=True)
    return d


def write_json(name: str, obj) -> str:
    path = os.path.join(out_dir(), name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    return path


def fmt_ms(r) -> str:
    return f"{r['min']:.2f} / {r['median']:.2f}"


def free(*models):
    for m in models:
        del m
    import gc

    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
