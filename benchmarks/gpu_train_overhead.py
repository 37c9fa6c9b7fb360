"""P2: overhead of the online (isolated) MTP mode in a full training step.

One step = forward (logits, ``labels=None`` as in verl's RL path) + a policy-gradient style loss on the
log-probs + backward + megatron DDP grad sync (``overlap_grad_reduce=True``, fp32 grad buffers) +
megatron distributed optimizer step (Adam, fp32 main params). Two models with the same weights:

* ``online``: ``configure_transformer_config(..., "online")`` (``mtp_detach_heads=True``), MTP trainable,
  ``hybrid_forward(..., run_mtp_forward=True)``: MTP loss on the sampled tokens, MTP params in the
  optimizer;
* ``mtp_skipped``: the same model with ``freeze_mtp`` (no grad buffer, no optimizer state for MTP) and
  ``run_mtp_forward=False``: what the step costs when the MTP layers are carried but not trained.

Goal: time overhead <= the MTP layers' matmul-FLOP share + 3 points. The FLOP counts are analytic
(``gpu_common.matmul_flops``); a ``torch.profiler`` pass attributes the extra kernel time.

Run: ``python benchmarks/gpu_train_overhead.py``.
"""

from __future__ import annotations

import gpu_common as C
import torch


def _kernel_times(fn):
    """Device time (ms) per GPU kernel name for one call of ``fn`` (torch.profiler; kernel events
    only, so operators and the kernels they launch are not counted twice)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if C.CUDA else [])
    with profile(activities=acts) as prof:
        fn()
        C.sync()
    out = {}
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        out[e.name] = out.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    return out


def _category(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "matmul", "sm90_", "cublas", "ampere_", "wgmma")):
        return "matmul (cuBLAS)"
    if any(k in n for k in ("_chunk_", "chunk_scan", "chunk_state", "state_passing", "bmm_chunk", "layer_norm_fwd",
                             "layer_norm_bwd", "_layer_norm", "rmsnorm")):
        return "mamba / gated-norm triton"
    if "softmax" in n or "log_softmax" in n or "nll" in n or "cross_entropy" in n or "logsumexp" in n:
        return "softmax / cross-entropy"
    if "reduce" in n or "argmax" in n or "max_kernel" in n or "sum" in n:
        return "reductions (argmax, sums, norms)"
    if "nccl" in n:
        return "nccl"
    if "memcpy" in n or "memset" in n or "copy" in n or "cat" in n:
        return "copies"
    if "adam" in n or "multi_tensor" in n or "foreach" in n:
        return "optimizer"
    if "index" in n or "scatter" in n or "gather" in n or "sort" in n or "topk" in n or "embedding" in n:
        return "index / scatter / gather (MoE, embedding)"
    if "elementwise" in n or "vectorized" in n or "unrolled" in n:
        return "elementwise"
    return "other"


def main(keep_online_model: bool = False, rounds: int = 4, warmup: int = 2, iters: int = 6):
    from verl_mtp_plugin import configure_transformer_config, freeze_mtp, hybrid_forward

    C.setup()
    spec = C.bench_spec()
    seq, b = C.seq_len(), 1
    ids, pos, mask = C.batch(spec, seq, b)
    labels = torch.roll(ids, -1, dims=1)
    adv = torch.randn(b, seq, generator=torch.Generator().manual_seed(1)).to(C.device())

    overrides = configure_transformer_config({}, "online")
    mem0 = torch.cuda.memory_allocated() if C.CUDA else 0
    m_on = C.build(spec, config_overrides=overrides)
    m_skip = C.build(spec, config_overrides=overrides)
    m_skip.load_state_dict(m_on.state_dict())
    frozen = freeze_mtp(m_skip)
    counts = C.param_counts(m_on)
    flops = C.matmul_flops(m_on, tokens=b * seq, seq=seq)

    if C.CUDA:
        from verl_mtp_plugin.testing.gpu import megatron_ddp_and_optimizer

        mem_a = torch.cuda.memory_allocated()
        ddp_on, opt_on = megatron_ddp_and_optimizer(m_on)
        mem_b = torch.cuda.memory_allocated()
        ddp_skip, opt_skip = megatron_ddp_and_optimizer(m_skip)
        mem_c = torch.cuda.memory_allocated()
    else:  # BENCH_TINY plumbing check: megatron's optimizers need CUDA
        ddp_on, ddp_skip = m_on, m_skip
        opt_on = torch.optim.AdamW([p for p in m_on.parameters() if p.requires_grad], lr=1e-4)
        opt_skip = torch.optim.AdamW([p for p in m_skip.parameters() if p.requires_grad], lr=1e-4)

    def make_step(ddp, opt, run_mtp):
        def step():
            if C.CUDA:
                ddp.zero_grad_buffer()
            opt.zero_grad()
            logits = hybrid_forward(ddp, ids, pos, mask, run_mtp_forward=run_mtp)
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            loss = -(logp * adv).mean()
            loss.backward()
            if C.CUDA:
                ddp.finish_grad_sync()
            opt.step()

        return step

    steps = {"online": make_step(ddp_on, opt_on, True), "mtp_skipped": make_step(ddp_skip, opt_skip, False)}
    # First steps: Triton autotune, optimizer state allocation, DDP's golden grad-ready counts.
    for s in steps.values():
        s()
    C.sync()
    persistent = {}
    if C.CUDA:
        # Persistent memory of each model: params + grad buffers + fp32 main params + Adam state.
        from verl_mtp_plugin.testing.gpu import optimizer_model_params

        def state_bytes(opt):
            opts = getattr(opt, "chained_optimizers", None) or [opt]
            tot = 0
            for o in opts:
                inner = getattr(o, "optimizer", o)
                for st in inner.state.values():
                    tot += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
                for g in inner.param_groups:
                    tot += sum(p.numel() * p.element_size() for p in g["params"])  # fp32 main params
            return tot

        def bucket_bytes(ddp):
            return sum(buf.grad_data.numel() * buf.grad_data.element_size() for buf in ddp.buffers + ddp.expert_parallel_buffers)

        for name, m, ddp, opt in (("online", m_on, ddp_on, opt_on), ("mtp_skipped", m_skip, ddp_skip, opt_skip)):
            pb = sum(p.numel() * p.element_size() for p in m.parameters())
            mtp_ids = {id(p) for n, p in m.named_parameters() if n.startswith("mtp.")}
            in_opt = [p for p in optimizer_model_params(opt)]
            persistent[name] = {
                "params_gib": pb / 2**30,
                "grad_buffers_gib": bucket_bytes(ddp) / 2**30,
                "optimizer_main_params_and_state_gib": state_bytes(opt) / 2**30,
                "mtp_params_in_optimizer": sum(1 for p in in_opt if id(p) in mtp_ids),
                "params_in_optimizer": len(in_opt),
            }
            persistent[name]["total_gib"] = sum(v for k, v in persistent[name].items() if k.endswith("_gib"))
        persistent["ddp_wrap_alloc_gib"] = {"online": (mem_b - mem_a) / 2**30, "mtp_skipped": (mem_c - mem_b) / 2**30}
        persistent["two_models_bf16_params_alloc_gib"] = (mem_a - mem0) / 2**30

    res = C.time_variants(steps, rounds=rounds, warmup=warmup, iters=iters, interleave=True)
    overhead = {k: C.ratio(res, "online", "mtp_skipped", k) - 1.0 for k in ("min", "median")}
    overhead["paired_median"] = C.paired_ratio(res, "online", "mtp_skipped") - 1.0
    goal = flops["mtp_extra_over_base"] + 0.03
    tflops = {
        "online": (flops["base_step"] + flops["mtp_extra"]) / (res["online"]["min"] * 1e-3) / 1e12,
        "mtp_skipped": flops["base_step"] / (res["mtp_skipped"]["min"] * 1e-3) / 1e12,
    }
    prof = {}
    try:
        k_on = _kernel_times(steps["online"])
        k_skip = _kernel_times(steps["mtp_skipped"])
        cats = {}
        for name in set(k_on) | set(k_skip):
            c = _category(name)
            d = cats.setdefault(c, {"online_ms": 0.0, "mtp_skipped_ms": 0.0})
            d["online_ms"] += k_on.get(name, 0.0)
            d["mtp_skipped_ms"] += k_skip.get(name, 0.0)
        for d in cats.values():
            d["extra_ms"] = d["online_ms"] - d["mtp_skipped_ms"]
        diff = sorted(((k_on.get(n, 0.0) - k_skip.get(n, 0.0), n) for n in set(k_on) | set(k_skip)), reverse=True)
        tot_on, tot_skip = sum(k_on.values()), sum(k_skip.values())
        prof = {
            "kernel_total_ms": {"online": tot_on, "mtp_skipped": tot_skip},
            "kernel_time_overhead": tot_on / tot_skip - 1.0 if tot_skip else None,
            "by_category": dict(sorted(cats.items(), key=lambda kv: -kv[1]["extra_ms"])),
            "top_extra_kernels": [{"kernel": n[:160], "extra_ms": round(d, 3)} for d, n in diff[:25]],
        }
    except Exception as e:  # the profiler is a diagnostic; timings above stand without it
        prof = {"error": repr(e)}

    out = {
        "env": C.env_info(),
        "spec": C.spec_dict(spec),
        "batch": b,
        "seq": seq,
        "params": counts,
        "frozen_in_skip_model": len(frozen),
        "ddp": {"overlap_grad_reduce": True, "use_distributed_optimizer": True, "grad_reduce_in_fp32": True},
        "timings_ms": res,
        "overhead": overhead,
        "flops": flops,
        "goal_overhead_max": goal,
        "achieved_matmul_tflops_at_min": tflops,
        "persistent_memory": persistent,
        "profile_one_step": prof,
    }
    path = C.write_json("gpu_train_overhead.json", out)
    t = res
    print(
        f"[P2] params total {counts['total'] / 1e6:.1f}M MTP {counts['mtp'] / 1e6:.1f}M | step ms min/median: online "
        f"{C.fmt_ms(t['online'])}, skipped {C.fmt_ms(t['mtp_skipped'])} | overhead {overhead['min'] * 100:.1f}% (min) "
        f"{overhead['median'] * 100:.1f}% (median) {overhead['paired_median'] * 100:.1f}% (paired median) | MTP matmul FLOPs: +{flops['mtp_extra_over_base'] * 100:.1f}% of the "
        f"skipped step ({flops['mtp_share_of_online_step'] * 100:.1f}% of the online step) -> goal <= "
        f"{goal * 100:.1f}% | step peak over start GiB: online {t['online']['peak_over_start_gib']:.2f}, skipped "
        f"{t['mtp_skipped']['peak_over_start_gib']:.2f} | TFLOP/s {tflops['online']:.0f} / {tflops['mtp_skipped']:.0f}",
        flush=True,
    )
    if persistent:
        print("[P2] persistent memory", {k: v for k, v in persistent.items()}, flush=True)
    if prof and "by_category" in prof and prof["kernel_time_overhead"] is not None:
        print("[P2] GPU kernel time per step (profiler):", {k: round(v, 1) for k, v in prof["kernel_total_ms"].items()},
              f"overhead {prof['kernel_time_overhead'] * 100:.1f}%", flush=True)
        print("[P2] extra kernel ms by category:",
              {k: round(v["extra_ms"], 2) for k, v in prof["by_category"].items()}, flush=True)
    print("[P2] wrote", path, flush=True)
    ctx = {"model": m_on} if keep_online_model else {}
    del ddp_on, ddp_skip, opt_on, opt_skip, m_skip
    if not keep_online_model:
        del m_on
    C.free()
    return out, ctx


if __name__ == "__main__":
    main()
