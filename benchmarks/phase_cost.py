"""Cost of the MTP layers in each phase of an RL step: log-prob forward, training step, the trainer's
acceptance estimate; ``gpu-all`` runs P1 (``logprob``), P2 (``train``) and P4 (``sync_cost.py throughput``)
in one process.

The GPU commands write one JSON each to ``$OUT`` (or ``benchmarks/results/``) and print one summary line
each; ``BENCH_TINY=1`` shrinks their shapes so they run on a CPU (timings then mean nothing).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import statistics
import time
import warnings

import common as C
import torch

GPU_ALL = ("p1", "p2", "p4")


# logprob (P1) -------------------------------------------------------------------------------------


def _pair(spec):
    """(model with MTP, model without MTP holding the same trunk weights), eval mode."""
    m_mtp = C.build(spec)
    main = spec.pattern.split("/")[0]
    m_base = C.build(spec, pattern=main)
    sd = {k: v for k, v in m_mtp.state_dict().items() if not k.startswith("mtp.")}
    missing, unexpected = m_base.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"trunk weights do not match: missing={missing} unexpected={unexpected}")
    m_mtp.eval()
    m_base.eval()
    return m_mtp, m_base


def run_shape(name, spec, *, b=1, rounds=3, warmup=3, iters=10):
    from verl_mtp_plugin import hybrid_forward

    seq = C.seq_len()
    m_mtp, m_base = _pair(spec)
    ids, pos, mask = C.batch(spec, seq, b)

    def fwd(model, run_mtp):
        def f():
            with torch.no_grad():
                hybrid_forward(model, ids, pos, mask, run_mtp_forward=run_mtp)

        return f

    with torch.no_grad():  # same logits from both models (skip parity, reported here, asserted in tests/gpu)
        a = hybrid_forward(m_base, ids, pos, mask, run_mtp_forward=False).float()
        a2 = hybrid_forward(m_base, ids, pos, mask, run_mtp_forward=False).float()
        s = hybrid_forward(m_mtp, ids, pos, mask, run_mtp_forward=False).float()
        parity = {
            "skip_vs_no_mtp": {"max_abs_diff": float((a - s).abs().max()), "rel_l2": float((a - s).norm() / a.norm()),
                               "bitwise_equal": bool(torch.equal(a, s))},
            "no_mtp_run_to_run": {"max_abs_diff": float((a - a2).abs().max()),
                                  "rel_l2": float((a - a2).norm() / a.norm()), "bitwise_equal": bool(torch.equal(a, a2))},
            "logits_std": float(a.std()),
        }
        del a, a2, s
    res = C.time_variants(
        {"no_mtp_model": fwd(m_base, False), "mtp_skipped": fwd(m_mtp, False), "mtp_run": fwd(m_mtp, True)},
        rounds=rounds, warmup=warmup, iters=iters, interleave=True,
    )
    counts = C.param_counts(m_mtp)
    flops = C.matmul_flops(m_mtp, tokens=b * seq, seq=seq)
    out = {
        "shape": name,
        "spec": C.spec_dict(spec),
        "batch": b,
        "seq": seq,
        "params": counts,
        "params_no_mtp_model": C.param_counts(m_base)["total"],
        "timings_ms": res,
        "skip_over_no_mtp": {k: C.ratio(res, "mtp_skipped", "no_mtp_model", k) for k in ("min", "median")},
        "run_over_no_mtp": {k: C.ratio(res, "mtp_run", "no_mtp_model", k) for k in ("min", "median")},
        "paired_median_ratio": {"skip_over_no_mtp": C.paired_ratio(res, "mtp_skipped", "no_mtp_model"),
                                "run_over_no_mtp": C.paired_ratio(res, "mtp_run", "no_mtp_model")},
        "mtp_fwd_flop_extra_over_base_fwd": flops["mtp_fwd_extra_over_base_fwd"],
        "logits_parity_skip_vs_no_mtp": parity,
    }
    del m_mtp, m_base
    C.free()
    return out


def logprob(shapes=("nemotron3_like_moe", "baseline_dense")):
    """P1: cost of the log-prob phase with MTP layers present.

    Forward only (``torch.no_grad``, eval mode, what verl's log-prob / ref phases run), one CUDA process,
    three variants timed in alternating rounds:

    * ``no_mtp_model``: the same trunk built without MTP (the ideal);
    * ``mtp_skipped``: the model with MTP, ``hybrid_forward(..., run_mtp_forward=False)`` (the plugin);
    * ``mtp_run``: the model with MTP, ``run_mtp_forward=True`` (what verl 0.9 does in log-prob today).

    Both models hold the same trunk weights. Goal: ``mtp_skipped / no_mtp_model <= 1.01``.
    Writes ``gpu_phase_cost.json``.
    """
    C.setup()
    results = {"env": C.env_info(), "shapes": []}
    for name in shapes:
        if name == "nemotron3_like_moe":
            spec = C.bench_spec()
        else:
            spec = C.bench_spec(pattern=C.BASELINE_DENSE_PATTERN if not C.TINY else "M-M*/*-", num_experts=16)
        r = run_shape(name, spec)
        results["shapes"].append(r)
        t = r["timings_ms"]
        print(
            f"[P1 {name}] params total {r['params']['total'] / 1e6:.1f}M (MTP {r['params']['mtp'] / 1e6:.1f}M) "
            f"b={r['batch']} S={r['seq']} | fwd ms min/median: no-MTP {C.fmt_ms(t['no_mtp_model'])}, "
            f"skipped {C.fmt_ms(t['mtp_skipped'])}, run {C.fmt_ms(t['mtp_run'])} | skip/no-MTP "
            f"{r['skip_over_no_mtp']['min']:.3f} (min) {r['skip_over_no_mtp']['median']:.3f} (median) | run/no-MTP "
            f"{r['run_over_no_mtp']['min']:.3f} / {r['run_over_no_mtp']['median']:.3f} | paired median "
            f"skip {r['paired_median_ratio']['skip_over_no_mtp']:.3f} run {r['paired_median_ratio']['run_over_no_mtp']:.3f} | peak GiB "
            f"{t['no_mtp_model']['peak_over_start_gib']:.2f} / {t['mtp_skipped']['peak_over_start_gib']:.2f} / "
            f"{t['mtp_run']['peak_over_start_gib']:.2f} | parity {r['logits_parity_skip_vs_no_mtp']}",
            flush=True,
        )
    path = C.write_json("gpu_phase_cost.json", results)
    print("[P1] wrote", path, flush=True)
    return results


# train (P2) ---------------------------------------------------------------------------------------


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


def train(keep_online_model: bool = False, rounds: int = 4, warmup: int = 2, iters: int = 6):
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
    (``common.matmul_flops``); a ``torch.profiler`` pass attributes the extra kernel time.
    Writes ``gpu_train_overhead.json``.
    """
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


# estimate -----------------------------------------------------------------------------------------


def _estimate_arguments(ap):
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-positions", type=int, default=256)
    ap.add_argument("--sweep", type=int, nargs="*", default=[64, 128, 256, 512])
    ap.add_argument("--sweep-rounds", type=int, default=5)
    ap.add_argument("--drafted", type=int, default=0,
                    help="the drafted estimate's budget (max_drafted_positions) in the step and beside each sweep size; "
                         "0: not computed (the mean over positions alone, as the committed figures)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: CPU time is not inflated by spinning threads on a busy machine)")


def _estimate_model(args):
    """The estimate benchmarks' real megatron-core HybridModel (``M*-E/*E``) at ``--hidden`` / ``--vocab`` /
    ``--seq``, megatron initialised."""
    from verl_mtp_plugin.testing import build_tiny_hybrid, init_megatron

    init_megatron(seed=1234)
    h = args.hidden
    return build_tiny_hybrid(
        hidden_size=h, vocab_size=args.vocab, ffn_hidden_size=4 * h, num_attention_heads=8, num_query_groups=4,
        moe_ffn_hidden_size=h, moe_shared_expert_intermediate_size=h, moe_latent_size=h // 2, mamba_head_dim=32,
        max_sequence_length=args.seq,
    )


def estimate(args) -> dict:
    """Cost of the in-trainer MTP acceptance estimate, side by side in one run.

    A train step (forward with MTP + policy-style loss on the returned logits + backward) on a real
    megatron-core HybridModel, timed without the probe and with :class:`AcceptanceProbe` attached and
    ``estimate()`` called between forward and backward, interleaved (A, B, A, B, ...) so drift affects
    both equally. ``estimate()`` is also timed on its own inside the B steps. CPU, ~2-4 minutes on 2 cores.
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)

    from verl_mtp_plugin.acceptance import EXPECTED_KEY, GREEDY_KEY, AcceptanceProbe, acceptance_positions
    from verl_mtp_plugin.control import hybrid_forward
    from verl_mtp_plugin.testing import make_batch, reset_mtp_globals

    model = _estimate_model(args)
    h = args.hidden
    batch = make_batch(batch=args.batch, seq=args.seq, vocab=args.vocab, prompt_len=args.prompt, seed=0)
    mask = batch["response_mask"]
    labels = torch.roll(batch["input_ids"], -1, dims=1)
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)

    clocks = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: this process's CPU time

    def now():
        return {k: f() for k, f in clocks.items()}

    def since(t0):
        return {k: f() - t0[k] for k, f in clocks.items()}

    def step(with_probe: bool):
        for p in params:
            p.grad = None
        reset_mtp_globals()
        t0 = now()
        probe = AcceptanceProbe(model) if with_probe else None
        logits = hybrid_forward(
            model, batch["input_ids"], batch["position_ids"], batch["attention_mask"],
            run_mtp_forward=True, loss_mask=mask,
        )
        est, t_est = {}, None
        if probe is not None:
            te = now()
            est = probe.estimate(logits, mask, max_positions=args.max_positions,
                                 max_drafted_positions=args.drafted)
            t_est = since(te)
            probe.close()
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        return since(t0), t_est, est

    for _ in range(args.warmup):
        step(False)
        step(True)
    base, probed, est_times = [], [], []
    est = {}
    for _ in range(args.rounds):
        base.append(step(False)[0])
        t, te, est = step(True)
        probed.append(t)
        est_times.append(te)

    # estimate() alone for other subsample sizes, on no-grad forwards of the same batch; with --drafted also with the
    # drafted form at that budget, the two interleaved in each round
    sweep = {}
    variants = [(n, d) for n in args.sweep for d in sorted({0, args.drafted})]
    for _ in range(args.sweep_rounds):
        for n, d in variants:
            with AcceptanceProbe(model) as probe, torch.no_grad():
                logits = hybrid_forward(
                    model, batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                    run_mtp_forward=True, loss_mask=mask,
                )
                te = now()
                probe.estimate(logits, mask, max_positions=n, max_drafted_positions=d)
                sweep.setdefault((n, d), []).append(since(te))

    def stat(rows, clock, fn=statistics.median):
        return fn([r[clock] for r in rows])

    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, device cpu, load average at end {os.getloadavg()[0]:.1f}")
    print(f"model: HybridModel pattern {model.hybrid_layer_pattern!r}, hidden {h}, vocab {args.vocab}, "
          f"{n_params / 1e6:.2f}M params; batch {args.batch} x seq {args.seq} (prompt {args.prompt}); "
          f"max_positions {args.max_positions}, drafted {args.drafted}; {args.rounds} interleaved rounds after "
          f"{args.warmup} warm-up")
    print("(wall = perf_counter; cpu = process CPU time, robust to other processes on a shared machine)")
    res = {}
    for clock in ("cpu", "wall"):
        a, b, e = stat(base, clock), stat(probed, clock), stat(est_times, clock)
        amin, bmin = stat(base, clock, min), stat(probed, clock, min)
        res[clock] = dict(step_without=a, step_with=b, ratio=b / a, estimate=e, estimate_over_step=e / a)
        print(f"[{clock:4s}] train step fwd+bwd: without probe median {a * 1e3:8.1f} ms (min {amin * 1e3:.1f}), "
              f"with probe median {b * 1e3:8.1f} ms (min {bmin * 1e3:.1f}); ratio of medians {b / a:.4f}, "
              f"of mins {bmin / amin:.4f}")
        print(f"[{clock:4s}] estimate() inside the step: median {e * 1e3:7.2f} ms = {100 * e / a:.2f}% of the step")
    counted = int(acceptance_positions(mask, 1).sum())
    print(f"estimate() alone by max_positions (no-grad forwards, {counted} counted positions in the batch), "
          "median cpu / wall, % of the step's median:")
    for (n, d), times in sweep.items():
        c, w = stat(times, "cpu"), stat(times, "wall")
        drafted = f" + drafted {d:5d}" if d else ""
        print(f"  max_positions {n:5d}{drafted}: cpu {c * 1e3:7.2f} ms = {100 * c / res['cpu']['step_without']:.2f}%"
              f"   wall {w * 1e3:7.2f} ms = {100 * w / res['wall']['step_without']:.2f}%   "
              f"(cpu each: {', '.join(f'{x['cpu'] * 1e3:.1f}' for x in times)})")
    res["sweep"] = {f"{n}+{d}": times for (n, d), times in sweep.items()}
    print(f"last estimate: {EXPECTED_KEY}={est.get(EXPECTED_KEY):.4f} {GREEDY_KEY}={est.get(GREEDY_KEY):.4f}")
    return res


def _estimate_pass_arguments(ap):
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="sequences of the pass")
    ap.add_argument("--micro-batches", type=int, default=4, help="equal micro-batches the pass is cut into")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--drafted", type=int, default=16384, help="the drafted estimate's budget per pass")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: CPU time is not inflated by spinning threads on a busy machine)")
    ap.add_argument("--json", default=None, help="also write every call's figures here")


def estimate_pass(args) -> dict:
    """Cost of the in-trainer acceptance estimate per MTP pass of several micro-batches, as the plugin's engine runs
    it, side by side in one run: ``first``, the first micro-batch alone at the whole drafted budget (the engine before
    2026-12-07, 128 positions for the means); ``every``, every micro-batch at its :class:`DraftedBudget` shares of the
    pass's 128 positions and drafted budget, combined (``combine_estimates``). Each round runs one pass per arm (the order alternating), each micro-batch's forward
    (no_grad, MTP run, probe attached) untimed, the estimate calls and the combination timed; the forwards' time is
    given for scale."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)

    from verl_mtp_plugin.acceptance import AcceptanceProbe
    from verl_mtp_plugin.acceptance.estimate import (DRAFTED_EXPECTED_KEY, DRAFTED_POSITIONS_KEY,
                                                     combine_estimates)
    from verl_mtp_plugin.acceptance.probe import DraftedBudget
    from verl_mtp_plugin.control import hybrid_forward
    from verl_mtp_plugin.testing import make_batch

    if args.batch % args.micro_batches:
        raise SystemExit(f"--batch {args.batch} is not a multiple of --micro-batches {args.micro_batches}")
    model = _estimate_model(args)
    batch = make_batch(batch=args.batch, seq=args.seq, vocab=args.vocab, prompt_len=args.prompt, seed=0)
    rows = args.batch // args.micro_batches
    micro = [{k: (v[i:i + rows] if k != "attention_mask" else v) for k, v in batch.items()}
             for i in range(0, args.batch, rows)]
    pass_tokens = float(batch["response_mask"].sum())
    clocks = {"wall": time.perf_counter, "cpu": time.process_time}

    def one_pass(arm: str) -> dict:
        spent = {"cpu": 0.0, "wall": 0.0}
        forwards = {"cpu": 0.0, "wall": 0.0}
        budget = DraftedBudget(pass_tokens, budget=args.drafted, pass_sequences=args.batch) if arm == "every" else None
        parts = []
        for i, mb in enumerate(micro):
            with AcceptanceProbe(model) as probe, torch.no_grad():
                t0 = {k: f() for k, f in clocks.items()}
                hybrid_forward(model, mb["input_ids"], mb["position_ids"], mb["attention_mask"],
                                        run_mtp_forward=True, loss_mask=mb["response_mask"])
                t1 = {k: f() for k, f in clocks.items()}
                if arm == "every":
                    tokens = float(mb["response_mask"].sum())
                    # the engine's call: main logits rows recomputed from the captured hidden states (None)
                    est = probe.estimate(None, mb["response_mask"], max_positions=budget.mean_positions(tokens),
                                         max_drafted_positions=budget.take(tokens, rows))
                    budget.spent(est.get(DRAFTED_POSITIONS_KEY, 0.0))
                    parts.append(est)
                elif i == 0:
                    parts.append(probe.estimate(None, mb["response_mask"], max_positions=128,
                                                max_drafted_positions=args.drafted))
                t2 = {k: f() for k, f in clocks.items()}
            for k in clocks:
                forwards[k] += t1[k] - t0[k]
                spent[k] += t2[k] - t1[k]
        t0 = {k: f() for k, f in clocks.items()}
        est = combine_estimates(parts)
        for k, f in clocks.items():
            spent[k] += f() - t0[k]
        return {"arm": arm, "estimate_cpu_s": spent["cpu"], "estimate_wall_s": spent["wall"],
                "forwards_cpu_s": forwards["cpu"], "forwards_wall_s": forwards["wall"],
                "drafted_positions": est.get(DRAFTED_POSITIONS_KEY, 0.0),
                "drafted_rate": est.get(DRAFTED_EXPECTED_KEY)}

    for _ in range(args.warmup):
        one_pass("first")
        one_pass("every")
    calls = []
    for r in range(args.rounds):
        for arm in (("first", "every") if r % 2 == 0 else ("every", "first")):
            calls.append({"round": r + 1, **one_pass(arm)})
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, device cpu, load average at end {os.getloadavg()[0]:.1f}")
    print(f"pass: {args.batch} x seq {args.seq} (prompt {args.prompt}) in {args.micro_batches} micro-batches, "
          f"{pass_tokens:.0f} response tokens; drafted budget {args.drafted} per pass; {args.rounds} rounds after "
          f"{args.warmup} warm-up, arms alternating")
    out = {"calls": calls}
    for arm in ("first", "every"):
        mine = [c for c in calls if c["arm"] == arm]
        med = {k: statistics.median(c[k] for c in mine) for k in ("estimate_cpu_s", "estimate_wall_s",
                                                                    "forwards_cpu_s")}
        out[arm] = med
        print(f"[{arm:5s}] estimate per pass median cpu {med['estimate_cpu_s'] * 1e3:8.1f} ms, wall "
              f"{med['estimate_wall_s'] * 1e3:8.1f} ms ({100 * med['estimate_cpu_s'] / med['forwards_cpu_s']:.1f}% "
              f"of the pass's forwards, cpu {med['forwards_cpu_s'] * 1e3:.0f} ms); drafted positions "
              f"{mine[-1]['drafted_positions']:.0f}, rate {mine[-1]['drafted_rate']:.4f}; cpu each: "
              f"{', '.join(f'{c['estimate_cpu_s'] * 1e3:.1f}' for c in mine)}")
    ratio = out["every"]["estimate_cpu_s"] / out["first"]["estimate_cpu_s"]
    print(f"every / first (median cpu): {ratio:.2f}")
    out["ratio_cpu"] = ratio
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


# gpu-all ------------------------------------------------------------------------------------------


def gpu_all(which=GPU_ALL):
    """P1 (``logprob``), P2 (``train``) and P4 (``sync_cost.py throughput``, on P2's online model) in one process.

    One JSON per benchmark in ``$OUT`` (or ``benchmarks/results/``) and one summary line each on stdout.
    """
    t0 = time.time()
    C.setup()
    print("[env]", C.env_info(), flush=True)
    if "p1" in which:
        logprob()
        print(f"[time] after P1 {time.time() - t0:.0f} s", flush=True)
    model = None
    if "p2" in which:
        _, ctx = train(keep_online_model="p4" in which)
        model = ctx.get("model")
        print(f"[time] after P2 {time.time() - t0:.0f} s", flush=True)
    if "p4" in which:
        import sync_cost

        sync_cost.throughput(model)
        print(f"[time] after P4 {time.time() - t0:.0f} s", flush=True)


def _gpu_all_arguments(ap):
    ap.add_argument("which", nargs="*", type=str.lower, choices=GPU_ALL, help="benchmarks to run (default: all three)")


# memory ------------------------------------------------------------------------------------------


MEMORY_ARMS = ("skip", "hard_ce", "soft_ce", "tv", "chained_tv")


def _te_model(spec, overrides: dict):
    """megatron's own Transformer Engine hybrid spec (``hybrid_stack_spec``: TE linear/norm/attention, grouped
    experts, the fused Mamba path) at ``spec``'s widths, bf16, on the GPU."""
    from megatron.core.activations import squared_relu
    from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    p = parse_hybrid_pattern(spec.pattern)
    cfg = TransformerConfig(
        num_layers=len(p.main_pattern.replace("|", "")), mtp_num_layers=p.mtp_num_depths or None,
        hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups, kv_channels=spec.hidden_size // spec.num_attention_heads,
        params_dtype=torch.bfloat16, bf16=True, hidden_dropout=0.0, attention_dropout=0.0, is_hybrid_model=True,
        normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=False, activation_func=squared_relu,
        mamba_state_dim=spec.mamba_state_dim, mamba_head_dim=spec.mamba_head_dim, mamba_num_groups=spec.mamba_num_groups,
        use_mamba_mem_eff_path=True, num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none",
        moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True,
        moe_latent_size=spec.moe_latent_size, **overrides)
    return HybridModel(config=cfg, hybrid_stack_spec=hybrid_stack_spec, vocab_size=spec.vocab_size,
                       max_sequence_length=spec.max_sequence_length, hybrid_layer_pattern=spec.pattern,
                       position_embedding_type="none", share_embeddings_and_output_weights=False).cuda()


def _saved_bytes():
    """A context counting the bytes autograd saves for backward (distinct storages): on a CPU, where no
    allocator statistics exist, the device-independent part of what each objective holds."""
    seen, total = set(), [0]

    def pack(t):
        if torch.is_tensor(t):
            key = (t.untyped_storage().data_ptr(), t.device.type)
            if key not in seen:
                seen.add(key)
                total[0] += t.untyped_storage().nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), total


def memory(args) -> dict:
    """Memory of one training forward + backward per MTP objective at the recipe's tokens per GPU.

    One micro-batch of ``--tokens`` tokens (``--seqs`` sequences: packed THD on the Transformer Engine stack,
    ``[seqs, tokens/seqs]`` on the local one), vocabulary ``--vocab``, the online mode (``--mode``; joint: the MTP
    loss trains the trunk and output layer too) (``configure_transformer_config(..., mode)``): ``hybrid_forward`` under ``mtp_objective_scope`` (arm
    ``skip``: ``run_mtp_forward=False``), an fp32 cross-entropy on the logits (verl's log-probs), backward. Per call:
    peak allocated memory above what was allocated before the forward (CUDA), and the bytes autograd saved for
    backward (every device). Arms rotated per round. Writes ``memory_per_objective.json``.
    """
    from verl_mtp_plugin import configure_transformer_config, hybrid_forward
    from verl_mtp_plugin.objective import mtp_objective_scope

    C.setup()
    stack = args.stack or ("te" if C.CUDA and importlib.util.find_spec("transformer_engine") else "local")
    if stack == "te" and not C.CUDA:
        raise SystemExit("--stack te needs CUDA and Transformer Engine (../shared/tools/h200-te/)")
    spec = C.bench_spec(pattern=args.pattern, vocab_size=args.vocab, hidden_size=args.hidden,
                        ffn_hidden_size=4 * args.hidden, max_sequence_length=args.tokens)
    overrides = configure_transformer_config({}, args.mode, mtp_loss_scaling_factor=0.3)
    if args.whole_mtp_logits:  # megatron's own path: each depth's logits whole (what the plugin did before)
        from verl_mtp_plugin import objective

        objective.CHUNKED_MTP_HEAD = False
    if args.recompute == "full":  # the recipes' setting (super_mtp_common.yaml): every layer, MTP's too, recomputed
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if not C.CUDA:  # megatron's checkpoint saves the CUDA RNG state (tensor_parallel/random.py:
            # _get_all_rng_states -> torch.cuda.random.get_rng_state): the host's stands in for it on CPU
            import megatron.core.tensor_parallel.random as tp_random

            tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
            tp_random._set_cuda_rng_state = lambda *a, **k: None
    model = _te_model(spec, overrides) if stack == "te" else C.build(spec, config_overrides=overrides)
    n_seq, per = args.seqs, args.tokens // args.seqs
    g = torch.Generator().manual_seed(0)
    packed = None
    if stack == "te":
        from megatron.core.packed_seq_params import PackedSeqParams

        ids = torch.randint(0, spec.vocab_size, (1, per * n_seq), generator=g).to(C.device())
        pos = torch.arange(per).repeat(n_seq)[None].to(C.device())
        cu = torch.arange(0, per * n_seq + 1, per, dtype=torch.int32, device=C.device())
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=per,
                                 max_seqlen_kv=per, total_tokens=per * n_seq)
        mask = None
    else:
        ids, pos, mask = C.batch(spec, per, n_seq)
    loss_mask = torch.ones(ids.shape, device=C.device())
    labels = torch.roll(ids, -1, dims=1)
    rows: list = []
    for rnd in range(args.rounds):
        arms = list(args.arms[rnd % len(args.arms):] + args.arms[: rnd % len(args.arms)])
        for arm in arms:
            model.zero_grad(set_to_none=True)
            C.sync()
            base = torch.cuda.memory_allocated() if C.CUDA else 0
            if C.CUDA:
                torch.cuda.reset_peak_memory_stats()
            hooks, saved = _saved_bytes()
            kw = {"loss_mask": loss_mask, "packed_seq_params": packed} if arm != "skip" else {"packed_seq_params": packed}
            with hooks:
                if arm == "skip":
                    logits = hybrid_forward(model, ids, pos, mask, run_mtp_forward=False, **kw)
                else:
                    with mtp_objective_scope(model, arm, temperature=1.0, loss_mask=loss_mask, packed_seq_params=packed):
                        logits = hybrid_forward(model, ids, pos, mask, run_mtp_forward=True, **kw)
                logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
                loss = -logp.mean()
            del logits, logp
            loss.backward()
            C.sync()
            row = {"round": rnd, "arm": arm, "saved_for_backward_gib": saved[0] / 2**30,
                   "peak_above_start_gib": (torch.cuda.max_memory_allocated() - base) / 2**30 if C.CUDA else None}
            rows.append(row)
            print(f"[memory] round {rnd} {arm:<10} saved {row['saved_for_backward_gib']:.3f} GiB, peak above start "
                  f"{row['peak_above_start_gib'] if row['peak_above_start_gib'] is None else round(row['peak_above_start_gib'], 2)}",
                  flush=True)
            del loss
    summary = {}
    for arm in args.arms:
        mine = [r for r in rows if r["arm"] == arm]
        summary[arm] = {k: [r[k] for r in mine] for k in ("saved_for_backward_gib", "peak_above_start_gib")}
    res = {"stack": stack, "recompute": args.recompute, "mode": args.mode, "whole_mtp_logits": args.whole_mtp_logits,
           "tokens": per * n_seq, "seqs": n_seq, "vocab": spec.vocab_size,
           "spec": C.spec_dict(spec),
           "params": C.param_counts(model), "env": C.env_info(), "calls": rows, "by_arm": summary,
           "resident_gib": torch.cuda.memory_allocated() / 2**30 if C.CUDA else None}
    print(f"[memory] wrote {C.write_json(f'memory_per_objective_{args.tag}.json', res)}")
    return res


def _memory_arguments(ap):
    ap.add_argument("--stack", choices=("te", "local"), default=None,
                    help="te: megatron's Transformer Engine hybrid spec, packed THD (default on CUDA with TE); "
                         "local: the testing package's local spec, [seqs, tokens/seqs] (CPU)")
    ap.add_argument("--arms", default=",".join(MEMORY_ARMS), help="skip (MTP not run) and MTP objectives")
    ap.add_argument("--tokens", type=int, default=18432, help="tokens of the micro-batch (the recipe's per GPU)")
    ap.add_argument("--seqs", type=int, default=8, help="sequences packed into it")
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--pattern", default="M*E/*E", help="hybrid pattern main/mtp")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--recompute", choices=("none", "full"), default="none",
                    help="full: the recipes' activation recompute (granularity full, uniform, 1 layer; MTP layers too)")
    ap.add_argument("--mode", choices=("online", "joint"), default="online",
                    help="the MTP mode (joint: the MTP loss trains the trunk and the output layer too)")
    ap.add_argument("--whole-mtp-logits", action="store_true",
                    help="megatron's own MTP loss path (each depth's logits whole), for comparison")
    ap.add_argument("--tag", default="gpu")


def _memory_run(args):
    args.arms = tuple(a for a in args.arms.split(",") if a)
    bad = [a for a in args.arms if a not in MEMORY_ARMS]
    if bad:
        raise SystemExit(f"--arms: {bad} not in {MEMORY_ARMS}")
    return memory(args)


COMMANDS = {
    "logprob": (logprob, None, lambda args: logprob()),
    "train": (train, None, lambda args: train()),
    "estimate": (estimate, _estimate_arguments, None),
    "estimate-pass": (estimate_pass, _estimate_pass_arguments, None),
    "gpu-all": (gpu_all, _gpu_all_arguments, lambda args: gpu_all(tuple(args.which) or GPU_ALL)),
    "memory": (memory, _memory_arguments, _memory_run),
}


def main(argv=None):
    return C.run_subcommands(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    main()
