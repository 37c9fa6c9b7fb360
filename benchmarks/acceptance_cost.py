"""Cost of the in-trainer MTP acceptance estimate, side by side in one run.

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
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: CPU time is not inflated by spinning threads on a busy machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

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
            est = probe.estimate(logits, mask, max_positions=args.max_positions)
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
                te = now()
                probe.estimate(logits, mask, max_positions=n)
                times.append(since(te))
        sweep[n] = times

    def stat(rows, clock, fn=statistics.median):
        return fn([r[clock] for r in rows])

    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, device cpu, load average at end {os.getloadavg()[0]:.1f}")
    print(f"model: HybridModel pattern {model.hybrid_layer_pattern!r}, hidden {h}, vocab {args.vocab}, "
          f"{n_params / 1e6:.2f}M params; batch {args.batch} x seq {args.seq} (prompt {args.prompt}); "
          f"max_positions {args.max_positions}; {args.rounds} interleaved rounds after {args.warmup} warm-up")
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
    for n, times in sweep.items():
        c, w = stat(times, "cpu"), stat(times, "wall")
        print(f"  max_positions {n:5d}: cpu {c * 1e3:7.2f} ms = {100 * c / res['cpu']['step_without']:.2f}%   "
              f"wall {w * 1e3:7.2f} ms = {100 * w / res['wall']['step_without']:.2f}%")
    res["sweep"] = sweep
    print(f"last estimate: {EXPECTED_KEY}={est.get(EXPECTED_KEY):.4f} {GREEDY_KEY}={est.get(GREEDY_KEY):.4f}")
    return res


if __name__ == "__main__":
    main()
