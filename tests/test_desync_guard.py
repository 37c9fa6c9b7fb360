"""Drafter-desync guard (verl_mtp_plugin.rollout.monitor.desync_guard): triggering and non-triggering cases, the fail
action, counter resets, the slow-speculation arithmetic, and its config block on verl 0.9.1's real
composed trainer config. Step metrics are produced by verl_mtp_plugin.rollout.monitor.spec_metrics (from vLLM's real
SpecDecodingStats / Prometheus counters in the end-to-end test); estimates by verl_mtp_plugin.acceptance.
"""

import copy
import dataclasses
import logging
import warnings

import pytest

from verl_mtp_plugin.rollout.monitor.desync_guard import (
    ARGMAX_DRAFT_METRIC,
    DEFAULT_DRAFT_COST,
    DEFAULT_VERIFY_COST,
    EXPECTED_METRIC,
    GUARD_CONFIG_PATH,
    MTPDesyncError,
    MTPDesyncGuard,
    MTPDesyncWarning,
    MTPDraftMethodWarning,
    MTPGuardConfig,
    MTPSlowSpeculationWarning,
    MTPSpecStatsMissingWarning,
    breakeven_accept_length,
    engine_batch_size,
    expected_all_position_rate,
    guard_from_verl_config,
    speedup_from_accept_length,
    verify_step_cost,
)
from verl_mtp_plugin.policy import MTPConfigError
from verl_mtp_plugin.rollout.monitor.spec_metrics import (
    SpecDecodeCounterTracker,
    SpecDecodeCounts,
    counts_from_vllm_metrics,
    merge_spec_metrics,
    spec_metrics_from_counts,
    spec_metrics_from_requests,
)

N = 2000  # verify steps per training step
GUARD_CATEGORIES = (MTPDesyncWarning, MTPSlowSpeculationWarning, MTPSpecStatsMissingWarning, MTPDraftMethodWarning)

# every key the desync message must name (checked against verl 0.9.1's config tree in test_config_*)
CAUSE_KEYS = (
    "actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls",
    "verl_mtp_plugin.rollout.worker_extension.MTPColocateWorkerExtension",
    "actor_rollout_ref.model.mtp.enable_train",
    "actor_rollout_ref.rollout.load_format",
    "actor_rollout_ref.model.mtp.enable_rollout",
    "actor_rollout_ref.rollout.free_cache_engine",
    "actor_rollout_ref.rollout.enable_sleep_mode",
    "actor_rollout_ref.rollout.enable_prefix_caching",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.mamba_cache_mode=align",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.draft_sample_method",
)


def step(pos, *, expected=None, argmax=None, reset=None, drafts=N):
    """One step's metric dict from per-position acceptance rates (through spec_metrics' real code)."""
    k = len(pos)
    per_pos = tuple(round(r * drafts) for r in pos)
    m = spec_metrics_from_counts(SpecDecodeCounts(drafts, drafts * k, sum(per_pos), per_pos), reset=reset)
    if expected is not None:
        m[EXPECTED_METRIC] = expected
    if argmax is not None:
        m[ARGMAX_DRAFT_METRIC] = argmax
    return m


def run(guard, steps):
    """Feed steps; return (per-step guard metrics, guard warnings recorded)."""
    outs = []
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for i, m in enumerate(steps, start=1):
            outs.append(guard.observe(m, step=i))
    return outs, [w for w in rec if issubclass(w.category, GUARD_CATEGORIES)]


def of(rec, category):
    return [w for w in rec if w.category is category]


# --------------------------------------------------------------------------------------------------
# desync rules


def test_healthy_run_does_not_warn():
    guard = MTPDesyncGuard(num_speculative_tokens=2)
    steps = [step([0.72, 0.55], expected=0.8, argmax=0.75) for _ in range(10)]
    outs, rec = run(guard, steps)
    assert rec == []
    assert all(o["mtp_guard/desync"] == 0.0 for o in outs)
    assert outs[-1]["mtp_guard/accept_ratio"] == pytest.approx(0.72 / 0.75)  # greedy drafting: argmax estimate
    # no batch known: the measured 64-sequence row, greedy drafting, c_2 = 1.325
    assert outs[-1]["mtp_guard/est_speedup"] == pytest.approx((1 + 0.72 + 0.55) / 1.325)
    assert outs[-1]["mtp_guard/verify_cost"] == pytest.approx(1.325)


def test_ratio_rule_fires_after_patience_and_names_causes(caplog):
    guard = MTPDesyncGuard(num_speculative_tokens=2)  # threshold 0.5, patience 3
    low = step([0.2, 0.05], expected=0.8, argmax=0.7)
    with caplog.at_level(logging.WARNING, logger="verl_mtp_plugin.rollout.monitor.desync_guard"):
        outs, rec = run(guard, [low] * 7)
    desync = of(rec, MTPDesyncWarning)
    # exactly at steps 3 and 6 (first crossing, then every `patience` steps while it persists)
    assert [o["mtp_guard/low_accept_streak"] for o in outs] == [1, 2, 3, 4, 5, 6, 7]
    assert [o["mtp_guard/desync"] for o in outs] == [0, 0, 1, 1, 1, 1, 1]
    assert len(desync) == 2 and "at step 3" in str(desync[0].message) and "at step 6" in str(desync[1].message)
    msg = str(desync[0].message)
    assert "0.2000 < 0.5 x expected 0.7000" in msg and ARGMAX_DRAFT_METRIC in msg
    for key in CAUSE_KEYS:
        assert key in msg, key
    assert "desync suspected at step 3" in caplog.text and "MTPDesyncWarning" in caplog.text


def test_recovery_resets_the_streak():
    guard = MTPDesyncGuard(num_speculative_tokens=2)
    low, ok = step([0.2, 0.05], expected=0.8), step([0.7, 0.5], expected=0.8)
    outs, rec = run(guard, [low, low, ok, low, low])
    assert rec == [] and [o["mtp_guard/low_accept_streak"] for o in outs] == [1, 2, 0, 1, 2]
    outs, rec = run(guard, [low])
    assert len(of(rec, MTPDesyncWarning)) == 1


def test_zero_rule_without_an_estimate_frozen_mode():
    """Frozen mode never runs the MTP forward: no estimate, but zero acceptance is still caught."""
    guard = MTPDesyncGuard(num_speculative_tokens=1)  # zero_patience 2
    outs, rec = run(guard, [step([0.0]), step([0.004])])
    desync = of(rec, MTPDesyncWarning)
    assert len(desync) == 1 and "<= zero_rate 0.01 for 2 consecutive steps" in str(desync[0].message)
    assert "no trainer estimate" in str(desync[0].message)
    assert outs[0]["mtp_guard/desync"] == 0.0 and outs[1]["mtp_guard/desync"] == 1.0


def test_useless_head_is_not_a_desync_but_is_slow():
    """Estimate itself ~0: neither desync rule fires; the slow-speculation rule does."""
    guard = MTPDesyncGuard(num_speculative_tokens=1)
    outs, rec = run(guard, [step([0.0], expected=0.005, argmax=0.004)] * 3)
    assert of(rec, MTPDesyncWarning) == []
    assert len(of(rec, MTPSlowSpeculationWarning)) == 1
    assert outs[-1]["mtp_guard/zero_accept_streak"] == 0.0


def test_fail_action_raises_at_the_trigger_step():
    guard = MTPDesyncGuard({"action": "fail"}, num_speculative_tokens=2)
    low = step([0.1, 0.0], expected=0.8)
    guard.observe(low, step=10)
    guard.observe(low, step=11)
    with pytest.raises(MTPDesyncError, match="desync suspected at step 12") as exc:
        guard.observe(low, step=12)
    assert "actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls" in str(exc.value)
    assert guard.last_message == str(exc.value)


def test_off_action_and_speculation_off_do_nothing():
    low = step([0.0], expected=0.8)
    for guard in (MTPDesyncGuard({"action": "off"}), MTPDesyncGuard(speculation=False)):
        outs, rec = run(guard, [low] * 5)
        assert rec == [] and outs == [{}] * 5


def test_counter_reset_is_named_in_the_message():
    guard = MTPDesyncGuard(num_speculative_tokens=2)
    steps = [step([0.7, 0.5], expected=0.8, reset=False), step([0.0, 0.0], expected=0.8, reset=True)]
    steps += [step([0.0, 0.0], expected=0.8, reset=False)]
    _, rec = run(guard, steps)
    desync = of(rec, MTPDesyncWarning)
    assert len(desync) == 1 and "went backwards at step(s) [2]" in str(desync[0].message)


def test_missing_statistics_warn_once():
    guard = MTPDesyncGuard(num_speculative_tokens=2)
    no_stats = {"actor/pg_loss": 0.1, EXPECTED_METRIC: 0.8}
    too_few = step([0.0, 0.0], expected=0.8, drafts=50)  # < min_drafts: not judged (no zero streak)
    outs, rec = run(guard, [no_stats, no_stats, too_few, no_stats, no_stats])
    missing = of(rec, MTPSpecStatsMissingWarning)
    assert len(missing) == 1 and "disable_log_stats=false" in str(missing[0].message)
    assert of(rec, MTPDesyncWarning) == [] and outs[2]["mtp_guard/zero_accept_streak"] == 0.0


def test_auto_estimate_matches_greedy_drafting():
    """High-entropy policy: overlap ~1 but a greedy draft is accepted with p[argmax q] ~ 1/V. Comparing
    the rollout (greedy drafts, vLLM's default) with the overlap would cry wolf; auto picks the
    argmax-draft estimate for greedy drafting and the overlap for probabilistic drafting."""
    import torch

    from verl_mtp_plugin.acceptance import argmax_draft_acceptance, speculative_overlap

    g = torch.Generator().manual_seed(0)
    p = 0.05 * torch.randn(64, 16, generator=g)
    q = p + 0.01 * torch.randn(64, 16, generator=g)  # a well-synced head
    overlap = float(speculative_overlap(p, q).mean())
    greedy = float(argmax_draft_acceptance(p, q).mean())
    assert overlap > 0.9 and greedy < 0.2
    measured = step([greedy], expected=overlap, argmax=greedy)  # what vLLM measures with greedy drafts

    _, rec = run(MTPDesyncGuard(num_speculative_tokens=1), [measured] * 4)
    assert of(rec, MTPDesyncWarning) == []
    _, rec = run(MTPDesyncGuard({"expected_key": EXPECTED_METRIC}, num_speculative_tokens=1), [measured] * 4)
    assert len(of(rec, MTPDesyncWarning)) == 1
    _, rec = run(MTPDesyncGuard(num_speculative_tokens=1, draft_sample_method="probabilistic"), [measured] * 4)
    assert len(of(rec, MTPDesyncWarning)) == 1  # probabilistic drafting: overlap is the right estimate


def test_auto_estimate_prefers_the_drafted_form():
    """Where the trainer logs the rate over the positions vLLM drafts at, auto compares with it, per drafting
    method, and falls back to the means over positions where it does not."""
    from verl_mtp_plugin.config_keys import DRAFTED_ARGMAX_METRIC, DRAFTED_EXPECTED_METRIC

    measured = step([0.6, 0.4], expected=0.9, argmax=0.8)
    both = {**measured, DRAFTED_EXPECTED_METRIC: 0.62, DRAFTED_ARGMAX_METRIC: 0.58}
    for method, drafted, mean in (("probabilistic", 0.62, 0.9), ("greedy", 0.58, 0.8)):
        guard = dict(num_speculative_tokens=2, draft_sample_method=method)
        outs, _ = run(MTPDesyncGuard(**guard), [both])
        assert outs[0]["mtp_guard/expected_accept_rate"] == pytest.approx(drafted)
        outs, _ = run(MTPDesyncGuard(**guard), [measured])
        assert outs[0]["mtp_guard/expected_accept_rate"] == pytest.approx(mean)


DRAFT_METHOD_KEY = "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.draft_sample_method"


def test_draft_method_advice_for_a_high_entropy_policy():
    """The H200 run's last policy version (2.0 nats): greedy drafts accepted 0.25 (estimate p[argmax q]
    0.285) where the overlap was 0.80. The guard advises probabilistic drafting after `patience` steps and
    again every `patience` steps, never as a desync, and logs the estimated gain every step."""
    drifted = step([0.25, 0.09], expected=0.80, argmax=0.285)
    outs, rec = run(MTPDesyncGuard(num_speculative_tokens=2), [drifted] * 6)
    assert of(rec, MTPDesyncWarning) == []
    advice = of(rec, MTPDraftMethodWarning)
    assert len(advice) == 2  # steps 3 and 6 (patience 3)
    msg = str(advice[0].message)
    assert f"{DRAFT_METHOD_KEY}=probabilistic" in msg
    assert "0.800 with probabilistic drafting" in msg and "0.285 with the configured greedy" in msg
    assert "vLLM measured 0.250" in msg and "+0.515" in msg
    assert f"{GUARD_CONFIG_PATH}.draft_method_margin=null" in msg
    assert [o["mtp_guard/draft_method_gain"] for o in outs] == pytest.approx([0.515] * 6)


def test_draft_method_advice_stays_quiet_or_points_back_to_greedy():
    # a sharp policy (the H200 run's first version: overlap 0.949, p[argmax q] 0.881): greedy is fine
    sharp = step([0.87, 0.77], expected=0.949, argmax=0.881)
    outs, rec = run(MTPDesyncGuard(num_speculative_tokens=2), [sharp] * 6)
    assert rec == [] and outs[-1]["mtp_guard/draft_method_gain"] == pytest.approx(0.068)
    # switched off
    drifted = step([0.25, 0.09], expected=0.80, argmax=0.285)
    _, rec = run(MTPDesyncGuard({"draft_method_margin": None}, num_speculative_tokens=2), [drifted] * 6)
    assert of(rec, MTPDraftMethodWarning) == []
    # probabilistic drafting with a sharp policy and a spread-out head: greedy would accept more
    spread_head = step([0.62], expected=0.62, argmax=0.93)
    outs, rec = run(MTPDesyncGuard(num_speculative_tokens=1, draft_sample_method="probabilistic"), [spread_head] * 3)
    advice = of(rec, MTPDraftMethodWarning)
    assert len(advice) == 1 and f"{DRAFT_METHOD_KEY}=greedy" in str(advice[0].message)
    # the shipped recipes set the key: the plain override changes it (Hydra refuses +key for a key that exists)
    assert f"command line {DRAFT_METHOD_KEY}=greedy where the recipe sets it" in str(advice[0].message)
    assert "more device memory" not in str(advice[0].message)
    assert outs[-1]["mtp_guard/draft_method_gain"] == pytest.approx(0.31)
    # a gain that comes and goes never reaches patience
    _, rec = run(MTPDesyncGuard(num_speculative_tokens=2), [drifted, sharp] * 4)
    assert of(rec, MTPDraftMethodWarning) == []


def test_draft_method_advice_waits_while_a_desync_is_reported():
    """Acceptance ~0 is a desync (the drafter is not the policy's head); advice about the drafting method
    would send the user the wrong way."""
    dead = step([0.0, 0.0], expected=0.80, argmax=0.285)
    _, rec = run(MTPDesyncGuard(num_speculative_tokens=2), [dead] * 6)
    assert of(rec, MTPDesyncWarning) and of(rec, MTPDraftMethodWarning) == []


def test_draft_method_margin_is_validated():
    assert MTPGuardConfig().draft_method_margin == 0.15
    assert MTPGuardConfig.from_dict({"draft_method_margin": None}).draft_method_margin is None
    for bad in (0, 1.5, "big", True):
        with pytest.raises(MTPConfigError, match=f"{GUARD_CONFIG_PATH}.draft_method_margin"):
            MTPGuardConfig.from_dict({"draft_method_margin": bad})


def test_without_positions_the_estimate_is_mapped_to_all_positions():
    from verl_mtp_plugin.acceptance import expected_accept_length

    alpha, k = 0.8, 3
    mapped = expected_all_position_rate(alpha, k)
    assert mapped == pytest.approx((expected_accept_length(alpha, k) - 1) / k)
    # verl-style per-request metrics: overall rate only, no per-position keys
    per_request = [
        {"spec_num_draft_tokens": 3 * N, "spec_num_accepted_tokens": int(0.6 * 3 * N), "spec_num_verify_steps": N}
    ]
    good = {**spec_metrics_from_requests(per_request), EXPECTED_METRIC: alpha}
    outs, rec = run(MTPDesyncGuard(num_speculative_tokens=k), [good] * 4)
    assert rec == [] and outs[0]["mtp_guard/expected_accept_rate"] == pytest.approx(mapped)
    per_request[0]["spec_num_accepted_tokens"] = int(0.25 * 3 * N)
    bad = {**spec_metrics_from_requests(per_request), EXPECTED_METRIC: alpha}
    _, rec = run(MTPDesyncGuard(num_speculative_tokens=k), [bad] * 3)
    assert len(of(rec, MTPDesyncWarning)) == 1 and "all 3 draft positions" in str(rec[0].message)


# --------------------------------------------------------------------------------------------------
# slow speculation


def test_slow_speculation_warns_with_the_arithmetic_and_never_raises():
    from verl_mtp_plugin.acceptance import expected_accept_length, expected_speedup

    # the draft_cost form is acceptance.expected_speedup with the measured accepted length in place of E
    assert speedup_from_accept_length(expected_accept_length(0.6, 3), 3, 0.05) == pytest.approx(
        expected_speedup(0.6, 3, 0.05)
    )
    pos = [0.05, 0.02, 0.01]  # L = 1.08 with k = 3
    c3, c1 = 1.457, 1.184  # measured greedy c_k at 64 sequences (the default, no batch known)
    s = 1.08 / c3
    guard = MTPDesyncGuard({"action": "fail"}, num_speculative_tokens=3)
    outs, rec = run(guard, [step(pos, expected=0.06, argmax=0.05)] * 3)  # synced but weak head
    slow = of(rec, MTPSlowSpeculationWarning)
    assert of(rec, MTPDesyncWarning) == [] and len(slow) == 1
    msg = str(slow[0].message)
    assert f"c_k = {c3:.3f} plain decode steps at 64 sequences (batch not known)" in msg
    assert f"speedup ~= L / c_k = 1.080 / {c3:.3f} = {s:.3f} < 1.0; break-even L = c_k = {c3:.3f}" in msg
    assert "measured on an H200 at the 30B-A3B shape, greedy drafting" in msg and f"{GUARD_CONFIG_PATH}.verify_cost" in msg
    assert f"k=0: 1.000, k=1: {1.05 / c1:.3f}" in msg and "best k = 0" in msg
    # the estimate's basis and the measured side to check it against (verl's own per-token generation time)
    assert "counts engine steps only" in msg and "compare timing_per_token_ms/gen with a run without speculation" in msg
    assert outs[-1]["mtp_guard/est_speedup"] == pytest.approx(s)
    assert outs[-1]["mtp_guard/breakeven_accept_length"] == pytest.approx(c3)


def test_fast_speculation_does_not_warn_slow():
    guard = MTPDesyncGuard(num_speculative_tokens=3)
    _, rec = run(guard, [step([0.4, 0.2, 0.1], expected=0.45)] * 6)  # L = 1.7 > c_3 = 1.457
    assert rec == []


def test_est_speedup_uses_the_measured_verify_cost_by_batch_and_method():
    """speedup = L / c_k(batch): k=2, L=2.2 at 256 sequences is 2.2 / 1.639 (measured), not 2.2 / (1 + 2 * 0.064)."""
    m = step([0.7, 0.5], argmax=0.75)  # L = 2.2

    def est(**kw):
        return MTPDesyncGuard(num_speculative_tokens=2, **kw).observe(m)

    out = est(batch_size=256)
    assert out["mtp_guard/est_speedup"] == pytest.approx(2.2 / 1.639)
    assert out["mtp_guard/breakeven_accept_length"] == pytest.approx(1.639)
    assert est()["mtp_guard/est_speedup"] == pytest.approx(2.2 / 1.325)  # batch unknown: the 64 row
    assert est(batch_size=16)["mtp_guard/est_speedup"] == pytest.approx(2.2 / 1.325)  # below the table: 64 row
    assert est(batch_size=1024)["mtp_guard/est_speedup"] == pytest.approx(2.2 / 1.639)  # above: 256 row
    assert est(batch_size=160)["mtp_guard/verify_cost"] == pytest.approx((1.325 + 1.639) / 2)  # linear in batch
    assert est(batch_size=256, draft_sample_method="probabilistic")["mtp_guard/verify_cost"] == pytest.approx(1.662)
    assert DEFAULT_VERIFY_COST["greedy"] == ((64, (1.184, 1.325, 1.457)), (256, (1.284, 1.639, 2.543)))
    assert DEFAULT_VERIFY_COST["probabilistic"] == ((64, (1.183, 1.346, 1.467)), (256, (1.290, 1.662, 2.566)))


def test_verify_step_cost_in_k():
    table = ((64, (1.2, 1.3, 1.5)),)
    assert verify_step_cost(table, 0) == 1.0
    assert verify_step_cost(table, 0.5) == pytest.approx(1.1)  # from c_0 = 1
    assert verify_step_cost(table, 1.8) == pytest.approx(1.2 + 0.8 * 0.1)  # a scheduled step's mean k
    assert verify_step_cost(table, 5) == pytest.approx(1.5 + 2 * 0.2)  # past the table: its last step
    assert verify_step_cost(table, 2, batch=4096) == pytest.approx(1.3)  # one row: every batch


def test_verify_cost_override_and_draft_cost_compatibility():
    m = step([0.7, 0.5], argmax=0.75)  # L = 2.2
    flat = MTPDesyncGuard({"verify_cost": [1.1, 1.25]}, num_speculative_tokens=2, batch_size=256)
    assert flat.observe(m)["mtp_guard/est_speedup"] == pytest.approx(2.2 / 1.25)
    rows = {"verify_cost": [[32, [1.1, 1.2]], [128, [1.3, 1.6]]]}
    assert MTPDesyncGuard(rows, num_speculative_tokens=2, batch_size=64).observe(m)[
        "mtp_guard/verify_cost"] == pytest.approx(1.2 + (64 - 32) / 96 * 0.4)
    # draft_cost set: c_k = 1 + k * draft_cost at every batch (the earlier formula)
    legacy = MTPDesyncGuard({"draft_cost": 0.1}, num_speculative_tokens=2, batch_size=256)
    assert legacy.observe(m)["mtp_guard/est_speedup"] == pytest.approx(speedup_from_accept_length(2.2, 2, 0.1))
    assert legacy.verify_cost(3) == pytest.approx(breakeven_accept_length(3, 0.1))
    with pytest.raises(MTPConfigError) as exc:
        MTPGuardConfig.from_dict({"draft_cost": 0.1, "verify_cost": [1.2]})
    assert f"{GUARD_CONFIG_PATH}.draft_cost and {GUARD_CONFIG_PATH}.verify_cost are both set" in str(exc.value)


@pytest.mark.parametrize(
    "raw, where, why",
    [
        ([0.9, 1.2], "verify_cost", "c_k < 1"),
        ([1.3, 1.2], "verify_cost", "decrease with k"),
        (["fast"], "verify_cost", "finite numbers"),
        ([True, 1.2], "verify_cost", "finite numbers"),
        ([], "verify_cost=[]", "must be a list"),
        ({"1": 1.2}, "verify_cost=", "must be a list"),
        ([1.2, [64, [1.3]]], "verify_cost=", "not a mix"),
        ([[64, 1.2]], "verify_cost[0]", "a row is [batch"),
        ([[64, [1.2]], [32, [1.3]]], "verify_cost[1]", "larger than the previous row's"),
        ([[64, [1.2, 1.3]], [256, [1.3]]], "verify_cost[1]", "one per k"),
        ([[64.5, [1.2]]], "verify_cost[0]", "must be an integer"),
    ],
)
def test_verify_cost_is_validated_naming_the_key(raw, where, why):
    with pytest.raises(MTPConfigError) as exc:
        MTPGuardConfig.from_dict({"verify_cost": raw})
    assert f"{GUARD_CONFIG_PATH}.{where}" in str(exc.value) and why in str(exc.value)


# --------------------------------------------------------------------------------------------------
# end to end on vLLM's counters


@pytest.mark.vllm
def test_end_to_end_on_vllm_counters_after_an_engine_restart():
    """Healthy steps, then an engine restart whose drafter lost its weights: vLLM's real counters
    (SpecDecodingStats -> SpecDecodingProm -> get_metrics_snapshot) -> tracker -> guard."""
    from vllm.config import SpeculativeConfig
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics
    from vllm.v1.metrics.reader import get_metrics_snapshot
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    k = 2
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=4, prompt_lookup_min=2)

    def engine():
        unregister_vllm_metrics()
        return SpecDecodingProm(spec, ["model_name", "engine"], {0: ["m", "0"]})

    def rollout(prom, accepted_pattern, n):
        s = SpecDecodingStats.new(k)
        for i in range(n):
            s.observe_draft(num_draft_tokens=k, num_accepted_tokens=accepted_pattern[i % len(accepted_pattern)])
        prom.observe(s, engine_idx=0)

    tracker, guard = SpecDecodeCounterTracker(), MTPDesyncGuard(num_speculative_tokens=k)
    verl_metrics = []
    try:
        prom = engine()
        tracker.set_baseline(counts_from_vllm_metrics(get_metrics_snapshot()))
        for t in range(6):
            if t == 3:
                prom = engine()  # restart: fresh counters, drafter weights gone
            rollout(prom, [2, 1, 2, 0] if t < 3 else [0], 500)
            m = {"actor/pg_loss": 0.0, ARGMAX_DRAFT_METRIC: 0.8}
            merge_spec_metrics(m, tracker.update(counts_from_vllm_metrics(get_metrics_snapshot())).metrics())
            verl_metrics.append(m)
        outs, rec = run(guard, verl_metrics)
    finally:
        unregister_vllm_metrics()
    assert [m["rollout/spec_counter_reset"] for m in verl_metrics] == [0, 0, 0, 1, 0, 0]
    assert verl_metrics[0]["rollout/spec_accept_rate_pos_0"] == pytest.approx(0.75)
    assert verl_metrics[0]["rollout/spec_accept_length"] == pytest.approx(1 + 5 / 4)
    assert [o["mtp_guard/desync"] for o in outs] == [0, 0, 0, 0, 1, 1]
    desync = of(rec, MTPDesyncWarning)
    assert len(desync) == 1 and "at step 5" in str(desync[0].message)
    assert "went backwards at step(s) [4]" in str(desync[0].message)


# --------------------------------------------------------------------------------------------------
# config


def test_default_draft_cost_is_the_nemotron3_super_arithmetic():
    """c = active parameters read per draft step / per target step (memory-bound decode)."""
    h, v, heads, kv, hd = 4096, 131072, 32, 2, 128
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    moe = h * 512 + 2 * h * 1024 + 22 * (2 * 1024 * 2688) + 2 * h * 5376  # router, latent, 22 experts, shared
    d_inner = 128 * 64
    mamba = h * (2 * d_inner + 2 * 8 * 128 + 128) + d_inner * h
    target = 40 * mamba + 40 * moe + 8 * attn + v * h
    draft = 2 * h * h + attn + moe + v * h  # eh_proj + "*E" + the drafter's LM head
    assert draft / target == pytest.approx(DEFAULT_DRAFT_COST, abs=5e-4)
    assert 2 / 88 + v * h / target == pytest.approx(DEFAULT_DRAFT_COST, abs=5e-3)  # layer-count view


def test_config_from_dict_collects_every_error_with_full_keys():
    cfg = MTPGuardConfig.from_dict({"threshold": 0.3, "action": "FAIL", "draft_cost": 0.1})
    assert (cfg.threshold, cfg.action, cfg.draft_cost, cfg.patience) == (0.3, "fail", 0.1, MTPGuardConfig().patience)
    with pytest.raises(MTPConfigError) as exc:
        MTPGuardConfig.from_dict({"threshold": 2, "patience": 0, "action": "explode", "bogus": 1, "draft_cost": True})
    msg = str(exc.value)
    for key in ("threshold=2", "patience=0", "action='explode'", "bogus: unknown key", "draft_cost=True"):
        assert f"{GUARD_CONFIG_PATH}.{key}" in msg, key
    assert "['warn', 'fail', 'off']" in msg
    with pytest.raises(MTPConfigError, match="zero_patience"):
        MTPGuardConfig(zero_patience=0)


@pytest.mark.vllm
def test_vllm_keys_named_in_messages_exist_in_vllm():
    """engine_kwargs.vllm.* keys the messages name are vLLM 0.31.0 engine arguments; greedy is the
    default draft method (which is why the auto estimate is the argmax-draft one)."""
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    engine_args = {f.name for f in dataclasses.fields(EngineArgs)}
    for key in ("worker_extension_cls", "mamba_cache_mode", "hf_overrides", "enable_prefix_caching",
                "speculative_config", "per_request_spec_decode_metrics", "disable_log_stats"):
        assert key in engine_args, key
    assert SpeculativeConfig.__dataclass_fields__["draft_sample_method"].default == "greedy"


def _compose_with_guard(*guard_overrides):
    """verl's own ppo_trainer composed with model_engine=megatron (real schema and defaults), MTP speculation k=2
    and the guard block's ``+verl_mtp_plugin.mtp_guard.<key>=<value>`` overrides."""
    from verl_mtp_plugin.trainer.config import compose_ppo_trainer

    return compose_ppo_trainer(
        [
            "model_engine=megatron",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.model.mtp.enable=true",
            "actor_rollout_ref.model.mtp.enable_rollout=true",
            "actor_rollout_ref.model.mtp.num_speculative_tokens=2",
            *(f"+{GUARD_CONFIG_PATH}.{o}" for o in guard_overrides),
        ]
    )


@pytest.fixture(scope="module")
def verl_base():
    return _compose_with_guard("threshold=0.3", "action=fail")


def test_config_from_the_real_verl_config_and_why_not_under_rollout(verl_base, caplog):
    from omegaconf import OmegaConf, open_dict

    from verl.utils.config import omega_conf_to_dataclass

    # the keys the guard's message names exist in verl 0.9.1's composed config
    for key in ("free_cache_engine", "enable_prefix_caching", "load_format", "temperature", "disable_log_stats"):
        assert OmegaConf.select(verl_base, f"actor_rollout_ref.rollout.{key}") is not None, key
    for key in ("enable_train", "enable_rollout"):
        assert OmegaConf.select(verl_base, f"actor_rollout_ref.model.mtp.{key}") is not None, key

    from verl.workers.config import RolloutConfig

    assert "enable_sleep_mode" in {f.name for f in dataclasses.fields(RolloutConfig)}  # a field, not in the YAML

    with caplog.at_level(logging.WARNING, logger="verl_mtp_plugin.rollout.monitor.desync_guard"):
        guard = guard_from_verl_config(verl_base)  # verl's default disable_log_stats=true
    assert "actor_rollout_ref.rollout.disable_log_stats=true" in caplog.text
    assert (guard.config.threshold, guard.config.action, guard.num_speculative_tokens) == (0.3, "fail", 2)
    assert guard.speculation and guard.draft_sample_method == "greedy"
    # the top-level block leaves verl's own rollout config intact
    assert type(omega_conf_to_dataclass(verl_base.actor_rollout_ref.rollout)).__name__ == "RolloutConfig"

    # engine_kwargs' speculative_config wins (verl's build_mtp_speculative_config); speculation off
    cfg = copy.deepcopy(verl_base)
    with open_dict(cfg):
        cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config = {
            "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic",
        }
    guard = guard_from_verl_config(cfg)
    assert guard.num_speculative_tokens == 3 and guard.draft_sample_method == "probabilistic"
    cfg = copy.deepcopy(verl_base)
    cfg.actor_rollout_ref.rollout.disable_log_stats = False
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="verl_mtp_plugin.rollout.monitor.desync_guard"):
        guard_from_verl_config(cfg)
    assert "disable_log_stats" not in caplog.text
    cfg.actor_rollout_ref.model.mtp.enable_rollout = False
    assert not guard_from_verl_config(cfg).speculation

    # under actor_rollout_ref.rollout the block breaks verl itself: refused with the right key path
    cfg = copy.deepcopy(verl_base)
    with open_dict(cfg):
        cfg.actor_rollout_ref.rollout.mtp_guard = {"threshold": 0.3}
    with pytest.raises(Exception, match="unexpected keyword argument 'mtp_guard'"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    with pytest.raises(MTPConfigError, match=f"move the block to {GUARD_CONFIG_PATH}"):
        guard_from_verl_config(cfg)

    # an invalid block names its full keys
    cfg = copy.deepcopy(verl_base)
    cfg.verl_mtp_plugin.mtp_guard.threshold = 0
    with pytest.raises(MTPConfigError, match=f"{GUARD_CONFIG_PATH}.threshold=0"):
        guard_from_verl_config(cfg)


def test_batch_per_engine_and_verify_cost_from_the_real_verl_config(verl_base):
    """The guard reads c_k at the rollout's batch per vLLM engine; a verify_cost table from Hydra's command line."""
    from omegaconf import open_dict

    cfg = copy.deepcopy(verl_base)
    cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n = 64, 8
    cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes = 8, 1
    cfg.actor_rollout_ref.rollout.tensor_model_parallel_size = 2
    cfg.actor_rollout_ref.rollout.max_num_seqs = 256
    assert engine_batch_size(cfg) == 128  # 64 x 8 sequences over 8 / 2 = 4 engines
    cfg.actor_rollout_ref.rollout.nnodes, cfg.actor_rollout_ref.rollout.n_gpus_per_node = 2, 8
    assert engine_batch_size(cfg) == 64  # standalone rollout servers: their 2 x 8 / 2 = 8 engines
    cfg.actor_rollout_ref.rollout.nnodes = 0
    assert guard_from_verl_config(cfg).verify_cost(2) == pytest.approx(1.325 + (128 - 64) / (256 - 64) * (1.639 - 1.325))
    cfg.actor_rollout_ref.rollout.max_num_seqs = 96
    assert engine_batch_size(cfg) == 96  # vLLM runs at most max_num_seqs at once
    with open_dict(cfg):
        cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs = 48  # engine_kwargs win (verl spreads them)
    assert engine_batch_size(cfg) == 48

    cfg = _compose_with_guard("verify_cost=[[64,[1.2,1.3]],[256,[1.3,1.7]]]")
    guard = guard_from_verl_config(cfg)
    assert guard.config.verify_cost == ((64, (1.2, 1.3)), (256, (1.3, 1.7)))
    assert guard.verify_cost(2) == pytest.approx(verify_step_cost(guard.config.verify_cost, 2, engine_batch_size(cfg)))
    cfg.verl_mtp_plugin.mtp_guard.verify_cost = [1.3, 1.2]
    with pytest.raises(MTPConfigError, match=f"{GUARD_CONFIG_PATH}.verify_cost: costs"):
        guard_from_verl_config(cfg)
