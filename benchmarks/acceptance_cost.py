"""Cost of the in-trainer MTP acceptance estimate (issue 5), side by side in one run.

A train step (forward with MTP + policy-style loss on the returned logits + backward) on a real
megatron-core HybridModel, timed without the probe and with :class:`AcceptanceProbe` attached and
``estimate()`` called between forward and backward, interleaved (A, B, A, B, ...) so drift affects
both equally. ``estimate()`` is also timed on its own inside the B steps.

Run (CPU, ~2-4 minutes on 2 cores):

    .venv/bin/python benchmarks/acceptance_cost.py

Options: ``--hidden 256 --vocab 4096 --seq 256 --batch 4 --prompt 64 --rounds 8 --max-positions 256
--sweep 64 128 256 512``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import warnings

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
warnings.filterwarnings("ignore")

import torch  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args = ap.parse_args(argv)

    from verl_mtp_plugin.acceptance import EXPECTED_KEY, GREEDY_KEY, AcceptanceProbe, acceptance_positions
    from verl_mtp_plugin.control import hybrid_forward
    from verl_mtp_plugin.testing import build_tiny_hybrid, init_megatron, make_batch, reset_mtp_globals

    init_megatron(seed=1234)
    h = args.hidden
    model = build_tiny_hybrid(
        hidden_size=h,
        vocab_size=args.vocab,
        ffn_hidden_size=4 * h,
        num_attention_heads=8,
        num_query_groups=4,
        moe_ffn_hidden_size=h,
        moe_shared_expert_intermediate_size=h,
        moe_latent_size=h // 2,
        mamba_head_dim=32,
        max_sequence_length=args.seq,
    )
    batch = make_batch(batch=args.batch, seq=args.seq, vocab=args.vocab, prompt_len=args.prompt, seed=0)
    mask = batch["response_mask"]
    labels = torch.roll(batch["input_ids"], -1, dims=1)
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)

    def step(with_probe: bool) -> tuple[float, float, dict]:
        for p in params:
            p.grad = None
        reset_mtp_globals()
        t0 = time.perf_counter()
        probe = AcceptanceProbe(model) if with_probe else None
        logits = hybrid_forward(
            model, batch["input_ids"], batch["position_ids"], batch["attention_mask"],
            run_mtp_forward=True, loss_mask=mask,
        )
        est, t_est = {}, 0.0
        if probe is not None:
            te = time.perf_counter()
            est = probe.estimate(logits, mask, max_positions=args.max_positions)
            t_est = time.perf_counter() - te
            probe.close()
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        return time.perf_counter() - t0, t_est, est

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

    # estimate() alone for other subsample sizes, on no-grad forwards of the same batch.
    sweep = {}
    for n in args.sweep:
        times = []
        for _ in range(args.sweep_rounds):
            with AcceptanceProbe(model) as probe, torch.no_grad():
                logits = hybrid_forward(
                    model, batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                    run_mtp_forward=True, loss_mask=mask,
                )
                te = time.perf_counter()
                probe.estimate(logits, mask, max_positions=n)
                times.append(time.perf_counter() - te)
        sweep[n] = statistics.median(times)

    med_a, med_b, med_e = statistics.median(base), statistics.median(probed), statistics.median(est_times)
    res = dict(
        step_without_probe_s=med_a,
        step_with_probe_s=med_b,
        ratio_with_over_without=med_b / med_a,
        estimate_s=med_e,
        estimate_over_step=med_e / med_a,
    )
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, device cpu")
    print(f"model: HybridModel pattern {model.hybrid_layer_pattern!r}, hidden {h}, vocab {args.vocab}, "
          f"{n_params / 1e6:.2f}M params; batch {args.batch} x seq {args.seq} (prompt {args.prompt}); "
          f"max_positions {args.max_positions}; {args.rounds} interleaved rounds after {args.warmup} warm-up")
    print(f"train step fwd+bwd without probe: median {med_a * 1e3:8.1f} ms  (min {min(base) * 1e3:.1f})")
    print(f"train step fwd+bwd with probe:    median {med_b * 1e3:8.1f} ms  (min {min(probed) * 1e3:.1f})")
    print(f"ratio with/without (medians):     {res['ratio_with_over_without']:.4f}")
    print(f"estimate() alone:                 median {med_e * 1e3:8.2f} ms = {100 * res['estimate_over_step']:.2f}% "
          "of the step without probe")
    counted = int(acceptance_positions(mask, 1).sum())
    print(f"estimate() alone by max_positions (no-grad forwards, {counted} counted positions in the batch):")
    for n, t in sweep.items():
        print(f"  max_positions {n:5d}: median {t * 1e3:7.2f} ms = {100 * t / med_a:.2f}% of the step")
    res["sweep"] = sweep
    print(f"last estimate: {EXPECTED_KEY}={est.get(EXPECTED_KEY):.4f} {GREEDY_KEY}={est.get(GREEDY_KEY):.4f}")
    return res


if __name__ == "__main__":
    main()
