"""``benchmarks/h200_main_ppo/run.py``: the overrides of the Super-widths runs compose with the shipped recipes.

``--tokens-per-gpu`` (the modes on an 80 GB card) sets the update's tokens per micro-batch and the log-prob passes'
at twice that, as the recipe relates them; the reference's pass follows the actor's value through verl's own
``ref.yaml`` interpolation. Without it every value is the recipe's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("h200_main_ppo_run", ROOT / "benchmarks" / "h200_main_ppo" / "run.py")
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)


def _composed_config(tmp_path, monkeypatch, *extra):
    """The composed online recipe under ``run --preflight`` args (``--stack te``, a 400-token task's assets)."""
    from verl_mtp_plugin.trainer.config import compose_recipe

    assets = tmp_path / "assets"
    assets.mkdir(exist_ok=True)
    (assets / "assets.json").write_text(json.dumps({"answer_len": 400}))
    seen = {}

    def capture(a: argparse.Namespace) -> int:
        recipe, _, ovr = run.mode_overrides("online", a, tmp_path / "w")
        seen["cfg"] = compose_recipe(str(run.RECIPE_DIR), recipe, ovr)
        return 0

    monkeypatch.setattr(run, "preflight", capture)
    assert run.main(["run", "--preflight", "--stack", "te", "--assets", str(assets), "--out", str(tmp_path / "o"),
                     "--modes", "online", *extra]) == 0
    return seen["cfg"]


def _composed(tmp_path, monkeypatch, *extra):
    c = _composed_config(tmp_path, monkeypatch, "--response-len", "400", *extra).actor_rollout_ref
    return (c.actor.ppo_max_token_len_per_gpu, c.rollout.log_prob_max_token_len_per_gpu,
            c.ref.log_prob_max_token_len_per_gpu)


def test_tokens_per_gpu_sets_the_update_and_both_log_prob_passes(tmp_path, monkeypatch):
    assert _composed(tmp_path, monkeypatch, "--tokens-per-gpu", "9216") == (9216, 18432, 9216)


def test_without_it_the_recipes_tokens_per_gpu_stand(tmp_path, monkeypatch):
    assert _composed(tmp_path, monkeypatch) == (18432, 36864, 18432)


def _rollout_keys(tmp_path, monkeypatch, *extra):
    """The composed online recipe's k, trained MTP depths and CUDA-graph ceiling under ``run --preflight`` args."""
    c = _composed_config(tmp_path, monkeypatch, "--prompts", "32", "--n", "8", *extra).actor_rollout_ref
    return (c.model.mtp.num_speculative_tokens, c.actor.megatron.override_transformer_config.mtp_num_layers,
            c.rollout.engine_kwargs.vllm.compilation_config.max_cudagraph_capture_size)


def test_k_moves_vllms_drafts_the_trained_depths_and_the_graph_ceiling_together(tmp_path, monkeypatch):
    # 256 sequences: a full decode step holds 256 x (k + 1) tokens
    assert _rollout_keys(tmp_path, monkeypatch) == (2, 2, 768)  # the recipe's k
    assert _rollout_keys(tmp_path, monkeypatch, "--k", "3") == (3, 3, 1024)
    with pytest.raises(SystemExit):
        run.main(["run", "--preflight", "--assets", str(tmp_path), "--out", str(tmp_path), "--k", "0"])


def _summary(path, mode, gen, acc_len, pos0, est, resp_max, steps=12):
    """A mode's summary.json: steps 1..steps, int-like string keys as verl's file logger writes them; the gen time
    and accept length alternate around the given means (+-1 s, +-0.5) so a ratio of means and a mean of ratios
    differ."""
    metrics = {}
    for s in range(1, steps + 1):
        sign = 1 if s % 2 else -1
        m = {"timing_s/gen": gen + sign, "response_length/max": resp_max, "response_length/mean": resp_max - 50,
             # verl's metric is in ms per response token; any unit proportional to gen / mean length tests the ratios
             "timing_per_token_ms/gen": (gen + sign) / (resp_max - 50),
             "timing_s/step": gen + 15, "actor/perf/max_memory_allocated_gb": 50.0 + s}
        if acc_len is not None:  # mode off: vLLM logs no speculation metrics
            m.update({"rollout/spec_accept_length": acc_len + 0.5 * sign, "rollout/spec_accept_rate_pos_0": pos0})
            if est is not None:
                m["actor/mtp_expected_accept_rate"] = est
        metrics[str(s)] = m
    metrics["1"]["timing_s/gen"] = 99.0  # outside the last 10 steps: must not count
    path.write_text(json.dumps({"runs": {mode: {"metrics": metrics, "events": []}}}))
    return str(path)


def _compare(tmp_path, *args):
    out = tmp_path / "cmp.json"
    assert run.main(["compare", *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_compare_reads_the_last_steps_judges_each_criterion_and_splits_the_gen_ratio(tmp_path, capsys):
    paths = [_summary(tmp_path / "on.json", "online", 6.0, 2.5, 0.70, 0.72, 400),
             _summary(tmp_path / "fr.json", "frozen", 9.0, 1.2, 0.20, None, 400),
             _summary(tmp_path / "off.json", "off", 12.0, None, None, None, 380)]
    res = _compare(tmp_path, *paths)
    assert res["modes"]["online"]["steps"] == list(range(3, 13)) and not res["warnings"]
    assert res["modes"]["online"]["gen_s"] == 6.0 and res["modes"]["off"]["peak_alloc_gib"] == 62.0
    c = res["criteria"]
    assert abs(c["gen_ratio_online_off"]["value"] - 0.5) < 1e-12 and c["gen_ratio_online_off"]["met"]
    assert abs(c["accept_gain_online_frozen"]["value"] - 0.5) < 1e-12 and c["accept_gain_online_frozen"]["met"]
    assert abs(c["estimate_diff_online"]["value"] - 0.02) < 1e-12 and c["estimate_diff_online"]["met"]
    assert c["estimate_diff_online"]["steps_judged"] == 10
    f = res["factors"]["online_off"]
    # sequential verify steps, the mean over steps of 400 / accept length (3.0 and 2.0 alternating): 166.67 online,
    # 380 off (1 token per step without speculation); seconds per step 6 / 166.67 online, 12 / 380 off
    assert abs(res["modes"]["online"]["seq_verify_steps"] - 500 / 3) < 1e-9
    assert abs(f["seq_verify_steps"] - (500 / 3) / 380) < 1e-12
    assert abs(f["s_per_seq_step"] - (6 / (500 / 3)) / (12 / 380)) < 1e-12
    assert abs(res["factors"]["frozen_off"]["gen_ratio"] - 0.75) < 1e-12
    # seconds per generated token, verl's metric in microseconds: the mean over steps of (gen +- 1) / (max - 50),
    # with the window's least and most; its ratio differs from the gen ratio where the lengths differ (350 vs 330)
    on_w = res["modes"]["online"]
    assert abs(on_w["gen_us_per_token"] - 6000 / 350) < 1e-9
    assert (on_w["gen_us_per_token_min"], on_w["gen_us_per_token_max"]) == pytest.approx((5000 / 350, 7000 / 350))
    assert abs(f["s_per_token"] - (6 / 350) / (12 / 330)) < 1e-12
    fo = res["factors"]["frozen_off"]
    assert abs(fo["seq_verify_steps"] - (400 / 1.7 + 400 / 0.7) / 2 / 380) < 1e-12
    assert abs(fo["s_per_token"] - (9 / 350) / (12 / 330)) < 1e-12
    out = capsys.readouterr().out
    assert "| 17.1 (14.3-20.0) |" in out and "NOT met" not in out
    # a slower online rollout, a drafter no better than frozen's, an estimate off by 0.05: each criterion fails
    paths[0] = _summary(tmp_path / "on.json", "online", 9.0, 1.4, 0.30, 0.35, 400)
    c = _compare(tmp_path, *paths)["criteria"]
    assert not any(v["met"] for v in c.values())
    assert capsys.readouterr().out.count("NOT met") == 3


def test_compare_says_what_it_could_not_judge_and_warns_on_short_or_unequal_windows(tmp_path, capsys):
    off = _summary(tmp_path / "off.json", "off", 12.0, None, None, None, 380)
    res = _compare(tmp_path, off)
    assert res["criteria"] == {} and set(res["not_judged"]) == {
        "gen_ratio_online_off", "accept_gain_online_frozen", "estimate_diff_online"}
    assert "missing: online" in res["not_judged"]["gen_ratio_online_off"]
    assert capsys.readouterr().out.count("not judged") == 3
    # online cut at step 7: a window of 7 steps (1-7) against off's 3-12
    on = _summary(tmp_path / "on.json", "online", 6.0, 2.5, 0.70, 0.72, 400, steps=7)
    res = _compare(tmp_path, on, off)
    assert res["modes"]["online"]["steps"] == list(range(1, 8))
    assert any("fewer than --last 10" in w for w in res["warnings"])
    assert any("windows differ" in w for w in res["warnings"])
    # a speculating step that lacks vLLM's accept length is left out of the estimate, not read as 1 token per step
    data = json.loads(pathlib.Path(on).read_text())
    del data["runs"]["online"]["metrics"]["7"]["rollout/spec_accept_length"]
    pathlib.Path(on).write_text(json.dumps(data))
    w = _compare(tmp_path, on)["modes"]["online"]
    assert abs(w["seq_verify_steps"] - (400 / 3 + 400 / 2 + 400 / 3 + 400 / 2 + 400 / 3 + 400 / 2) / 6) < 1e-9
    # a step with vLLM's acceptance but no trainer estimate is not judged, so the criterion is not met
    del data["runs"]["online"]["metrics"]["5"]["actor/mtp_expected_accept_rate"]
    pathlib.Path(on).write_text(json.dumps(data))
    c = _compare(tmp_path, on)["criteria"]["estimate_diff_online"]
    assert c["steps_judged"] == 6 and not c["met"]


def test_compare_refuses_a_window_below_one_step(tmp_path):
    off = _summary(tmp_path / "off.json", "off", 12.0, None, None, None, 380)
    with pytest.raises(SystemExit):
        run.main(["compare", off, "--last", "0"])


def test_table_names_a_run_without_speculation_and_one_with_a_single_drafter_load(capsys):
    assert run.main(["table", str(ROOT / "benchmarks/results/h100_super_modes/off/run/summary.json")]) == 0
    out = capsys.readouterr().out
    assert "no drafter (no speculation)" in out and "| peak alloc GiB |" in out and "| 31.4 | 0.424 |" in out
    # the first Super lease: online stopped before step 1, its drafter loaded once at start-up
    assert run.main(["table", str(ROOT / "benchmarks/results/h200_super_s1/summary.json")]) == 0
    out = capsys.readouterr().out
    assert "drafter loaded in updates [1], no later update" in out and "no drafter" not in out


def test_compare_on_the_committed_online_run_gives_its_quoted_estimate_gap(capsys):
    # RESULTS.md, the second Super lease: the overlap estimate within 0.028 of vLLM at every step of 11-20
    assert run.main(["compare", str(ROOT / "benchmarks/results/h200_super_s2/summary.json")]) == 0
    out = capsys.readouterr().out
    assert "| online | 11-20 | 8.55 |" in out and "0.011 / 0.028" in out
    assert "(<= 0.03, 10 of 10 steps judged; against actor/mtp_expected_accept_rate: met)" in out


def test_compare_of_the_committed_h100_modes_gives_the_quoted_ratio_and_factors(capsys):
    # RESULTS.md, the H100 modes: online's generation 1.13x off's over steps 11-20, the split into 0.383x the
    # sequential verify steps at 2.952x the seconds per step, the estimate within 0.016 at every step
    modes = ROOT / "benchmarks/results/h100_super_modes"
    assert run.main(["compare", str(modes / "off/run/summary.json"), str(modes / "online/run/summary.json")]) == 0
    out = capsys.readouterr().out
    assert "| online | 11-20 | 7.16 | 26.21 |" in out and "| 2.64 | 0.866 | 0.870 | 0.009 / 0.016 |" in out
    assert "gen_ratio_online_off: 1.132 (<= 0.6: NOT met; 95 % interval over the steps 1.031-1.247)" in out
    assert "seq_verify_steps 0.383, s_per_seq_step 2.952, response_len_max 1.000" in out
    assert "accept_gain_online_frozen: not judged (missing: frozen)" in out


def test_compare_of_the_three_committed_h100_modes_gives_the_quoted_gain_split_and_seconds_per_token(capsys):
    # RESULTS.md, the third mode run: frozen's drafter 0.645 below online's at the first draft, frozen's generation
    # 0.905x off's at 1.23 tokens per verify step, and all three modes' seconds per generated token
    modes = ROOT / "benchmarks/results/h100_super_modes"
    assert run.main(["compare", *(str(modes / m / "run/summary.json") for m in ("off", "online", "frozen"))]) == 0
    out = capsys.readouterr().out
    assert "| frozen | 11-20 | 5.73 | 16.87 |" in out and "| 1.23 | 0.220 |" in out
    assert "| 61.8 (52.0-66.4) |" in out and "| 69.9 (58.2-88.9) |" in out and "| 55.9 (52.3-61.2) |" in out
    assert "accept_gain_online_frozen: 0.645 (>= 0.15: met)" in out
    assert "gen_ratio 0.905, seq_verify_steps 0.815, s_per_seq_step 1.111, response_len_max 1.000, s_per_token 0.905" in out


def test_the_plot_title_names_the_cards_the_summaries_ran_on(tmp_path):
    modes = ROOT / "benchmarks/results/h100_super_modes"
    h100 = [str(modes / "off/run/summary.json"), str(modes / "online/run/summary.json")]
    assert run.plot_cards(h100) == "an H100 80GB HBM3"
    other = tmp_path / "summary.json"
    other.write_text(json.dumps({"runs": {}, "nvidia_smi": "NVIDIA H200, 143771 MiB, 580.159.04\n"}))
    assert run.plot_cards([*h100, str(other)]) == "an H100 80GB HBM3 and an H200"
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"runs": {}}))
    assert run.plot_cards([str(bare)]) == "a GPU"


def test_compare_warns_when_a_modes_log_prob_passes_ran_at_another_pace(tmp_path):
    # the reference's and the actor's log-prob passes do the same work in every mode at equal response lengths: a
    # mode whose passes ran 1.5x off's ran on a slower machine, and its time ratios to off carry that
    def with_pace(path, mode, gen, acc, pos0, est, ref, logp):
        p = pathlib.Path(_summary(path, mode, gen, acc, pos0, est, 400))
        data = json.loads(p.read_text())
        for m in data["runs"][mode]["metrics"].values():
            m.update({"timing_s/ref": ref, "timing_s/old_log_prob": logp})
        p.write_text(json.dumps(data))
        return str(p)

    off = with_pace(tmp_path / "off.json", "off", 12.0, None, None, None, 4.0, 2.0)
    on = with_pace(tmp_path / "on.json", "online", 6.0, 2.5, 0.7, 0.72, 4.2, 1.9)  # within 10 %
    res = _compare(tmp_path, off, on)
    assert not res["warnings"]
    assert (res["modes"]["online"]["ref_s"], res["modes"]["online"]["logp_s"]) == pytest.approx((4.2, 1.9))
    on = with_pace(tmp_path / "on.json", "online", 6.0, 2.5, 0.7, 0.72, 6.0, 2.0)
    (w,) = _compare(tmp_path, off, on)["warnings"]
    assert w.startswith("online: its reference log-prob pass took 6.00 s, off's 4.00 s (1.50x")


def test_the_gen_ratios_interval_resamples_the_steps_of_both_runs():
    assert run.ratio_interval([3.0] * 10, [6.0] * 10) == (0.5, 0.5)  # no spread within the runs: no interval
    lo, hi = run.ratio_interval([2.0, 4.0] * 5, [6.0] * 10)
    assert lo < 0.5 < hi and 1 / 3 < lo and hi < 2 / 3  # the ratio of means inside, narrower than the steps' range
    assert run.ratio_interval([2.0, 4.0] * 5, [6.0] * 10) == (lo, hi)  # seeded
    assert run.ratio_interval([3.0], [6.0, 6.0]) is None and run.ratio_interval([None, 3.0], [6.0] * 3) is None


def test_compare_of_the_second_online_run_gives_the_quoted_ratio_and_pace(capsys):
    # RESULTS.md, the second online run: 0.608x off's generation over steps 11-20 at off's pace (its log-prob
    # passes within 4 % of off's), the first online run's lease 1.46x / 1.38x slower in the same passes
    modes = ROOT / "benchmarks/results/h100_super_modes"
    runs = [str(modes / m / "run/summary.json") for m in ("off", "frozen", "online2")]
    assert run.main(["compare", *runs]) == 0
    out = capsys.readouterr().out
    assert "| online | 11-20 | 3.85 | 17.60 |" in out and "| 37.6 (34.4-42.0) | 3.97 / 1.93 |" in out
    assert "gen_ratio_online_off: 0.608 (<= 0.6: NOT met; 95 % interval over the steps 0.577-0.647)" in out
    assert "seq_verify_steps 0.380, s_per_seq_step 1.600" in out and "warning" not in out
    assert run.main(["compare", *runs[:2], str(modes / "online/run/summary.json")]) == 0
    out = capsys.readouterr().out
    assert "its reference log-prob pass took 5.88 s, off's 4.03 s (1.46x" in out
    assert "its actor log-prob pass took 2.78 s, off's 2.01 s (1.38x" in out


def test_a_run_records_the_hosts_cpu_model_cores_and_vector_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 avx512f "
                    "avx512_bf16 amx_tile sse4_2\n\nprocessor\t: 1\nmodel name\t: Intel(R) Xeon(R) Processor\n"
                    "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile sse4_2\n")
    assert run.host_cpu(str(info)) == {"model": "Intel(R) Xeon(R) Processor", "cores": 2,
                                       "flags": ["amx_tile", "avx512_bf16", "avx512f"]}
    assert run.host_cpu(str(tmp_path / "missing")) is None


def test_compare_shows_two_runs_of_a_mode_each_labelled_and_judges_the_last_given(tmp_path, capsys):
    # the criterion's common reference: online run in two leases, both beside off; each gets a row, the criteria
    # are judged on the last one given
    (tmp_path / "online" / "run").mkdir(parents=True)
    (tmp_path / "online2" / "run").mkdir(parents=True)
    first = _summary(tmp_path / "online" / "run" / "summary.json", "online", 9.0, 2.5, 0.70, 0.72, 400)
    second = _summary(tmp_path / "online2" / "run" / "summary.json", "online", 6.0, 2.5, 0.70, 0.72, 400)
    off = _summary(tmp_path / "off.json", "off", 12.0, None, None, None, 400)
    res = _compare(tmp_path, off, first, second)
    assert list(res["modes"]) == ["off", "online@online", "online@online2"]
    assert res["judged"]["online"] == "online@online2"
    assert abs(res["criteria"]["gen_ratio_online_off"]["value"] - 0.5) < 1e-12
    out = capsys.readouterr().out
    assert "| online@online | 3-12 | 9.00 |" in out and "| online@online2 | 3-12 | 6.00 |" in out
    assert run.labelled_runs([off, first])[0].keys() == {"off", "online"}  # one run of a mode: its bare name


def test_the_per_token_model_recovers_a_fixed_plus_per_token_cost_and_reads_the_committed_runs(tmp_path, capsys):
    # runs built from 10 ms per plain step, 11 ms per verify step and 20 us per token at 256 sequences of 400
    # tokens: the exact fit gives them back, whatever the accept lengths (each step's own, around the mode's mean)
    def mode_run(name, lens):
        metrics = {}
        for s, acc in enumerate(lens, start=1):
            steps = 400 / acc
            ms = (10.0 if name == "off" else 11.0) + 0.020 * 256 * acc
            gen = steps * ms / 1000
            m = {"timing_s/gen": gen, "response_length/max": 400, "response_length/mean": 400,
                 "timing_per_token_ms/gen": gen * 1000 / (256 * 400)}
            if name != "off":
                m.update({"rollout/spec_accept_length": acc, "rollout/spec_accept_rate_pos_0": acc / 3})
            metrics[str(s)] = m
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({"runs": {name: {"metrics": metrics, "events": []}}}))
        return str(p)

    paths = [mode_run("off", [1.0] * 10), mode_run("frozen", [1.2, 1.3] * 5), mode_run("online", [2.5, 2.8] * 5)]
    tm = _compare(tmp_path, *paths)["token_model"]
    assert tm["us_per_token"] == pytest.approx(20.0, rel=0.03)
    assert (tm["fixed_plain_ms"], tm["fixed_verify_ms"]) == pytest.approx((10.0, 11.0), abs=0.2)
    assert tm["online_slope_us_per_token"] == pytest.approx(20.0, rel=1e-6) and tm["online_slope_r"] > 0.999
    lo, hi = tm["us_per_token_interval"]
    assert lo <= tm["us_per_token"] <= hi
    # frozen and online at one accept length: no fit (the per-token cost is not identified)
    paths[1] = mode_run("frozen", [2.5, 2.8] * 5)
    assert "token_model" not in _compare(tmp_path, *paths)
    # RESULTS.md, "mode online again": the committed runs' fit and its check inside the online run
    modes = ROOT / "benchmarks/results/h100_super_modes"
    assert run.main(["compare", *(str(modes / m / "run/summary.json") for m in ("off", "frozen", "online2"))]) == 0
    out = capsys.readouterr().out
    assert "21.5 us per generated token (19.1-23.7 resampled), fixed ms per plain / verify step 10.31 / 10.81" in out
    assert "within online: 26.0 us per token accepted (r 0.89)" in out


def test_compare_shows_each_runs_k_and_fits_no_per_token_model_across_two_ks(tmp_path, capsys):
    # online at k=3 (run --k 3 records it in the summary's args), frozen at the recipe's 2: one fixed verify cost
    # cannot hold both, so no model, and a warning says why; k shows per speculating mode
    on = _summary(tmp_path / "on.json", "online", 6.0, 3.2, 0.70, 0.72, 400)
    data = json.loads(pathlib.Path(on).read_text())
    data["args"] = {"k": 3}
    for m in data["runs"]["online"]["metrics"].values():
        m.update({"rollout/spec_accept_rate_pos_1": 0.6, "rollout/spec_accept_rate_pos_2": 0.5})
    pathlib.Path(on).write_text(json.dumps(data))
    fr = _summary(tmp_path / "fr.json", "frozen", 9.0, 1.2, 0.20, None, 400)
    off = _summary(tmp_path / "off.json", "off", 12.0, None, None, None, 400)
    res = _compare(tmp_path, off, fr, on)
    assert (res["modes"]["online"]["k"], res["modes"]["frozen"]["k"], res["modes"]["off"]["k"]) == (3, 2, None)
    assert "token_model" not in res
    assert any("no per-token model: frozen drafted k=2, online k=3" in w for w in res["warnings"])
    out = capsys.readouterr().out
    assert "| online | 3-12 | 6.00 |" in out and "| 3 | 0.600 / 0.500 |" in out and "| - | - / - |" in out


def test_a_checkpoint_cut_by_the_time_cap_is_marked_and_compare_warns(tmp_path, capsys):
    # super_assets.py at tiny widths on CPU: a cap of 0 s ends both phases before their first step; the default cap
    # lets them finish. The cut checkpoint says so (assets.json, a WARNING line), run.py reads it, compare warns.
    def assets(name, *extra):
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'cpu_runtime'}", "VLLM_TARGET_DEVICE": "cpu"}
        script = ROOT / "benchmarks/h200_main_ppo/super_assets.py"
        p = subprocess.run([sys.executable, str(script), str(tmp_path / name),
                            "--cpu-dry-run", "--steps", "2", "--mtp-steps", "1", "--train-rows", "64", *extra],
                           env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        return p.stdout, tmp_path / name / "assets.json"

    out, cut = assets("cut", "--seconds", "0")
    assert "WARNING: the time cap (--seconds 0) cut the pretraining: joint 0 of 2, MTP-only 0 of 1 steps" in out
    assert run.pretraining(cut) == {"joint_steps": 0, "mtp_steps": 0, "asked": [2, 1], "complete": False}
    out, full = assets("full")
    assert "WARNING" not in out
    assert run.pretraining(full) == {"joint_steps": 2, "mtp_steps": 1, "asked": [2, 1], "complete": True}
    assert run.pretraining(tmp_path / "missing.json") is None
    # the runs' summaries beside their checkpoints' assets.json, as the results keep them (<folder>/run/summary.json)
    for name in ("cut", "full"):
        (tmp_path / name / "run").mkdir()
    off = _summary(tmp_path / "full" / "run" / "summary.json", "off", 12.0, None, None, None, 400)
    on = _summary(tmp_path / "cut" / "run" / "summary.json", "online", 6.0, 2.5, 0.70, 0.72, 400)
    res = _compare(tmp_path, off, on)
    assert res["modes"]["online"]["pretraining"]["complete"] is False
    (warning,) = [w for w in res["warnings"] if "pretrained" in w]
    assert warning.startswith("online: its checkpoint was pretrained 0 joint + 0 MTP-only steps of the 2 + 1 asked")
    # two complete checkpoints of different lengths: another checkpoint too
    data = json.loads(cut.read_text())
    data.update(joint_steps=1, mtp_steps=1, args={**data["args"], "steps": 1, "mtp_steps": 1})
    cut.write_text(json.dumps(data))
    (warning,) = [w for w in _compare(tmp_path, off, on)["warnings"] if "pretrained" in w]
    assert warning == ("online: its checkpoint was pretrained 1 joint + 1 MTP-only steps, off's 2 + 1: another "
                       "checkpoint")
    # the committed runs: only the k=3 lease's checkpoint was cut (10 of 40 MTP-only steps)
    modes = ROOT / "benchmarks/results/h100_super_modes"
    res = _compare(tmp_path, *(str(modes / m / "run/summary.json") for m in ("off", "frozen", "online2", "online_k3")))
    assert [w.split(":")[0] for w in res["warnings"] if "pretrained" in w] == ["online@online_k3"]
    assert "160 joint + 10 MTP-only steps of the 160 + 40 asked" in " ".join(res["warnings"])


def test_the_within_run_line_recovers_a_runs_fixed_and_per_token_cost_and_skips_a_run_without_spread(capsys):
    # 256 sequences of 400 tokens, 12 ms per engine step plus 30 us per generated token: each step's accept length
    # moves the ms per step along that line; vLLM-like noise-free rows give it back exactly
    def rows(lens):
        out = []
        for acc in lens:
            steps = 400 / acc
            ms = 12.0 + 0.030 * 256 * acc
            out.append({"gen_s": steps * ms / 1000, "seq_steps": steps, "resp_max": 400, "sequences": 256})
        return out

    fit = run.within_run(rows([2.0, 2.4, 2.8, 3.2, 3.6]))
    assert fit["intercept_ms"] == pytest.approx(12.0) and fit["us_per_token"] == pytest.approx(30.0)
    assert fit["r"] == pytest.approx(1.0) and fit["us_per_token_interval"] == pytest.approx((30.0, 30.0))
    # noise widens the interval around the slope: Student's t at 3 degrees of freedom on the residuals
    noisy = rows([2.0, 2.4, 2.8, 3.2, 3.6])
    for r, d in zip(noisy, (0.3, -0.2, 0.0, 0.25, -0.35)):
        r["gen_s"] += d * r["seq_steps"] / 1000  # +-d ms on each step's ms per engine step
    fit = run.within_run(noisy)
    lo, hi = fit["us_per_token_interval"]
    import numpy as np

    x = np.array([2.0, 2.4, 2.8, 3.2, 3.6])
    y = 12.0 + 0.030 * 256 * x + np.array([0.3, -0.2, 0.0, 0.25, -0.35])
    b, a = np.polyfit(x, y, 1)
    se = (np.sum((y - a - b * x) ** 2) / 3 / np.sum((x - x.mean()) ** 2)) ** 0.5
    assert (lo, hi) == pytest.approx(((b - 3.182 * se) / 256 * 1e3, (b + 3.182 * se) / 256 * 1e3))
    assert lo < fit["us_per_token"] < hi
    assert run.within_run(rows([1.22, 1.24, 1.23, 1.22])) is None  # frozen's steps 11-20: no span to fit
    assert run.within_run(rows([2.0, 3.0])) is None
    # the committed runs (RESULTS, "k=3 in verl's trainer"): the k=3 run's line beside online's at k=2
    modes = ROOT / "benchmarks/results/h100_super_modes"
    paths = [str(modes / m / "run/summary.json") for m in ("off", "frozen", "online2", "online_k3")]
    assert run.main(["compare", *paths]) == 0
    out = capsys.readouterr().out
    assert ("- within online@online2 (k=2), step by step: ms per engine step 7.8 + 26.0 us per generated token (95 % "
            "interval 15.4 to 36.6; r 0.89)") in out
    assert ("- within online@online_k3 (k=3), step by step: ms per engine step 11.5 + 46.9 us per generated token (95 % "
            "interval 21.5 to 72.3; r 0.83)") in out
    assert "- within frozen" not in out


def test_a_run_records_its_hosts_pace_and_compare_warns_when_it_differs_from_offs(tmp_path, capsys):
    pace = run.host_pace(calls=3, n=20_000)
    assert pace["loop"] == 20_000 and len(pace["each"]) == 3 and pace["seconds"] > 0
    assert pace["seconds"] <= min(pace["each"]) + 1e-4  # the least call (each rounded to 0.1 ms)
    # a run on a host whose loop took 1.5x off's: warned and shown; within 10 %: shown, not warned
    off = _summary(tmp_path / "off.json", "off", 12.0, None, None, None, 400)
    on = _summary(tmp_path / "on.json", "online", 6.0, 2.5, 0.70, 0.72, 400)
    for path, secs in ((off, 0.200), (on, 0.300)):
        data = json.loads(pathlib.Path(path).read_text())
        data["host_pace"] = {"seconds": secs}
        pathlib.Path(path).write_text(json.dumps(data))
    res = _compare(tmp_path, off, on)
    assert res["modes"]["online"]["host_pace_s"] == 0.3
    (w,) = [w for w in res["warnings"] if "host's pure-Python loop" in w]
    assert w.startswith("online: its host's pure-Python loop took 0.300 s, off's 0.200 s (1.50x)")
    assert "| 0.300 |" in capsys.readouterr().out
    data = json.loads(pathlib.Path(on).read_text())
    data["host_pace"] = {"seconds": 0.210}
    pathlib.Path(on).write_text(json.dumps(data))
    assert not [w for w in _compare(tmp_path, off, on)["warnings"] if "host's pure-Python loop" in w]


def test_compare_shows_each_runs_extra_overrides_and_warns_when_the_judged_modes_differ(tmp_path, capsys):
    off = _summary(tmp_path / "off.json", "off", 12.0, None, None, None, 400)
    on = _summary(tmp_path / "on.json", "online", 6.0, 2.5, 0.70, 0.72, 400)
    data = json.loads(pathlib.Path(on).read_text())
    data["args"] = {"override": ["actor_rollout_ref.rollout.calculate_log_probs=false"]}
    pathlib.Path(on).write_text(json.dumps(data))
    res = _compare(tmp_path, off, on)
    assert res["modes"]["online"]["overrides"] == ["actor_rollout_ref.rollout.calculate_log_probs=false"]
    assert res["modes"]["off"]["overrides"] == []
    (w,) = [w for w in res["warnings"] if "--override" in w]
    assert "online: actor_rollout_ref.rollout.calculate_log_probs=false" in w and "off: none" in w
    assert "| `actor_rollout_ref.rollout.calculate_log_probs=false` |" in capsys.readouterr().out
    data = json.loads(pathlib.Path(off).read_text())
    data["args"] = {"override": ["actor_rollout_ref.rollout.calculate_log_probs=false"]}
    pathlib.Path(off).write_text(json.dumps(data))
    assert not [w for w in _compare(tmp_path, off, on)["warnings"] if "--override" in w]


def test_compare_shows_each_runs_rollout_requests_and_warns_when_the_judged_modes_differ(tmp_path, capsys):
    off = _summary(tmp_path / "off.json", "off", 12.0, None, None, None, 400)
    on = _summary(tmp_path / "on.json", "online", 6.0, 2.5, 0.70, 0.72, 400)
    data = json.loads(pathlib.Path(on).read_text())
    data["runs"]["online"]["rollout_requests"] = "lean"  # run_mode found the plugin's server's line in the log
    pathlib.Path(on).write_text(json.dumps(data))
    res = _compare(tmp_path, off, on)
    # a summary written before the plugin's server existed: verl's requests
    assert (res["modes"]["off"]["requests"], res["modes"]["online"]["requests"]) == ("verl", "lean")
    (w,) = [w for w in res["warnings"] if "different requests" in w]
    assert "off: verl; online: lean" in w
    assert "| lean |" in capsys.readouterr().out
    data = json.loads(pathlib.Path(off).read_text())
    data["runs"]["off"]["rollout_requests"] = "lean"
    pathlib.Path(off).write_text(json.dumps(data))
    assert not [w for w in _compare(tmp_path, off, on)["warnings"] if "different requests" in w]


def test_the_lean_mark_is_the_start_of_the_plugins_server_line():
    from verl_mtp_plugin.rollout.request import LEAN_LINE

    line = f"(MTPvLLMHttpServer pid=7) {LEAN_LINE.format(flat=True)}"
    assert run.LEAN_MARK in line and run.LEAN_MARK.startswith("verl_mtp_plugin: vLLM rollout requests")
    assert run.LEAN_MARK not in "(vLLMHttpServer pid=7) INFO vLLM rollout requests"


def test_compare_steps_reads_the_same_steps_of_every_mode_and_refuses_a_bad_range(tmp_path, capsys):
    off = _summary(tmp_path / "off.json", "off", 12.0, None, None, None, 400)
    on = _summary(tmp_path / "on.json", "online", 6.0, 2.5, 0.70, 0.72, 400, steps=6)
    res = _compare(tmp_path, off, on, "--steps", "3-6")
    assert res["last"] == 4 and [res["modes"][m]["steps"] for m in ("off", "online")] == [[3, 4, 5, 6]] * 2
    assert res["modes"]["off"]["gen_s"] == 12.0  # steps 3-6: 13, 11, 13, 11
    assert not [w for w in res["warnings"] if "fewer than" in w]
    res = _compare(tmp_path, off, on, "--steps", "5-8")  # online logged 6 steps: 5-6 of the 4 asked
    assert any(w.startswith("online: 2 steps logged, fewer than --steps 5-8") for w in res["warnings"])
    for bad in ("6-3", "0-2", "3", "a-b"):
        with pytest.raises(SystemExit):
            run.main(["compare", off, on, "--steps", bad])


def test_the_committed_run_without_log_probabilities_gives_the_quoted_figures(capsys, tmp_path):
    # RESULTS.md, "mode online without verl's rollout log-probabilities": steps 3-6 against online again and off
    m = ROOT / "benchmarks/results/h100_super_modes"
    res = _compare(tmp_path, *(str(m / r / "run/summary.json") for r in ("off", "frozen", "online2", "online_nolp")),
                   "--steps", "3-6")
    w = res["modes"]
    nolp, lp, off = w["online@online_nolp"], w["online@online2"], w["off"]
    assert (round(nolp["gen_s"], 2), round(lp["gen_s"], 2), round(off["gen_s"], 2)) == (3.76, 4.84, 5.55)
    assert (round(nolp["gen_s_per_seq_step"], 4), round(lp["gen_s_per_seq_step"], 4),
            round(off["gen_s_per_seq_step"], 4)) == (0.0172, 0.0261, 0.0139)
    assert (round(nolp["accept_len"], 2), round(lp["accept_len"], 2)) == (1.83, 2.17)
    assert nolp["overrides"] == ["actor_rollout_ref.rollout.calculate_log_probs=false"] and lp["overrides"] == []
    assert nolp["host_pace_s"] == pytest.approx(0.2755, abs=1e-4)
    assert any("different --override settings" in x for x in res["warnings"])


def test_the_committed_lean_off_run_gives_the_quoted_figures(capsys, tmp_path):
    # RESULTS.md, "mode off with the plugin's vLLM server": steps 11-20 against off with verl's request
    m = ROOT / "benchmarks/results/h100_super_modes"
    res = _compare(tmp_path, str(m / "off_lean/run/summary.json"), str(m / "off/run/summary.json"))
    w = res["modes"]
    lean, verl = w["off@off_lean"], w["off@off"]
    assert (lean["requests"], verl["requests"]) == ("lean", "verl")
    assert lean["steps"] == list(range(11, 21)) and verl["steps"] == list(range(11, 21))
    assert (round(lean["gen_s"], 2), round(verl["gen_s"], 2)) == (6.07, 6.33)
    assert (round(lean["ref_s"], 2), round(lean["logp_s"], 2), round(verl["ref_s"], 2),
            round(verl["logp_s"], 2)) == (4.92, 2.56, 4.03, 2.01)
    assert lean["host_pace_s"] == pytest.approx(0.6608, abs=1e-4) and verl["host_pace_s"] is None
    assert sum("another pace" in x for x in res["warnings"]) == 2


def test_the_committed_short_online_lease_gives_the_quoted_early_steps(tmp_path):
    # RESULTS.md, "the short lease of online with the plugin's vLLM server": steps 2-3 of the three runs
    m = ROOT / "benchmarks/results/h100_super_modes"
    res = _compare(tmp_path, str(m / "off_lean/run/summary.json"), str(m / "online_lean_short/run/summary.json"),
                   str(m / "online2/run/summary.json"), "--steps", "2-3")
    lean, verl, off = (res["modes"][k] for k in ("online@online_lean_short", "online@online2", "off"))
    assert (lean["requests"], verl["requests"], lean["steps"]) == ("lean", "verl", [2, 3])
    assert (round(lean["gen_s"], 2), round(lean["accept_len"], 2), round(lean["accept_pos0"], 3)) == (3.65, 1.89, 0.521)
    assert (round(verl["gen_s"], 2), round(verl["accept_len"], 2), round(off["gen_s"], 2)) == (4.14, 2.05, 6.46)
    assert (round(1000 * lean["gen_s_per_seq_step"], 1), round(1000 * verl["gen_s_per_seq_step"], 1)) == (16.6, 21.0)
    assert lean["host_pace_s"] == pytest.approx(0.2778, abs=1e-4)


def test_compare_judges_the_estimate_in_its_drafted_form_where_every_step_logs_it(tmp_path, capsys):
    """The criterion's estimate: the trainer's rate over the positions vLLM drafts at where every step of the window
    logs it, else the mean over positions (the runs before it), named in the verdict."""
    on = tmp_path / "on.json"
    _summary(on, "online", 6.0, 2.5, 0.70, 0.76, 400)
    off = _summary(tmp_path / "off.json", "off", 12.0, None, None, None, 380)
    res = _compare(tmp_path, str(on), off)
    assert res["modes"]["online"]["estimate_key"] == "actor/mtp_expected_accept_rate"
    assert not res["criteria"]["estimate_diff_online"]["met"]  # 0.06 from vLLM's 0.70
    data = json.loads(on.read_text())
    for s, m in data["runs"]["online"]["metrics"].items():
        m["actor/mtp_drafted_expected_accept_rate"] = 0.71
    on.write_text(json.dumps(data))
    res = _compare(tmp_path, str(on), off)
    w = res["modes"]["online"]
    assert w["estimate_key"] == run.DRAFTED_ESTIMATE and w["estimate"] == pytest.approx(0.71)
    assert w["estimate_mean_over_positions"] == pytest.approx(0.76)
    assert res["criteria"]["estimate_diff_online"]["met"]
    assert f"against {run.DRAFTED_ESTIMATE}: met" in capsys.readouterr().out


def test_a_mode_stops_before_the_leases_end_whatever_its_own_limit():
    now = 1_000_000.0
    # no lease end known: the call's budget left or the mode's own limit, the lesser
    assert run.mode_time_left(900.0, 1600.0, 0.0, now) == 900.0
    assert run.mode_time_left(1700.0, 600.0, 0.0, now) == 600.0
    # the lease ends in 1,000 s: the mode stops END_MARGIN_S before it, also under a larger --run-timeout
    assert run.mode_time_left(1700.0, 1600.0, now + 1000.0, now) == 1000.0 - run.END_MARGIN_S
    # a lease end further away than the other limits changes nothing
    assert run.mode_time_left(1700.0, 600.0, now + 5000.0, now) == 600.0
    # the lease's end too near: below --min-run-s's default, so the mode is skipped, not started to be lost
    assert run.mode_time_left(1700.0, 1600.0, now + run.END_MARGIN_S + 30.0, now) == 30.0



def test_run_takes_the_leases_end(monkeypatch):
    seen = {}
    monkeypatch.setattr(run, "cmd_run", lambda a: seen.update(a=a) or 0)
    assert run.main(["run", "--assets", "x", "--out", "o", "--end", "1234567.5"]) == 0
    assert seen["a"].end == 1234567.5 and seen["a"].min_run_s > 30.0
    assert run.main(["run", "--assets", "x", "--out", "o"]) == 0 and seen["a"].end == 0.0


def _host_worker_keys(tmp_path, monkeypatch, *extra):
    """verl's agent-loop, reward and storage worker counts in the composed online recipe under ``run`` args."""
    c = _composed_config(tmp_path, monkeypatch, *extra)
    return (c.actor_rollout_ref.rollout.agent.num_workers, c.reward.num_workers,
            c.transfer_queue.backend.SimpleStorage.num_data_storage_units)


def test_the_runs_keep_verls_host_workers_unless_asked(tmp_path, monkeypatch):
    # unset: verl's own defaults, which the table compare reads for such runs must equal
    defaults = _host_worker_keys(tmp_path, monkeypatch)
    assert defaults == tuple(run.VERL_HOST_WORKERS[k] for k in ("agent", "reward", "storage"))
    # the 2/2/1 every run before the options set, asked for
    assert _host_worker_keys(tmp_path, monkeypatch, "--agent-workers", "2", "--reward-workers", "2",
                             "--storage-units", "1") == (2, 2, 1)
    with pytest.raises(SystemExit):
        run.main(["run", "--assets", "x", "--out", "o", "--agent-workers", "0"])


def test_compare_names_each_runs_host_workers_and_warns_where_the_judged_modes_differ(tmp_path):
    assert run.host_workers({"agent_workers": 2}) == "2/2/1"  # a run before the options: 2/2/1 fixed
    assert run.host_workers({"agent_workers": None, "reward_workers": None, "storage_units": None}) == "8/8/8"
    assert run.host_workers({"agent_workers": 4, "reward_workers": None, "storage_units": 2}) == "4/8/2"
    # an --override of the same key comes after the options in the run's Hydra list, so it is what ran
    assert run.host_workers({"agent_workers": 4, "reward_workers": None, "storage_units": 2, "override": [
        "reward.num_workers=3", "+transfer_queue.backend.SimpleStorage.num_data_storage_units=5"]}) == "4/3/5"
    on = tmp_path / "on.json"
    off = tmp_path / "off.json"
    _summary(on, "online", 6.0, 2.5, 0.70, 0.72, 400)
    _summary(off, "off", 12.0, None, None, None, 400)
    for path, args in ((on, {"agent_workers": None, "reward_workers": None, "storage_units": None}),
                       (off, {"agent_workers": 2})):
        data = json.loads(path.read_text())
        data["args"] = args
        path.write_text(json.dumps(data))
    res = _compare(tmp_path, str(on), str(off))
    assert (res["modes"]["online"]["host_workers"], res["modes"]["off"]["host_workers"]) == ("8/8/8", "2/2/1")
    assert any(w.startswith("the judged modes ran with different agent-loop / reward / storage workers (online: "
                            "8/8/8; off: 2/2/1)") for w in res["warnings"])
    data = json.loads(on.read_text())
    data["args"] = {"agent_workers": 2}
    on.write_text(json.dumps(data))
    assert not any("agent-loop / reward / storage" in w for w in _compare(tmp_path, str(on), str(off))["warnings"])


def test_the_te_stacks_runs_name_triton_s_cache_so_vllms_worker_writes_where_the_carried_cache_is(monkeypatch, tmp_path):
    # unset, torch inductor points TRITON_CACHE_DIR at /tmp/torchinductor_<user>/triton/<device> inside vLLM's worker
    # (its Mamba2 SSD and fused-MoE kernels were built again on every lease); super_session.sh cache keeps ~/.triton
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("VERL_H200_STACK", "te")
    env = run.run_env()
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / ".triton" / "cache")
    assert env["VLLM_DISABLE_COMPILE_CACHE"] == "1"
    monkeypatch.setenv("TRITON_CACHE_DIR", "/shared/triton")  # the caller's is kept
    assert run.run_env()["TRITON_CACHE_DIR"] == "/shared/triton"
    monkeypatch.setenv("VERL_H200_STACK", "standins")  # the tiny runs keep Triton's default
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert "TRITON_CACHE_DIR" not in run.run_env()
