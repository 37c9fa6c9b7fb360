"""Rollout speculative-decoding metrics (verl_mtp_plugin.rollout.monitor.spec_metrics) on vLLM 0.31.0's real objects.

Real objects used (all CPU-buildable): ``vllm.config.SpeculativeConfig`` (method ``ngram``: the MTP
method needs a target model config, and vLLM's counters read only ``num_speculative_tokens``),
``vllm.v1.spec_decode.metrics.SpecDecodingStats`` (per scheduler step) fed through the real
``SpecDecodingProm`` into real Prometheus counters, read back with ``vllm.v1.metrics.reader.get_metrics_snapshot``,
``prometheus_client.generate_latest`` / ``start_http_server`` (the ``/metrics`` path), directly built
``vllm.v1.metrics.reader.Counter`` / ``Vector``, ``vllm.v1.metrics.stats.RequestSpecDecodeMetrics`` and
``vllm.outputs.CompletionOutput`` (per-request path), vLLM's ``SpecDecodingLogging`` (its own
acceptance arithmetic) and verl 0.9.1's ``compute_spec_decode_metrics`` (the names' semantics).
"""

import random
import subprocess
import sys

import pytest

from verl_mtp_plugin.rollout.monitor.spec_metrics import (
    ACCEPT_LENGTH_KEY,
    ACCEPT_RATE_KEY,
    ACCEPT_RATE_POS_KEY,
    COUNTER_RESET_KEY,
    NUM_ACCEPTED_KEY,
    NUM_DRAFTS_KEY,
    NUM_DRAFT_TOKENS_KEY,
    SpecDecodeCounterTracker,
    SpecDecodeCounts,
    counts_from_prometheus_text,
    counts_from_vllm_metrics,
    merge_spec_metrics,
    per_position_rates,
    scrape_spec_counters,
    spec_metrics_from_counts,
    spec_metrics_from_requests,
    total_counts,
    verl_spec_fields,
)

K = 3  # num_speculative_tokens
ENGINE0 = (("engine", "0"), ("model_name", "m"))
ENGINE1 = (("engine", "1"), ("model_name", "m"))


# --------------------------------------------------------------------------------------------------
# fixtures / helpers


@pytest.fixture(scope="module")
def spec_config():
    from vllm.config import SpeculativeConfig

    return SpeculativeConfig(method="ngram", num_speculative_tokens=K, prompt_lookup_max=4, prompt_lookup_min=2)


def _new_prom(spec_config):
    """A fresh vLLM SpecDecodingProm for two engines (what a new front-end process registers)."""
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    unregister_vllm_metrics()
    return SpecDecodingProm(spec_config, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})


@pytest.fixture
def prom(spec_config):
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    p = _new_prom(spec_config)
    yield p
    unregister_vllm_metrics()


def _drafts(rng, n, k=K, p_accept=0.7):
    """n verify steps as (num_draft_tokens, num_accepted_tokens): accepted drafts form a prefix."""
    out = []
    for _ in range(n):
        d = k if rng.random() < 0.85 else rng.randint(1, k)
        a = 0
        while a < d and rng.random() < p_accept:
            a += 1
        out.append((d, a))
    return out


def _scheduler_steps(rng, n_steps, per_step, p_accept=0.7):
    """vLLM SpecDecodingStats, one per scheduler step."""
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    steps = []
    for _ in range(n_steps):
        s = SpecDecodingStats.new(K)
        for d, a in _drafts(rng, per_step, p_accept=p_accept):
            s.observe_draft(num_draft_tokens=d, num_accepted_tokens=a)
        steps.append(s)
    return steps


def _snapshot():
    from vllm.v1.metrics.reader import get_metrics_snapshot

    return counts_from_vllm_metrics(get_metrics_snapshot())


def _vllm_logged(stats_list):
    """vLLM's own numbers for these scheduler steps (SpecDecodingLogging.log's arguments)."""
    from vllm.v1.spec_decode.metrics import SpecDecodingLogging

    lg = SpecDecodingLogging()
    for s in stats_list:
        lg.observe(s)
    captured = {}

    def log_fn(fmt, *args):
        captured["args"] = args

    lg.log(log_fn=log_fn)
    mean_len, _acc_tp, _draft_tp, accepted, drafted, rates_str, rate_pct = captured["args"]
    return {
        "mean_acceptance_length": float(mean_len),
        "accepted": int(accepted),
        "drafted": int(drafted),
        "per_pos": rates_str,
        "rate": float(rate_pct) / 100.0,
    }


# --------------------------------------------------------------------------------------------------
# counters: vLLM's reader, /metrics text, HTTP


@pytest.mark.vllm
def test_snapshot_counts_equal_the_observed_scheduler_stats(prom):
    rng = random.Random(0)
    e0, e1 = _scheduler_steps(rng, 4, 25), _scheduler_steps(rng, 3, 10, p_accept=0.3)
    for s in e0:
        prom.observe(s, engine_idx=0)
    for s in e1:
        prom.observe(s, engine_idx=1)
    snap = _snapshot()
    assert set(snap) == {ENGINE0, ENGINE1}
    assert snap[ENGINE0] == total_counts(SpecDecodeCounts.from_stats(s) for s in e0)
    assert snap[ENGINE1] == total_counts(SpecDecodeCounts.from_stats(s) for s in e1)
    assert len(snap[ENGINE0].accepted_per_pos) == K


@pytest.mark.vllm
def test_step_deltas_and_metrics_match_vllm_own_arithmetic(prom):
    rng = random.Random(1)
    tracker = SpecDecodeCounterTracker()
    step1 = _scheduler_steps(rng, 3, 30)
    for i, s in enumerate(step1):
        prom.observe(s, engine_idx=i % 2)
    first = tracker.update(_snapshot())
    assert first.counts == total_counts(SpecDecodeCounts.from_stats(s) for s in step1)
    assert set(first.new_series) == {ENGINE0, ENGINE1} and not first.reset

    step2 = _scheduler_steps(rng, 5, 20, p_accept=0.5)
    for i, s in enumerate(step2):
        prom.observe(s, engine_idx=i % 2)
    second = tracker.update(_snapshot())
    assert not second.reset and second.new_series == ()
    # the delta is step 2 only, not the cumulative value
    assert second.counts == total_counts(SpecDecodeCounts.from_stats(s) for s in step2)

    m = second.metrics()
    ref = _vllm_logged(step2)
    assert m[NUM_ACCEPTED_KEY] == ref["accepted"] and m[NUM_DRAFT_TOKENS_KEY] == ref["drafted"]
    assert m[ACCEPT_RATE_KEY] == pytest.approx(ref["rate"], rel=1e-12)
    assert m[ACCEPT_LENGTH_KEY] == pytest.approx(ref["mean_acceptance_length"], rel=1e-12)
    ours = ", ".join(f"{m[ACCEPT_RATE_POS_KEY.format(k=k)]:.3f}" for k in range(K))
    assert ours == ref["per_pos"]
    assert ACCEPT_RATE_POS_KEY.format(k=K) not in m
    assert m[COUNTER_RESET_KEY] == 0.0


@pytest.mark.vllm
def test_prometheus_text_and_http_scrape_match_the_snapshot(prom, caplog):
    from prometheus_client import REGISTRY, generate_latest, start_http_server

    rng = random.Random(2)
    for i, s in enumerate(_scheduler_steps(rng, 4, 15)):
        prom.observe(s, engine_idx=i % 2)
    snap = _snapshot()
    assert counts_from_prometheus_text(generate_latest(REGISTRY).decode()) == snap

    server, thread = start_http_server(0, addr="127.0.0.1", registry=REGISTRY)
    addr = f"127.0.0.1:{server.server_port}"
    try:
        scraped = scrape_spec_counters([addr])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    assert scraped == {(("server", addr),) + key: c for key, c in snap.items()}

    # the server is gone: skipped with a warning by default, an error with strict=True
    with caplog.at_level("WARNING", logger="verl_mtp_plugin.rollout.monitor.spec_metrics"):
        assert scrape_spec_counters([addr], timeout=2.0) == {}
    assert addr in caplog.text
    with pytest.raises(RuntimeError, match=addr):
        scrape_spec_counters([addr], timeout=2.0, strict=True)


@pytest.mark.vllm
def test_no_log_stats_means_no_series():
    """Without vLLM's stat loggers (verl's default disable_log_stats=true) nothing is registered."""
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    unregister_vllm_metrics()
    assert _snapshot() == {}
    step = SpecDecodeCounterTracker().update({})
    m = step.metrics()
    assert m[NUM_DRAFTS_KEY] == 0.0 and ACCEPT_RATE_KEY not in m and ACCEPT_LENGTH_KEY not in m


# --------------------------------------------------------------------------------------------------
# counter resets


@pytest.mark.vllm
def test_engine_restart_resets_counters_and_is_flagged(prom, spec_config):
    rng = random.Random(3)
    tracker = SpecDecodeCounterTracker()
    for s in _scheduler_steps(rng, 6, 40):
        prom.observe(s, engine_idx=0)
    tracker.update(_snapshot())

    # engine restart: a new front end registers fresh counters (all zero), then serves a small step
    prom2 = _new_prom(spec_config)
    small = _scheduler_steps(rng, 1, 5, p_accept=0.0)  # acceptance collapsed after the restart
    prom2.observe(small[0], engine_idx=0)
    step = tracker.update(_snapshot())
    assert step.reset and ENGINE0 in step.reset_series
    assert step.counts == SpecDecodeCounts.from_stats(small[0])  # the new value is the delta
    m = step.metrics()
    assert m[COUNTER_RESET_KEY] == 1.0 and m[ACCEPT_RATE_KEY] == 0.0

    # the next step is an ordinary delta again
    nxt = _scheduler_steps(rng, 2, 10)
    for s in nxt:
        prom2.observe(s, engine_idx=0)
    step = tracker.update(_snapshot())
    assert not step.reset
    assert step.counts == total_counts(SpecDecodeCounts.from_stats(s) for s in nxt)


@pytest.mark.vllm
def test_partial_reset_with_reader_objects_built_directly():
    from vllm.v1.metrics.reader import Counter, Gauge, Vector

    def snap(e0, e1):
        out = [Gauge(name="vllm:num_requests_running", labels={"model_name": "m", "engine": "0"}, value=3.0)]
        for labels, (n, d, a, pos) in ((dict(ENGINE0), e0), (dict(ENGINE1), e1)):
            out += [
                Counter(name="vllm:spec_decode_num_drafts", labels=labels, value=n),
                Counter(name="vllm:spec_decode_num_draft_tokens", labels=labels, value=d),
                Counter(name="vllm:spec_decode_num_accepted_tokens", labels=labels, value=a),
                Vector(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels=labels, values=list(pos)),
            ]
        return counts_from_vllm_metrics(out)

    tracker = SpecDecodeCounterTracker()
    tracker.set_baseline(snap((100, 300, 150, [80, 50, 20]), (40, 120, 60, [30, 20, 10])))
    # engine 0 restarted (its counters are below the last snapshot), engine 1 kept counting
    step = tracker.update(snap((10, 30, 5, [4, 1, 0]), (50, 150, 70, [35, 24, 11])))
    assert step.reset and step.reset_series == (ENGINE0,)
    assert step.counts == SpecDecodeCounts(10 + 10, 30 + 30, 5 + 10, (4 + 5, 1 + 4, 0 + 1))

    # a per-position counter going backwards alone is a reset too
    tracker.set_baseline(snap((10, 30, 5, [4, 1, 0]), (50, 150, 70, [35, 24, 11])))
    step = tracker.update(snap((10, 30, 5, [4, 1, 0]), (50, 150, 70, [35, 23, 11])))
    assert step.reset_series == (ENGINE1,)


@pytest.mark.vllm
def test_an_unreadable_server_does_not_count_its_history_when_it_is_back(prom, caplog):
    """One failed /metrics read must not turn that replica's whole cumulative counter into a step."""
    from prometheus_client import REGISTRY, start_http_server

    rng = random.Random(5)
    for s in _scheduler_steps(rng, 3, 20):
        prom.observe(s, engine_idx=0)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=REGISTRY)
    addr, dead = f"127.0.0.1:{server.server_port}", "127.0.0.1:9"
    try:
        tracker = SpecDecodeCounterTracker()
        tracker.set_baseline(scrape_spec_counters([addr]))
        step1 = _scheduler_steps(rng, 2, 20)
        for s in step1:
            prom.observe(s, engine_idx=0)
        # this step the replica cannot be read (the address list is wrong for a moment)
        assert tracker.update(scrape_spec_counters([dead], timeout=2.0)).counts == SpecDecodeCounts()
        step2 = _scheduler_steps(rng, 2, 20)
        for s in step2:
            prom.observe(s, engine_idx=0)
        got = tracker.update(scrape_spec_counters([addr])).counts
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    want = total_counts(SpecDecodeCounts.from_stats(s) for s in step1 + step2)
    assert got == want  # the steps it missed, not its whole history


# --------------------------------------------------------------------------------------------------
# per-position aggregation and verl's semantics


def _requests(rng, n):
    """n vLLM RequestSpecDecodeMetrics (summary level), one with no verify step at all."""
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    reqs = []
    for i in range(n):
        m = RequestSpecDecodeMetrics.new(K)
        if i != 0:  # request 0 finished before any draft (e.g. one-token answer)
            for d, a in _drafts(rng, rng.randint(1, 40), p_accept=rng.uniform(0.1, 0.9)):
                m.observe(num_draft_tokens=d, num_accepted=a)
        reqs.append(m)
    return reqs


@pytest.mark.vllm
def test_per_request_path_matches_verl_compute_spec_decode_metrics():
    from verl.trainer.ppo.ray_trainer import compute_spec_decode_metrics
    from vllm.outputs import CompletionOutput

    rng = random.Random(4)
    reqs = _requests(rng, 12)
    # half of them as the CompletionOutput verl's server gets from vLLM 0.31.0
    outputs = [
        CompletionOutput(
            index=0, text="", token_ids=[1], cumulative_logprob=None, logprobs=None, spec_decode_metrics=r
        )
        if i % 2
        else r
        for i, r in enumerate(reqs)
    ]
    fields = [verl_spec_fields(o) for o in outputs]
    verl_m = compute_spec_decode_metrics(
        [f["spec_num_draft_tokens"] for f in fields],
        [f["spec_num_accepted_tokens"] for f in fields],
        [f["spec_num_verify_steps"] for f in fields],
    )
    ours = spec_metrics_from_requests(outputs)
    assert ours[ACCEPT_RATE_KEY] == pytest.approx(verl_m["rollout/spec_accept_rate"], rel=1e-12)
    assert ours[ACCEPT_LENGTH_KEY] == pytest.approx(verl_m["rollout/spec_accept_length"], rel=1e-12)

    # each request's counts agree with vLLM's own per-request summary
    for r in reqs[1:]:
        d = r.to_dict()
        c = SpecDecodeCounts.from_request(r)
        assert c.num_drafts == d["num_spec_steps"] and c.num_accepted_tokens == d["num_accepted_draft_tokens"]
        assert c.accept_rate == pytest.approx(d["draft_acceptance_rate"]) and c.accept_length == pytest.approx(
            d["mean_acceptance_length"]
        )


@pytest.mark.vllm
def test_counter_totals_match_verl_on_the_step_totals_and_differ_from_request_mean():
    from verl.trainer.ppo.ray_trainer import compute_spec_decode_metrics

    rng = random.Random(5)
    reqs = [SpecDecodeCounts.from_request(r) for r in _requests(rng, 10)]
    step = total_counts(reqs)  # what the counters' delta is for the same step
    ours = spec_metrics_from_counts(step)
    verl_one = compute_spec_decode_metrics([step.num_draft_tokens], [step.num_accepted_tokens], [step.num_drafts])
    assert ours[ACCEPT_RATE_KEY] == pytest.approx(verl_one["rollout/spec_accept_rate"], rel=1e-12)
    assert ours[ACCEPT_LENGTH_KEY] == pytest.approx(verl_one["rollout/spec_accept_length"], rel=1e-12)
    # verl's per-request mean weighs requests equally: a different number on the same data
    per_request = spec_metrics_from_requests(reqs)
    assert per_request[ACCEPT_LENGTH_KEY] != pytest.approx(ours[ACCEPT_LENGTH_KEY], rel=1e-6)
    # ... while the per-position rates and counts are the same token-weighted sums
    for k in range(K):
        key = ACCEPT_RATE_POS_KEY.format(k=k)
        assert per_request[key] == pytest.approx(ours[key], rel=1e-12)
    assert per_request[NUM_ACCEPTED_KEY] == ours[NUM_ACCEPTED_KEY]


@pytest.mark.vllm
def test_per_position_aggregation_agrees_across_vllm_paths():
    """Same drafts through the scheduler's SpecDecodingStats and through per-request histograms."""
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    rng = random.Random(6)
    stats = SpecDecodingStats.new(K)
    per_request = []
    for _ in range(20):
        r = RequestSpecDecodeMetrics.new(K)
        for d, a in _drafts(rng, rng.randint(1, 15)):
            stats.observe_draft(num_draft_tokens=d, num_accepted_tokens=a)
            r.observe(num_draft_tokens=d, num_accepted=a)
        per_request.append(SpecDecodeCounts.from_request(r))
    from_stats = SpecDecodeCounts.from_stats(stats)
    assert total_counts(per_request) == from_stats

    # vLLM's per-step stats say how many verify steps drafted each position (these drafts vary in length):
    # the per-position rate counts only those; the counters' totals alone give vLLM's unconditional rate
    drafted = from_stats.drafted_per_pos
    assert len(drafted) == K and sum(drafted) == from_stats.num_draft_tokens and drafted[0] == from_stats.num_drafts
    rates = per_position_rates(from_stats)
    assert rates == pytest.approx([a / d for a, d in zip(from_stats.accepted_per_pos, drafted)], rel=1e-12)
    assert sum(from_stats.accepted_per_pos) == from_stats.num_accepted_tokens
    n = from_stats.num_drafts
    assert 1.0 + sum(r * d / n for r, d in zip(rates, drafted)) == pytest.approx(from_stats.accept_length, rel=1e-12)
    totals_only = SpecDecodeCounts(n, from_stats.num_draft_tokens, from_stats.num_accepted_tokens,
                                   from_stats.accepted_per_pos)
    unconditional = per_position_rates(totals_only)
    assert all(a >= b for a, b in zip(unconditional, unconditional[1:]))  # accepted drafts are a prefix
    assert 1.0 + sum(unconditional) == pytest.approx(from_stats.accept_length, rel=1e-12)


@pytest.mark.vllm
def test_missing_or_mixed_per_request_stats():
    from vllm.outputs import CompletionOutput
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    off = CompletionOutput(index=0, text="", token_ids=[1], cumulative_logprob=None, logprobs=None)
    assert verl_spec_fields(off) == {} and spec_metrics_from_requests([off, off]) == {}
    on = RequestSpecDecodeMetrics.new(K)
    on.observe(num_draft_tokens=K, num_accepted=1)
    with pytest.raises(ValueError, match="1 of 2 requests"):
        spec_metrics_from_requests([on, off])
    # verl extra_fields dicts are accepted as they are (no per-position data)
    m = spec_metrics_from_requests([verl_spec_fields(on)])
    assert m[ACCEPT_RATE_KEY] == pytest.approx(1 / K) and ACCEPT_RATE_POS_KEY.format(k=0) not in m


# --------------------------------------------------------------------------------------------------
# metric dict plumbing


def test_no_drafts_gives_no_rates_and_merge_keeps_verl_values():
    m = spec_metrics_from_counts(SpecDecodeCounts(), reset=False)
    assert m == {NUM_DRAFTS_KEY: 0.0, NUM_DRAFT_TOKENS_KEY: 0.0, NUM_ACCEPTED_KEY: 0.0, COUNTER_RESET_KEY: 0.0}

    ours = spec_metrics_from_counts(SpecDecodeCounts(10, 20, 12, (7, 5)))
    verl_metrics = {"rollout/spec_accept_rate": 0.42, "actor/pg_loss": 1.0}
    added = merge_spec_metrics(verl_metrics, ours)
    assert verl_metrics["rollout/spec_accept_rate"] == 0.42  # verl's own value wins
    assert ACCEPT_RATE_KEY not in added and verl_metrics[ACCEPT_LENGTH_KEY] == pytest.approx(1.0 + 12 / 10)
    assert verl_metrics[ACCEPT_RATE_POS_KEY.format(k=1)] == pytest.approx(0.5)


def test_bad_counts_are_rejected():
    with pytest.raises(ValueError, match="num_drafts"):
        SpecDecodeCounts(num_drafts=-1)
    with pytest.raises(ValueError, match=r"accepted_per_pos\[1\]"):
        SpecDecodeCounts(1, 1, 1, (1, 0.5))


def test_modules_import_without_heavy_dependencies():
    heavy = ("torch", "vllm", "verl", "megatron", "prometheus_client", "omegaconf")
    code = (
        "import sys, verl_mtp_plugin.rollout.monitor.spec_metrics, verl_mtp_plugin.rollout.monitor.desync_guard, verl_mtp_plugin.rollout.monitor.spec_monitor;"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
