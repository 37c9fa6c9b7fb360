"""The hand-written RL loop (``verl_mtp_plugin.testing.rl_loop``): every phase on the tiny model with the real
vLLM drafter, in each mode, and the invariants verl's own trainer cannot show (logits parity between the
logprob and train passes, online isolation bit for bit, frozen MTP without optimizer state, the logprob
mismatch, tokens/s against a no-speculation engine). ``verl-mtp demo`` is verl's trainer: test_demo.py."""

import json
import math
import re

import pytest

from verl_mtp_plugin.testing import rl_loop as demo_mod
from verl_mtp_plugin.testing.rl_loop import DemoInvariantError, DemoTask, run_demo

pytestmark = pytest.mark.usefixtures("megatron_env")


@pytest.mark.parametrize("mode", ["off", "frozen", "online", "joint"])
def test_demo_two_steps_in_each_mode(mode, tmp_path):
    """Real vLLM rollout every step: synced through the extension, acceptance measured by vLLM next to
    the trainer's estimate, tokens/s with and without speculation, logprob mismatch."""
    hist = run_demo(mode=mode, steps=2, seed=1, device="cpu", out=str(tmp_path), progress=False, warmup_steps=8)
    assert [r["step"] for r in hist] == [1, 2]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows == json.loads(json.dumps(hist))  # what was returned is what was written
    assert (tmp_path / "demo.png").stat().st_size > 1000
    for r in hist:
        assert 0.0 <= r["reward"] <= 1.0 and math.isfinite(r["policy_loss"])
        trained = mode in ("online", "joint")
        assert math.isfinite(r["mtp_loss"]) is trained  # MTP loss only where the mode trains it
        assert math.isfinite(r["expected_accept_rate"]) is trained
        if trained:
            assert 0.0 <= r["expected_accept_rate"] <= 1.0 and 1.0 <= r["expected_accept_length_k3"] <= 4.0
        assert r["rollout/tokens_per_s"] > 0
        # bf16 vLLM vs fp32 Megatron on the sampled tokens: small but not zero
        assert 0.0 < r["rollout/logprob_abs_diff"] < 0.05
        if mode == "off":
            assert "sync/bytes_drafter" not in r and "rollout/spec_accept_rate" not in r
        else:  # vLLM's own counters, read through the plugin's spec_metrics, every step
            assert r["rollout/spec_num_drafts"] >= 16 and 0.0 <= r["rollout/spec_accept_rate_pos_0"] <= 1.0
            assert 1.0 <= r["rollout/spec_accept_length"] <= 3.0
            assert r["rollout/tokens_per_s_no_spec"] > 0 and r["rollout/speedup"] > 0
            assert r["mtp_guard/desync"] == 0.0
            assert r["sync/bytes_target"] > 0  # the full stream: target weights too
    if mode in ("online", "joint"):
        assert all(r["sync/bytes_drafter"] > 0 for r in hist)
        for r in hist:  # a synced drafter measures what the trainer expects for the same policy
            assert r["rollout/spec_accept_rate_pos_0"] > 0.7 * r["argmax_draft_accept_rate"]
    if mode == "frozen":  # loaded into the drafter once, then skipped
        assert hist[0]["sync/bytes_drafter"] > 0 and hist[1]["sync/bytes_drafter"] == 0


def test_demo_break_sync_makes_the_guard_stop_the_run(tmp_path, capsys):
    """--break-sync swap-eh (drafter loaded exactly, wired wrongly): the desync guard fires on the
    measured acceptance and the demo exits non-zero with the guard's message."""
    with pytest.raises(DemoInvariantError) as info:
        run_demo(mode="online", steps=4, device="cpu", out=str(tmp_path), progress=False, break_sync="swap-eh")
    err = str(info.value)
    assert "drafter-desync guard fired (--break-sync swap-eh)" in err
    assert re.search(r"MTP drafter desync suspected at step \d: measured acceptance [0-9.]+ < 0\.7 x expected", err)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows and rows[-1]["mtp_guard/desync"] == 1.0
    assert rows[-1]["rollout/spec_accept_rate_pos_0"] < 0.7 * rows[-1]["argmax_draft_accept_rate"]


def test_demo_fails_loudly_when_the_drafter_would_miss_a_weight(tmp_path, monkeypatch):
    from verl_mtp_plugin import export

    real = export.export_mtp_weights

    def drops_one(model, **kw):
        pairs = list(real(model, **kw))
        first_mtp = next(i for i, (n, _) in enumerate(pairs) if n.startswith("mtp."))
        return iter(pairs[:first_mtp] + pairs[first_mtp + 1 :])  # an MTP weight silently lost on the way

    monkeypatch.setattr(export, "export_mtp_weights", drops_one)
    with pytest.raises(DemoInvariantError, match="drafter sync failed verification"):
        run_demo(mode="online", steps=1, device="cpu", out=str(tmp_path), progress=False, warmup_steps=2)


def test_demo_parity_invariant_is_checked(tmp_path, monkeypatch):
    """If the train pass returned different logits than the logprob pass, the demo must stop."""
    real = demo_mod._token_logprobs
    calls = {"n": 0}

    def skewed(logits, ids):
        calls["n"] += 1
        return real(logits, ids)

    monkeypatch.setattr(demo_mod, "_token_logprobs", skewed)
    import verl_mtp_plugin.control as control

    real_fwd = control.hybrid_forward

    def perturbed(model, *a, run_mtp_forward, **kw):
        out = real_fwd(model, *a, run_mtp_forward=run_mtp_forward, **kw)
        return out + 1e-3 if (run_mtp_forward and model.training) else out

    monkeypatch.setattr(control, "hybrid_forward", perturbed)
    with pytest.raises(DemoInvariantError, match="parity"):
        run_demo(mode="online", steps=1, device="cpu", out=str(tmp_path), progress=False, warmup_steps=0)


def test_reward_is_verifiable():
    import torch

    task = DemoTask(length=4)
    p = torch.tensor([[1, 3 + 2, 3 + 4, 2]])  # a=2, b=4: step 2
    assert task.answers(p).tolist() == [[3 + 6, 3 + 0, 3 + 2, 3 + 4]]  # 6, 8%8=0, 2, 4
    assert task.reward(p, task.answers(p)).item() == 1.0
    assert task.reward(p, torch.tensor([[9, 3, 0, 0]])).item() == 0.5
