"""`verl-mtp demo`: verl's own trainer (python -m verl_mtp_plugin.main_ppo) on the shipped recipes, run as a user
runs it (a subprocess of ``python -m verl_mtp_plugin demo``), online then frozen, and with the sync broken."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


def _demo(out, *args, timeout=1500):
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    return subprocess.run([sys.executable, "-m", "verl_mtp_plugin", "demo", "--out", str(out), *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


def test_demo_runs_verls_trainer_online_then_frozen(tmp_path):
    p = _demo(tmp_path, "--steps", "2")
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    out = p.stdout
    assert "python -m verl_mtp_plugin.main_ppo" in out and "grpo_online, grpo_frozen" in out
    assert "[online] step 2/2 reward" in out and "[frozen] step 2/2 reward" in out  # progress lines
    assert out.count("verl's trainer exited 0") == 2 and "all runs finished" in out
    assert "avx512_bf16" in out  # the CPU line
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    by = {m: [r for r in rows if r["mode"] == m] for m in ("online", "frozen")}
    assert [r["step"] for r in by["online"]] == [1, 2] and [r["step"] for r in by["frozen"]] == [1, 2]
    for r in by["online"]:
        assert r["actor/mtp_grad_norm"] > 0 and r["actor/mtp_losses/mtp_1_loss"] > 0
        assert 0.0 < r["rollout/spec_accept_rate_pos_0"] <= 1.0  # the vLLM server's own counters
        assert 0.0 <= r["actor/mtp_argmax_draft_accept_rate"] <= 1.0  # the trainer's estimate beside it
        assert r["sync/bytes_drafter"] > 0 and r["mtp_guard/desync"] == 0.0
    for r in by["frozen"]:
        assert r.get("actor/mtp_grad_norm", 0.0) == 0.0 and "actor/mtp_losses/mtp_1_loss" not in r
        assert 0.0 < r["rollout/spec_accept_rate_pos_0"] <= 1.0
    assert [r["sync/bytes_drafter"] > 0 for r in by["frozen"]] == [True, False]  # loaded once
    assert (tmp_path / "demo.png").stat().st_size > 1000
    assert "mtp_gnorm" in out and "vLLM_acc" in out  # the table


def test_demo_break_sync_makes_the_guard_stop_verls_trainer(tmp_path):
    """--break-sync swap-eh: the drafter is loaded exactly but wired wrongly; the desync guard (action fail)
    stops verl's trainer and the demo exits 2 with the guard's message."""
    p = _demo(tmp_path, "--mode", "online", "--steps", "2", "--break-sync", "swap-eh")
    assert p.returncode == 2, (p.stdout[-3000:], p.stderr[-3000:])
    assert "drafter-desync guard fired (--break-sync swap-eh) and stopped verl's trainer" in p.stderr
    assert "MTP drafter desync suspected at step" in p.stderr
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows and rows[-1]["mtp_guard/desync"] == 1.0
    assert rows[-1]["rollout/spec_accept_rate_pos_0"] < 0.5 * rows[-1]["actor/mtp_argmax_draft_accept_rate"]
