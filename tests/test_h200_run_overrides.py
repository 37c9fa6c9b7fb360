"""``benchmarks/h200_main_ppo/run.py``: the overrides of the Super-widths runs compose with the shipped recipes.

``--tokens-per-gpu`` (the modes on an 80 GB card) sets the update's tokens per micro-batch and the log-prob passes'
at twice that, as the recipe relates them; the reference's pass follows the actor's value through verl's own
``ref.yaml`` interpolation. Without it every value is the recipe's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("h200_main_ppo_run", ROOT / "benchmarks" / "h200_main_ppo" / "run.py")
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)


def _composed(tmp_path, monkeypatch, *extra):
    from verl_mtp_plugin.trainer.config import compose_recipe

    assets = tmp_path / "assets"
    assets.mkdir(exist_ok=True)
    (assets / "assets.json").write_text(json.dumps({"answer_len": 400}))
    seen = {}

    def capture(a: argparse.Namespace) -> int:
        recipe, _, ovr = run.mode_overrides("online", a, tmp_path / "w")
        seen["cfg"] = compose_recipe(str(run.RECIPE_DIR), recipe, ovr).actor_rollout_ref
        return 0

    monkeypatch.setattr(run, "preflight", capture)
    assert run.main(["run", "--preflight", "--stack", "te", "--assets", str(assets), "--out", str(tmp_path / "o"),
                     "--modes", "online", "--response-len", "400", *extra]) == 0
    c = seen["cfg"]
    return (c.actor.ppo_max_token_len_per_gpu, c.rollout.log_prob_max_token_len_per_gpu,
            c.ref.log_prob_max_token_len_per_gpu)


def test_tokens_per_gpu_sets_the_update_and_both_log_prob_passes(tmp_path, monkeypatch):
    assert _composed(tmp_path, monkeypatch, "--tokens-per-gpu", "9216") == (9216, 18432, 9216)


def test_without_it_the_recipes_tokens_per_gpu_stand(tmp_path, monkeypatch):
    assert _composed(tmp_path, monkeypatch) == (18432, 36864, 18432)


def _summary(path, mode, gen, acc_len, pos0, est, resp_max, steps=12):
    metrics = {str(s): {"timing_s/gen": gen, "rollout/spec_accept_length": acc_len,
                        "rollout/spec_accept_rate_pos_0": pos0, "actor/mtp_expected_accept_rate": est,
                        "response_length/max": resp_max, "response_length/mean": resp_max - 50,
                        "timing_s/step": gen + 15, "actor/perf/max_memory_allocated_gb": 50.0 + s}
               for s in range(1, steps + 1)}
    if acc_len is None:  # mode off: vLLM logs no speculation metrics
        for m in metrics.values():
            for k in ("rollout/spec_accept_length", "rollout/spec_accept_rate_pos_0", "actor/mtp_expected_accept_rate"):
                del m[k]
    metrics["1"]["timing_s/gen"] = 99.0  # outside the last 10 steps: must not count
    path.write_text(json.dumps({"runs": {mode: {"metrics": metrics, "events": []}}}))
    return str(path)


def test_compare_reads_the_last_steps_judges_each_criterion_and_splits_the_gen_ratio(tmp_path, capsys):
    paths = [_summary(tmp_path / "on.json", "online", 6.0, 2.5, 0.70, 0.72, 400),
             _summary(tmp_path / "fr.json", "frozen", 9.0, 1.2, 0.20, None, 400),
             _summary(tmp_path / "off.json", "off", 12.0, None, None, None, 380)]
    out = tmp_path / "cmp.json"
    assert run.main(["compare", *paths, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["modes"]["online"]["steps"] == list(range(3, 13))
    assert res["modes"]["online"]["gen_s"] == 6.0 and res["modes"]["off"]["peak_alloc_gib"] == 62.0
    c = res["criteria"]
    assert abs(c["gen_ratio_online_off"]["value"] - 0.5) < 1e-12 and c["gen_ratio_online_off"]["met"]
    assert abs(c["accept_gain_online_frozen"]["value"] - 0.5) < 1e-12 and c["accept_gain_online_frozen"]["met"]
    assert abs(c["estimate_diff_online"]["value"] - 0.02) < 1e-12 and c["estimate_diff_online"]["met"]
    f = res["factors"]["online_off"]
    # sequential verify steps: 400 / 2.5 = 160 online, 380 / 1 = 380 off; their product with s per step is the ratio
    assert abs(f["seq_verify_steps"] - 160 / 380) < 1e-12
    assert abs(f["seq_verify_steps"] * f["s_per_seq_step"] - 0.5) < 1e-12
    assert "NOT met" not in capsys.readouterr().out
    # a slower online rollout, a drafter no better than frozen's, an estimate off by 0.05: each criterion fails
    paths[0] = _summary(tmp_path / "on.json", "online", 9.0, 1.4, 0.30, 0.35, 400)
    assert run.main(["compare", *paths, "--json", str(out)]) == 0
    c = json.loads(out.read_text())["criteria"]
    assert not any(v["met"] for v in c.values())
    assert capsys.readouterr().out.count("NOT met") == 3


def test_compare_on_the_committed_online_run_gives_its_quoted_estimate_gap(capsys):
    # RESULTS.md, the second Super lease: the overlap estimate within 0.028 of vLLM at every step of 11-20
    assert run.main(["compare", str(ROOT / "benchmarks/results/h200_super_s2/summary.json")]) == 0
    out = capsys.readouterr().out
    assert "| online | 11-20 | 8.55 |" in out and "0.011 / 0.028" in out
