"""`verl-mtp demo`: verl's own trainer (python -m verl_mtp_plugin.main_ppo) on the shipped recipes, run once as a user
runs it (a subprocess of ``python -m verl_mtp_plugin demo``: online and frozen side by side, 10 steps each), and the story it
must show read from that run's metrics.jsonl, table and demo.png. The ``--break-sync`` path is checked without a
trainer run (overrides, environment, exit codes); the guard stopping verl's trainer on a broken sync is
``tests/test_main_ppo.py``'s."""

import json
import re
import subprocess

import pytest

from verl_mtp_cpu import demo as D

STEPS = 10


#: the trainer's estimate the demo compares vLLM's measured acceptance with: the one of the drafting method the
#: shipped recipes configure (probabilistic: the overlap sum min(p, q)); test_demo_follows_the_recipes_drafting_method
#: checks that the demo derives it from the recipe
ESTIMATE = "actor/mtp_expected_accept_rate"


@pytest.fixture(scope="module")
def run(demo_run):
    """The session's one demo run (``demo_run`` in conftest.py, started with the session; tests/test_main_ppo.py
    reads it too)."""
    out = demo_run.out
    p = subprocess.CompletedProcess(demo_run.cmd, demo_run.rc, demo_run.stdout, demo_run.stderr)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")] if (out / "metrics.jsonl").exists() else []
    return out, p, {m: [r for r in rows if r["mode"] == m] for m in ("online", "frozen")}


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.vllm
@pytest.mark.timeout(3000)  # waiting for the demo (started with the session; tests/trainer_runs.py: 2400 s)
def test_demo_runs_verls_trainer_online_and_frozen(run):
    out, p, by = run
    assert p.returncode == 0, (p.stdout[-4000:], p.stderr[-4000:])
    text = p.stdout
    assert "python -m verl_mtp_plugin.main_ppo" in text and "grpo_online, grpo_frozen" in text
    assert f"[online] step {STEPS}/{STEPS} reward" in text and f"[frozen] step {STEPS}/{STEPS} reward" in text
    assert text.count("verl's trainer exited 0") == 2 and "all runs finished" in text
    assert "avx512_bf16" in text  # the CPU line
    assert [r["step"] for r in by["online"]] == list(range(1, STEPS + 1)) == [r["step"] for r in by["frozen"]]
    for r in by["online"]:
        assert r["actor/mtp_grad_norm"] > 0 and r["actor/mtp_losses/mtp_1_loss"] > 0
        assert 0.0 < r["rollout/spec_accept_rate_pos_0"] <= 1.0  # the vLLM server's own counters
        assert 0.0 <= r[ESTIMATE] <= 1.0  # the trainer's estimate beside it
        assert 1.0 <= r["rollout/spec_accept_length"] <= 3.0  # tokens per verify step at k=2
        assert r["sync/bytes_drafter"] > 0 and r["mtp_guard/desync"] == 0.0
    for r in by["frozen"]:
        assert r.get("actor/mtp_grad_norm", 0.0) == 0.0 and "actor/mtp_losses/mtp_1_loss" not in r
        assert 0.0 < r["rollout/spec_accept_rate_pos_0"] <= 1.0
    assert [r["sync/bytes_drafter"] > 0 for r in by["frozen"]] == [True] + [False] * (STEPS - 1)  # loaded once
    assert (out / "demo.png").stat().st_size > 10_000
    # the one table: a row per step, online and frozen side by side
    head = next(line for line in text.splitlines() if "online:reward" in line)
    assert "frozen:reward" in head and head.count("vLLM_acc") == 2 and "est_acc" in head and head.count("tok/step") == 2
    assert f"est_acc: {ESTIMATE} (the trainer's estimate" in text  # the legend names the recipe's estimate


@pytest.mark.vllm
@pytest.mark.timeout(3000)  # waiting for the demo (started with the session; tests/trainer_runs.py: 2400 s)
def test_demo_shows_the_online_vs_frozen_story(run):
    """On verl's own numbers: the reward rises, online acceptance stays above frozen's as the policy moves off the
    rule the MTP head learned, and vLLM's measured acceptance tracks the trainer's estimate."""
    _, p, by = run
    assert p.returncode == 0, (p.stdout[-4000:], p.stderr[-4000:])
    on, fr = by["online"], by["frozen"]
    reward = [r["critic/score/mean"] for r in on]
    acc_on = [r["rollout/spec_accept_rate_pos_0"] for r in on]
    acc_fr = [r["rollout/spec_accept_rate_pos_0"] for r in fr]
    rise = _mean(reward[-3:]) - _mean(reward[:3])
    gap = _mean(acc_on[-3:]) - _mean(acc_fr[-3:])
    tracking = _mean([abs(r["rollout/spec_accept_rate_pos_0"] - r[ESTIMATE]) for r in on])
    assert rise >= D.STORY_REWARD_RISE == 0.15, reward
    assert gap >= D.STORY_ACCEPT_GAP == 0.15, (acc_on, acc_fr)
    assert tracking <= D.STORY_TRACKING == 0.1, [(r["rollout/spec_accept_rate_pos_0"], r[ESTIMATE]) for r in on]
    # the frozen drafter loses acceptance as the policy moves: its last steps below its first
    assert _mean(acc_fr[-3:]) < _mean(acc_fr[:3]), acc_fr
    # the closing line states these numbers
    line = next(x for x in p.stdout.splitlines() if x.startswith("all runs finished"))
    m = re.search(r"online reward ([\d.]+) -> ([\d.]+)", line)
    assert (float(m[1]), float(m[2])) == (round(_mean(reward[:3]), 2), round(_mean(reward[-3:]), 2)), line
    m = re.search(r"online ([\d.]+) -> ([\d.]+), frozen ([\d.]+) -> ([\d.]+) \(online ([+-][\d.]+)", line)
    assert float(m[2]) == round(_mean(acc_on[-3:]), 2) and float(m[4]) == round(_mean(acc_fr[-3:]), 2), line
    assert float(m[5]) == round(gap, 2), line


# ---------------------------------------------------------------- without a trainer run


def test_demo_follows_the_recipes_drafting_method():
    """The estimate the demo judges with is the one of the drafting method the run's config has: the shipped
    recipes draft probabilistically; a run that drafts greedily is judged with p[argmax q]; mode off (the recipe
    with MTP off in verl's keys and the recipe's speculative_config deleted) speculates not at all."""
    from verl_mtp_plugin.config_keys import ARGMAX_DRAFT_METRIC, EXPECTED_METRIC

    assert D.estimate_metric("online") == D.estimate_metric("frozen") == EXPECTED_METRIC == ESTIMATE
    greedy = "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.draft_sample_method=greedy"
    assert D.estimate_metric("online", (greedy,)) == ARGMAX_DRAFT_METRIC
    assert D.estimate_metric("off") is None
    assert "~actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config" in D.mode_overrides("off", seed=0)[1]


def test_story_check_passes_a_story_and_names_what_is_missing():
    def rows(mode, reward, acc, est=None):
        return [{"mode": mode, "step": i + 1, D.REWARD: r, D.ACCEPT: a, **({ESTIMATE: e} if est else {})}
                for i, (r, a, e) in enumerate(zip(reward, acc, est or acc))]

    good = {"online": rows("online", [.4, .4, .5, .6, .7, .8], [.7, .7, .7, .7, .75, .8], [.72, .7, .68, .7, .74, .8]),
            "frozen": rows("frozen", [.4, .4, .5, .6, .7, .8], [.7, .7, .6, .5, .45, .4])}
    assert D.check_story(good, steps=6) == []
    flat = {"online": rows("online", [.5] * 6, [.6] * 6, [.9] * 6), "frozen": rows("frozen", [.5] * 6, [.55] * 6)}
    problems = D.check_story(flat, steps=6)
    assert len(problems) == 3 and "reward rose +0.000" in problems[0] and "exceeds frozen's by +0.050" in problems[1]
    assert "0.300 from the trainer's estimate" in problems[2]
    # too few steps or one mode: nothing to judge
    assert D.check_story(flat, steps=5) == [] and D.check_story({"online": flat["online"]}, steps=6) == []


def test_modes_run_at_the_same_settings_and_break_sync_adds_the_failing_guard():
    online, on = D.mode_overrides("online", seed=3)
    frozen, fr = D.mode_overrides("frozen", seed=3)
    assert (online, frozen) == ("grpo_online", "grpo_frozen") and on == fr  # same sizes, lr and seeds
    assert f"actor_rollout_ref.actor.optim.lr={D.DEMO_LR}" in on and "actor_rollout_ref.rollout.seed=3" in on
    assert not set(D.GUARD_FAIL) & set(on)
    for brk in ("swap-eh", "skip-drafter"):
        assert set(D.GUARD_FAIL) <= set(D.mode_overrides("online", seed=0, break_sync=brk)[1])
    with pytest.raises(ValueError, match="break_sync"):
        D.mode_overrides("online", seed=0, break_sync="nope")


def test_the_suites_background_runs_keep_the_runtime_a_test_stands_in_for(monkeypatch):
    """The suite's trainer runs go on in other threads while tests such as the next one replace the CPU runtime's
    ``run_recipe`` and ``ensure_assets``: the runs bound the real ones when they started (a CI run lost six tests and
    the next one's call count to the stand-in)."""
    import trainer_runs
    import verl_mtp_cpu as vc
    from verl_mtp_cpu import harness

    real_run, real_assets = harness.run_recipe, harness.ensure_assets
    monkeypatch.setattr(vc, "run_recipe", lambda *a, **k: None)
    monkeypatch.setattr(harness, "run_recipe", lambda *a, **k: None)
    monkeypatch.setattr(harness, "ensure_assets", lambda root: None)
    assert trainer_runs.run_recipe is real_run and trainer_runs.ensure_assets is real_assets


def test_break_sync_reaches_the_trainer_and_a_guard_stop_exits_2(tmp_path, monkeypatch, capsys):
    """run_demo --break-sync hands the break to the harness (its environment variable for the vLLM extension) with
    the failing guard; a run the guard stopped becomes DemoInvariantError with the guard's message (exit 2), any
    other failure DemoRunError (exit 1). A stand-in for verl's trainer returns what the harness returns."""
    import verl_mtp_cpu as vc
    from verl_mtp_cpu import harness
    from verl_mtp_cpu.events import ENV_BREAK_SYNC

    env = harness.cpu_env(tmp_path / "m.jsonl", tmp_path / "e.jsonl", entry="plugin", break_sync="swap-eh")
    assert env[ENV_BREAK_SYNC] == "swap-eh"
    calls = []
    guard_log = ("...\nverl_mtp_plugin.rollout.monitor.desync_guard.MTPDesyncError: MTP drafter desync suspected at step 1: "
                 "vLLM accepted 0.02 of first drafts\n  trainer estimate 0.71\n")

    def fake_run_recipe(recipe, workdir, *, break_sync, extra_overrides, **kw):
        calls.append((recipe, break_sync, list(extra_overrides)))
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "x.log").write_text(fake_run_recipe.log)
        return harness.RecipeResult(recipe=recipe, entry="plugin", rc=1, wall_s=1.0, workdir=workdir,
                                    log_path=workdir / "x.log", cmd=[], metrics={1: {D.ACCEPT: 0.02}},
                                    checkpoints={}, events=[])

    monkeypatch.setattr(vc, "run_recipe", fake_run_recipe)
    monkeypatch.setattr(harness, "ensure_assets", lambda root: None)
    fake_run_recipe.log = guard_log
    with pytest.raises(D.DemoInvariantError, match="guard fired .--break-sync swap-eh.") as e:
        D.run_demo(modes=("online", "frozen"), steps=2, out=str(tmp_path / "o"), break_sync="swap-eh", progress=False)
    assert "MTP drafter desync suspected at step 1" in str(e.value)
    assert [c[:2] for c in calls] == [("grpo_online", "swap-eh")]  # the first mode only
    assert set(D.GUARD_FAIL) <= set(calls[0][2])
    assert json.loads((tmp_path / "o" / "metrics.jsonl").read_text())[D.ACCEPT] == 0.02
    fake_run_recipe.log = "Traceback: something else\n"
    with pytest.raises(D.DemoRunError):
        D.run_demo(modes=("frozen",), steps=2, out=str(tmp_path / "o2"), progress=False)

    # the CLI's exit codes
    from verl_mtp_plugin.cli import build_parser

    for error, code in ((D.DemoInvariantError("guard"), 2), (D.DemoRunError("boom"), 1), (None, 0)):
        def fake_run_demo(**kw):
            if error is not None:
                raise error
        monkeypatch.setattr(D, "run_demo", fake_run_demo)
        args = build_parser().parse_args(["demo", "--break-sync", "swap-eh", "--device", "cpu"])
        assert D.main_cli(args) == code
    capsys.readouterr()
