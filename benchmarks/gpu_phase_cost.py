"""P1: cost of the log-prob phase with MTP layers present.

Forward only (``torch.no_grad``, eval mode, what verl's log-prob / ref phases run), one CUDA process,
three variants timed in alternating rounds:

* ``no_mtp_model``: the same trunk built without MTP (the ideal);
* ``mtp_skipped``: the model with MTP, ``hybrid_forward(..., run_mtp_forward=False)`` (the plugin);
* ``mtp_run``: the model with MTP, ``run_mtp_forward=True`` (what verl 0.9 does in log-prob today).

Both models hold the same trunk weights. Goal: ``mtp_skipped / no_mtp_model <= 1.01``.

Run: ``python benchmarks/gpu_phase_cost.py`` (writes ``$OUT`` or ``benchmarks/results/gpu_phase_cost.json``).
"""

from __future__ import annotations

import gpu_common as C
import torch


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


def main(shapes=("nemotron3_like_moe", "baseline_dense")):
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


if __name__ == "__main__":
    main()
