"""`verl-mtp demo`: verl's own trainer (python -m verl_mtp_plugin.main_ppo) on the shipped recipes, run as a user
runs it (a subprocess of ``python -m verl_mtp_plugin demo``), online then frozen, and with the sync broken."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


@pytest.mark.timeout(1800)
def test_demo_runs_verls_trainer_online_then_frozen(demo_run):
    p, tmp_path = demo_run, demo_run.out
    assert p.rc == 0, (p.stdout[-3000:], p.stderr[-3000:])
    out = p.stdout
    assert "python -m verl_mtp_plugin.main_ppo" in out and "grpo_online, grpo_frozen" in out
    assert "[online] step 10/10 reward" in out and "[frozen] step 10/10 reward" in out  # progress lines
    assert out.count("verl's trainer exited 0") == 2 and "all runs finished" in out
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    by = {m: [r for r in rows if r["mode"] == m] for m in ("online", "frozen")}
    assert [r["step"] for r in by["online"]] == list(range(1, 11)) and [r["step"] for r in by["frozen"]] == list(range(1, 11))
    for r in by["online"]:
        assert r["actor/mtp_grad_norm"] > 0 and r["actor/mtp_losses/mtp_1_loss"] > 0
        assert 0.0 < r["rollout/spec_accept_rate_pos_0"] <= 1.0  # the vLLM server's own counters
        assert 0.0 <= r["actor/mtp_argmax_draft_accept_rate"] <= 1.0  # the trainer's estimate beside it
        assert r["sync/bytes_drafter"] > 0 and r["mtp_guard/desync"] == 0.0
    for r in by["frozen"]:
        assert r.get("actor/mtp_grad_norm", 0.0) == 0.0 and "actor/mtp_losses/mtp_1_loss" not in r
        assert 0.0 < r["rollout/spec_accept_rate_pos_0"] <= 1.0
    assert [r["sync/bytes_drafter"] > 0 for r in by["frozen"]] == [True] + [False] * 9  # loaded once
    assert (tmp_path / "demo.png").stat().st_size > 1000
    assert "mtp_gnorm" in out and "vLLM_acc" in out  # the table
