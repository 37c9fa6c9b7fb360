"""The plugin's verl engine on real verl 0.9.1 + real megatron-core (tiny CPU HybridModel).

How a pass runs here: verl's ``MegatronEngine.forward_backward_batch`` hands the micro-batches to
megatron's ``forward_backward_no_pipelining``, which allocates its token counter with
``device="cuda"`` (megatron/core/pipeline_parallel/schedules.py:749) and so cannot run on CPU.
:func:`run_pass` therefore performs the same steps as verl's ``forward_backward_batch`` (verl's own
``prepare_micro_batches`` / ``postprocess_batch_func``) and, per micro-batch, megatron's own
``schedules.forward_step`` / ``schedules.backward_step`` (the loop body of
``forward_backward_no_pipelining``) with the engine's real ``forward_step``, verl's real
``postprocess_micro_batch_func`` and verl's real ``ppo_loss``, inside the engine's
``mtp_pass`` / ``add_mtp_metrics`` (exactly what the engine's ``forward_backward_batch`` wraps around
verl's). Batches are verl's ``left_right_2_no_padding`` layout. Packed (THD) passes
(``use_remove_padding=true``, ``pad_to_length=true`` with a bucket) run on the Nemotron-shaped model ("M*-E/*E":
Mamba, attention, MoE, MTP "*E") with the CPU runtime's THD attention and Mamba ``seq_idx`` stand-ins and must match
the padded (BSHD) pass; ``test_thd_hybrid.py`` compares a packed micro-batch with each sample alone.
"""

import contextlib
import importlib
import importlib.util
from functools import partial

import pytest
import torch

from verl_mtp_plugin.policy import MTPConfigError, MTPMode, Phase
from verl_mtp_plugin.config_keys import MODEL_TYPE

# prompt/response lengths of the 4 samples (P=6 prompt slots, R=8 response slots); sample 0 has two
# tool-output tokens (response positions 3 and 4) masked out of the response mask. Sample 3's prompt
# has 2 tokens: its first response token (token 2) is the depth-1 target of position 0, which only a
# token-coordinate mask counts.
PROMPT_LENS = [6, 4, 5, 2]
RESP_LENS = [8, 5, 7, 2]
P, R = 6, 8
N_RESPONSE_TARGETS = sum(RESP_LENS) - 2  # 20 response tokens count for MTP


@pytest.fixture(scope="module", autouse=True)
def _verl_device():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERL_ENGINE_DEVICE", "cuda")
        mp.setenv("VERL_ENGINE_VENDOR", "nvidia")
        yield


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from verl_mtp_cpu.vllm_drafter import write_hf_config_dir

    return write_hf_config_dir(tmp_path_factory.mktemp("nemotron_h_tiny"))


@pytest.fixture(scope="module")
def registered():
    from verl_mtp_plugin.engine.registry import register

    register()
    return True


@pytest.fixture(scope="module")
def ppo_loss_fn():
    """verl's ppo_loss bound to a McoreActorConfig built from verl's own composed config."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    from verl_mtp_plugin.trainer.config import compose_ppo_trainer

    cfg = compose_ppo_trainer(
        [
            "model_engine=megatron",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        ]
    )
    return partial(ppo_loss, config=omega_conf_to_dataclass(cfg.actor_rollout_ref.actor))


#: verl's pad_to_length_bucket for the packed passes: the two micro-batches (23 and 16 tokens) pack to 32 and 16 rows
BUCKET = 16


def new_engine(hf_dir, *, enable=True, enable_train=True, detach=True, forward_only=False, packed=False, objective=None):
    from verl.workers.config import MtpConfig

    from verl_mtp_plugin.config_keys import OBJECTIVE_ENV

    mtp = MtpConfig(enable=enable, enable_train=enable_train, detach_encoder=detach)
    with pytest.MonkeyPatch.context() as mp:  # the engine reads the objective from its worker's environment
        if objective is None:
            mp.delenv(OBJECTIVE_ENV, raising=False)
        else:
            mp.setenv(OBJECTIVE_ENV, objective)
        return _new_engine(hf_dir, mtp, forward_only=forward_only, packed=packed)


def _new_engine(hf_dir, mtp, *, forward_only, packed):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig
    from verl.workers.engine import EngineRegistry

    model_config = HFModelConfig(path=hf_dir, load_tokenizer=False, mtp=mtp)
    engine_config = McoreEngineConfig(use_remove_padding=packed, use_dynamic_bsz=False, forward_only=forward_only,
                                      pad_to_length=packed, pad_to_length_bucket=BUCKET)
    return EngineRegistry.new(
        model_type=MODEL_TYPE,
        backend="megatron",
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=None,
        checkpoint_config=CheckpointConfig(),
    )


def tiny_ddp(seed=7, *, detach=False, hook_mode=None, pattern="M*-E/*E"):
    """Tiny HybridModel ("M*-E/*E", MTP depth 1) wrapped in megatron's real DDP (optionally after the
    plugin's pre-wrap hook, as Megatron-Bridge would run it)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from verl_mtp_plugin.testing import build_tiny_hybrid
    from verl_mtp_plugin.engine.megatron import make_mtp_pre_wrap_hook

    torch.manual_seed(seed)
    model = build_tiny_hybrid(mtp_detach_heads=detach, pattern=pattern)
    if hook_mode is not None:
        make_mtp_pre_wrap_hook(hook_mode)([model])
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=False, grad_reduce_in_fp32=True)
    return DistributedDataParallel(model.config, ddp_config, model)


def attach(engine, ddp):
    engine.module = [ddp]
    engine.tf_config = ddp.module.config
    return engine


def verl_batch(seed=0):
    """A GRPO-style batch as verl's trainer hands it to the engine (left-right padded ->
    left_right_2_no_padding) with the non-tensor keys TrainingWorker adds."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    b = len(PROMPT_LENS)
    prompts = torch.zeros(b, P, dtype=torch.long)
    responses = torch.zeros(b, R, dtype=torch.long)
    attention = torch.zeros(b, P + R, dtype=torch.long)
    response_mask = torch.zeros(b, R)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESP_LENS)):
        prompts[i, P - p :] = torch.randint(1, 128, (p,), generator=g)
        responses[i, :r] = torch.randint(1, 128, (r,), generator=g)
        attention[i, P - p : P + r] = 1
        response_mask[i, :r] = 1
    response_mask[0, 3:5] = 0  # tool output inside sample 0's response
    td = TensorDict(
        dict(
            input_ids=torch.cat([prompts, responses], 1),
            attention_mask=attention,
            position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
            response_mask=response_mask,
            prompts=prompts,
            responses=responses,
            old_log_probs=torch.zeros(b, R),
            advantages=torch.randn(b, R, generator=g),
        ),
        batch_size=[b],
    )
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(
        td, temperature=1.0, calculate_entropy=True, global_batch_size=b, use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
    )
    return td


def tracker_snapshot():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    return {k: v.clone() for k, v in MTPLossLoggingHelper.tracker.items() if isinstance(v, torch.Tensor)}


def run_pass(engine, loss_fn, *, forward_only, data=None):
    """verl's forward_backward_batch on CPU (see module docstring). Returns (output, tracker before the
    engine collects its metrics, phase)."""
    from megatron.core.pipeline_parallel import schedules
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

    data = verl_batch() if data is None else data
    tu.assign_non_tensor(data, sp_size=1, batch_num_tokens=int(data["loss_mask"].sum()), dp_size=1)
    micro_batches, indices = prepare_micro_batches(data=data, dp_group=engine.get_data_parallel_group())
    n = len(micro_batches)
    for mb in micro_batches:
        tu.assign_non_tensor(mb, num_micro_batch=n, record_r2_routes=False)
    tu.assign_non_tensor(data, num_micro_batch=n)
    post = partial(engine.postprocess_micro_batch_func, forward_only=forward_only, loss_function=loss_fn)
    step = partial(engine.forward_step, logits_processor_func=loss_fn, postprocess_micro_batch_func=post)
    model = engine.module[0]
    config = model.module.config
    store, batches = [], iter(micro_batches)
    with engine.mtp_pass(forward_only, data) as phase:  # as the engine's forward_backward_batch enters it
        with torch.no_grad() if forward_only else contextlib.nullcontext():  # verl's infer_batch: no_grad
            for i in range(n):
                out, _ = schedules.forward_step(
                    step, batches, model, n, None, store, config, 1, is_first_microbatch=i == 0, current_microbatch=i
                )
                if not forward_only:
                    schedules.backward_step(None, out, None, config)
        output = postprocess_batch_func(output_lst=store, indices=indices, data=data)
        before = tracker_snapshot()
        engine.add_mtp_metrics(output, data, phase)
    return output, before, phase


def grads(ddp):
    return {n: p.main_grad.clone() for n, p in ddp.module.named_parameters() if hasattr(p, "main_grad")}


def mtp_calls(ddp):
    """Count MTP block forwards (a torch forward hook on this test's own model instance)."""
    calls = []
    ddp.module.mtp.register_forward_hook(lambda *a: calls.append(1))
    return calls


# ---------------------------------------------------------------------------------------------- registry


def test_verl_registry_returns_the_plugin_engine_and_register_is_idempotent(megatron_env, hf_dir, registered):
    import verl_mtp_plugin
    import verl_mtp_plugin.engine.registry as reg
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from verl_mtp_plugin.engine.megatron import NemotronHMTPMegatronEngine

    assert reg.register() is False  # already registered: verl's duplicate-key assertion never fires
    importlib.reload(reg)  # importing the module again (e.g. a second import path) must not crash
    assert reg.register() is False
    importlib.reload(verl_mtp_plugin)
    assert EngineRegistry.get_engine_cls(MODEL_TYPE, "megatron") is NemotronHMTPMegatronEngine
    assert issubclass(NemotronHMTPMegatronEngine, MegatronEngineWithLMHead)
    # verl's own engine is untouched
    assert EngineRegistry.get_engine_cls("language_model", "megatron") is MegatronEngineWithLMHead
    engine = new_engine(hf_dir)
    assert type(engine) is NemotronHMTPMegatronEngine and engine.mtp_mode is MTPMode.ONLINE


def test_register_refuses_to_shadow_a_foreign_engine(registered, monkeypatch):
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from verl_mtp_plugin.engine.registry import register

    table = EngineRegistry._engines[MODEL_TYPE]["megatron"]
    monkeypatch.setitem(table, "cuda", MegatronEngineWithLMHead)
    with pytest.raises(RuntimeError, match="refusing to shadow"):
        register()


def test_plugin_model_type_on_an_fsdp_backend_fails_naming_the_keys(registered, hf_dir):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    with pytest.raises(MTPConfigError, match=r"actor_rollout_ref\.actor\.strategy='fsdp'.*model_engine=megatron"):
        EngineRegistry.new(
            model_type=MODEL_TYPE,
            backend="fsdp",
            model_config=HFModelConfig(path=hf_dir, load_tokenizer=False),
            engine_config=FSDPEngineConfig(strategy="fsdp"),
            optimizer_config=None,
            checkpoint_config=CheckpointConfig(),
        )


# ---------------------------------------------------------------------------------------------- build


def test_engine_keeps_verls_gptmodel_mtp_paths_off(megatron_env, registered, hf_dir):
    """verl's initialize() applies patch_engine_mtp and forward_backward_batch reads the MTP tracker
    when engine.model_config.mtp.enable; the engine's private view says false, the user's block is kept."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, MtpConfig
    from verl.workers.engine import EngineRegistry

    worker_config = HFModelConfig(path=hf_dir, load_tokenizer=False, mtp=MtpConfig(enable=True, enable_rollout=True))
    engine = EngineRegistry.new(
        model_type=MODEL_TYPE, backend="megatron", model_config=worker_config,
        engine_config=McoreEngineConfig(), optimizer_config=None, checkpoint_config=CheckpointConfig(),
    )
    assert engine.mtp_mode is MTPMode.FROZEN
    assert engine.model_config.mtp.enable is False and engine.model_config.mtp.enable_train is False
    # the worker's HFModelConfig (shared with the rollout side) is not modified; the view shares its HF config
    assert engine.model_config is not worker_config and worker_config.mtp.enable is True
    assert worker_config.mtp.enable_rollout is True
    assert engine.model_config.hf_config is worker_config.hf_config


def test_build_tf_config_shows_verl_the_user_mtp_block_and_writes_mode_overrides(megatron_env, registered, hf_dir):
    """Runs verl's real _build_tf_config through Megatron-Bridge: check_mtp_config must see enable=true
    (else it zeroes the HF MTP layer count and forces mtp_num_layers=None); the plugin's overrides are
    in place before verl builds the provider, reach the finalized provider, and the plugin's pre-wrap
    hook is registered on it."""
    from verl_mtp_cpu.bridge import CPU_PROVIDER_OVERRIDES, install_te_import_placeholder

    install_te_import_placeholder()
    engine = new_engine(hf_dir, enable=True, enable_train=True, detach=True)
    engine.engine_config.override_transformer_config.update(CPU_PROVIDER_OVERRIDES)
    engine._build_tf_config()
    overrides = engine.engine_config.override_transformer_config
    assert overrides["mtp_detach_heads"] is True and overrides["mtp_loss_scaling_factor"] == 0.1
    assert "mtp_num_layers" not in overrides  # verl would have set None had it seen enable=false
    assert engine.model_config.hf_config.num_nextn_predict_layers == 1
    assert engine.model_config.mtp.enable is False  # the engine's private view is restored
    provider = engine.provider
    assert type(provider).__name__ == "HybridModelProvider"
    assert provider.mtp_detach_heads is True and provider.mtp_num_layers == 1
    assert provider.hybrid_layer_pattern == "M*-E/*E"
    hooks = [h for h in provider._pre_wrap_hooks if getattr(h, "mode", None) is not None]  # no public list
    assert [h.mode for h in hooks] == [MTPMode.ONLINE]


def test_build_tf_config_in_mode_off_builds_no_mtp_pattern(megatron_env, registered, hf_dir):
    """Mode off (verl's reference model): the finalized provider has no MTP pattern and no MTP depth,
    although the checkpoint has MTP layers and Megatron-Bridge turns mtp_use_repeated_layer on."""
    from verl_mtp_cpu.bridge import CPU_PROVIDER_OVERRIDES, install_te_import_placeholder

    install_te_import_placeholder()
    engine = new_engine(hf_dir, enable=False, enable_train=False, forward_only=True)
    engine.engine_config.override_transformer_config.update(CPU_PROVIDER_OVERRIDES)
    engine._build_tf_config()
    provider = engine.provider
    assert provider.hybrid_layer_pattern == "M*-E" and not provider.mtp_num_layers
    assert provider.mtp_hybrid_override_pattern is None


def test_frozen_pre_wrap_hook_freezes_mtp_before_ddp(megatron_env, registered, hf_dir, ppo_loss_fn):
    ddp = tiny_ddp(hook_mode="frozen")
    params = dict(ddp.module.named_parameters())
    mtp = [n for n in params if n.startswith("mtp.")]
    assert mtp and all(not params[n].requires_grad for n in mtp)
    # megatron's DDP built no gradient buffer for them (the optimizer sees only params with main_grad)
    assert all(not hasattr(params[n], "main_grad") for n in mtp)
    trunk = [n for n in params if not n.startswith("mtp.")]
    assert all(hasattr(params[n], "main_grad") for n in trunk)
    assert sum(b.numel_unpadded for b in ddp.buffers) == sum(params[n].numel() for n in trunk)

    engine = attach(new_engine(hf_dir, enable=True, enable_train=False), ddp)
    calls = mtp_calls(ddp)
    output, before, phase = run_pass(engine, ppo_loss_fn, forward_only=False)
    assert phase is Phase.TRAIN and not calls  # frozen: the update never runs MTP
    assert not any(k.startswith("mtp_") for k in output["metrics"])
    assert all(float(v.abs().sum()) == 0 for v in before.values())
    assert any(float(g.abs().sum()) > 0 for g in grads(ddp).values())


def test_pre_wrap_hook_validates_each_chunk_for_its_mode(megatron_env):
    from verl_mtp_plugin.testing import build_tiny_hybrid
    from verl_mtp_plugin.engine.megatron import make_mtp_pre_wrap_hook

    online_ok = build_tiny_hybrid(mtp_detach_heads=True)
    assert make_mtp_pre_wrap_hook("online")([online_ok]) == [online_ok]
    assert all(p.requires_grad for _, p in online_ok.named_parameters())
    with pytest.raises(MTPConfigError, match="mtp_detach_heads"):
        make_mtp_pre_wrap_hook("online")([build_tiny_hybrid(mtp_detach_heads=False)])
    with pytest.raises(MTPConfigError, match="no MTP layers"):
        make_mtp_pre_wrap_hook("frozen")([build_tiny_hybrid(pattern="M*-E")])


# ---------------------------------------------------------------------------------------------- phases


def test_online_update_trains_mtp_on_response_tokens_isolated_from_the_trunk(
    megatron_env, registered, hf_dir, ppo_loss_fn
):
    from verl.utils.py_functional import rename_dict


    ddp = tiny_ddp(detach=True)
    calls = mtp_calls(ddp)
    frozen = attach(new_engine(hf_dir, enable=True, enable_train=False), ddp)
    run_pass(frozen, ppo_loss_fn, forward_only=False)
    reference = grads(ddp)  # policy-loss gradients only
    assert not calls

    ddp.zero_grad_buffer()
    online = attach(new_engine(hf_dir, enable=True, enable_train=True, detach=True), ddp)
    seen = []  # what the engine hands the HybridModel (a kwargs pre-hook on this test's model)
    handle = ddp.module.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append((kwargs.get("labels"), kwargs.get("loss_mask"))), with_kwargs=True
    )
    output, before, phase = run_pass(online, ppo_loss_fn, forward_only=False)
    handle.remove()
    assert phase is Phase.TRAIN and len(calls) == 2  # two micro-batches, MTP ran in each
    # labels=None (logits back) and the token-coordinate response mask, micro-batch by micro-batch
    token_rows = [[0.0] * p + [1.0] * r for p, r in zip(PROMPT_LENS, RESP_LENS)]
    token_rows[0][P + 3 : P + 5] = [0.0, 0.0]
    for (labels, mask), rows in zip(seen, (token_rows[:2], token_rows[2:])):
        width = max(len(r) for r in rows)
        assert labels is None
        assert mask.tolist() == [r + [0.0] * (width - len(r)) for r in rows]
    g = grads(ddp)
    mtp_names = [n for n in g if n.startswith("mtp.")]
    assert all(float(g[n].abs().sum()) > 0 for n in mtp_names if "expert_bias" not in n)
    for n in g:
        if not n.startswith("mtp."):
            torch.testing.assert_close(g[n], reference[n], rtol=1e-5, atol=1e-7, msg=n)  # trunk untouched

    # the loss mask: depth 1 counts exactly the response tokens (tool outputs and prompts excluded)
    assert int(before["total_values"].sum()) == N_RESPONSE_TARGETS
    metrics = output["metrics"]
    from verl_mtp_plugin.engine.megatron import ACCEPTANCE_METRICS

    assert set(k for k in metrics if k.startswith("mtp_")) == {
        "mtp_losses/mtp_1_loss", "mtp_accuracy/mtp_1_top1", "mtp_objective/mtp_1_hard_ce", *ACCEPTANCE_METRICS
    }
    assert metrics["mtp_objective/mtp_1_hard_ce"] == metrics["mtp_losses/mtp_1_loss"]  # megatron's own loss
    # the in-trainer acceptance estimate, logged as actor/mtp_expected_accept_rate; every micro-batch probed: the
    # drafted form's positions are the drafting positions of both micro-batches' responses
    from verl_mtp_plugin.acceptance.estimate import acceptance_positions, response_runs

    drafting = [sum(n for *_, n in response_runs(acceptance_positions(mask, 1))) for _, mask in seen]
    assert len(drafting) == 2 and min(drafting) > 0
    assert metrics["mtp_drafted_num_positions"] == [float(sum(drafting))]
    rate = metrics["mtp_expected_accept_rate"][0]
    assert 0.0 <= rate <= 1.0 and 0.0 <= metrics["mtp_greedy_accept_rate"][0] <= 1.0
    assert metrics["mtp_expected_accept_length_k3"][0] == pytest.approx(1 + rate + rate**2 + rate**3)
    loss, acc = metrics["mtp_losses/mtp_1_loss"][0], metrics["mtp_accuracy/mtp_1_top1"][0]
    expected_loss = float(before["loss_values"][0]) / 2  # tracker sum over 2 micro-batches, averaged
    assert loss == pytest.approx(expected_loss)
    assert acc == pytest.approx(float(before["correct_values"][0]) / N_RESPONSE_TARGETS)
    renamed = rename_dict({k: v for k, v in metrics.items()}, "actor/")
    assert "actor/mtp_losses/mtp_1_loss" in renamed and "actor/mtp_expected_accept_rate" in renamed
    assert all(float(v.abs().sum()) == 0 for v in tracker_snapshot().values())  # reset for the next step

    ddp.zero_grad_buffer()
    ddp.module.config.mtp_detach_heads = False
    joint = attach(new_engine(hf_dir, enable=True, enable_train=True, detach=False), ddp)
    run_pass(joint, ppo_loss_fn, forward_only=False)
    g = grads(ddp)
    assert not torch.allclose(g["output_layer.weight"], reference["output_layer.weight"])
    assert not torch.allclose(g["decoder.final_norm.weight"], reference["decoder.final_norm.weight"])


def test_a_pass_above_the_drafted_budget_probes_about_the_budget_from_every_micro_batch(
    megatron_env, registered, hf_dir, ppo_loss_fn, monkeypatch
):
    """The drafted estimate's budget is the pass's, shared among its micro-batches by their response tokens: with a
    budget of half the pass's response tokens each micro-batch probes whole responses for about half of its own."""
    import functools

    import verl_mtp_plugin.engine.megatron as engine_mod
    from verl_mtp_plugin.acceptance.probe import DraftedBudget

    shares = []

    class Recording(DraftedBudget):
        def take(self, tokens, sequences):
            shares.append(super().take(tokens, sequences))
            return shares[-1]

    budget = sum(RESP_LENS) // 2
    monkeypatch.setattr(engine_mod, "DraftedBudget", functools.partial(Recording, budget=budget))
    ddp = tiny_ddp(detach=True)
    online = attach(new_engine(hf_dir, enable=True, enable_train=True, detach=True), ddp)
    output, _, _ = run_pass(online, ppo_loss_fn, forward_only=False)
    assert len(shares) == 2 and min(shares) > 0  # both micro-batches probed
    probed = output["metrics"]["mtp_drafted_num_positions"][0]
    assert abs(probed - budget) <= max(RESP_LENS) and probed < sum(RESP_LENS) - 2
    assert 0.0 < output["metrics"]["mtp_drafted_expected_accept_rate"][0] <= 1.0


@pytest.mark.parametrize("objective", ["soft_ce", "tv"])
def test_online_objective_trains_mtp_isolated_and_logs_its_value(megatron_env, registered, hf_dir, ppo_loss_fn,
                                                                 objective):
    """actor_rollout_ref.model.mtp.objective through the engine: the trunk, embedding and output layer get
    exactly the policy-loss gradient (as with hard_ce), the MTP block a different gradient than hard_ce's,
    mtp_losses keeps the hard cross-entropy and mtp_objective/mtp_1_<objective> logs the objective."""
    ddp = tiny_ddp(detach=True)
    run_pass(attach(new_engine(hf_dir, enable=True, enable_train=False), ddp), ppo_loss_fn, forward_only=False)
    reference = grads(ddp)  # policy-loss gradients only (frozen: no MTP forward)
    results = {}
    for obj in ("hard_ce", objective):
        ddp.zero_grad_buffer()
        engine = attach(new_engine(hf_dir, objective=obj), ddp)
        assert engine.mtp_settings.objective == obj
        output, _, _ = run_pass(engine, ppo_loss_fn, forward_only=False)
        results[obj] = (output["metrics"], grads(ddp))
    (hard_m, hard_g), (obj_m, obj_g) = results["hard_ce"], results[objective]
    for n in obj_g:
        if not n.startswith("mtp."):
            torch.testing.assert_close(obj_g[n], reference[n], rtol=1e-5, atol=1e-7, msg=n)  # trunk untouched
    mtp_names = [n for n in obj_g if n.startswith("mtp.") and "expert_bias" not in n]
    assert all(float(obj_g[n].abs().sum()) > 0 for n in mtp_names)
    assert not torch.allclose(obj_g["mtp.layers.0.eh_proj.weight"], hard_g["mtp.layers.0.eh_proj.weight"])
    # the value megatron tracks stays the hard cross-entropy (same weights, same batch)
    assert obj_m["mtp_losses/mtp_1_loss"][0] == pytest.approx(hard_m["mtp_losses/mtp_1_loss"][0], rel=1e-6)
    value = obj_m[f"mtp_objective/mtp_1_{objective}"][0]
    assert "mtp_objective/mtp_1_hard_ce" not in obj_m
    assert 0.0 < value < (1.0 if objective == "tv" else 10.0)
    if objective == "tv":  # 1 - the overlap; the estimate is the overlap on at most 128 positions per micro-batch
        assert abs((1.0 - value) - obj_m["mtp_expected_accept_rate"][0]) < 0.25


def test_packed_thd_objective_matches_the_padded_pass(megatron_env, registered, hf_dir, ppo_loss_fn):
    """soft_ce under THD packing (per-sequence roll of the mask, target at t+1 inside each packed sequence)
    gives the padded pass's objective value and gradients."""
    results = {}
    for packed in (False, True):
        ddp = tiny_ddp(seed=11, detach=True)
        engine = attach(new_engine(hf_dir, packed=packed, objective="soft_ce"), ddp)
        output, _, _ = run_pass(engine, ppo_loss_fn, forward_only=False)
        results[packed] = (output["metrics"], grads(ddp))
    (pad_m, pad_g), (thd_m, thd_g) = results[False], results[True]
    assert thd_m["mtp_objective/mtp_1_soft_ce"][0] == pytest.approx(pad_m["mtp_objective/mtp_1_soft_ce"][0], rel=1e-5)
    assert pad_m["mtp_objective/mtp_1_soft_ce"][0] > 0
    for n in pad_g:
        torch.testing.assert_close(thd_g[n], pad_g[n], rtol=1e-4, atol=1e-6, msg=n)


def test_logprob_and_ref_passes_never_run_mtp(megatron_env, registered, hf_dir, ppo_loss_fn):
    ddp = tiny_ddp(detach=True)
    calls = mtp_calls(ddp)
    off = attach(new_engine(hf_dir, enable=False, enable_train=False, detach=False), ddp)
    baseline, _, phase = run_pass(off, None, forward_only=True)
    assert phase is Phase.LOGPROB and not calls

    for kwargs in (dict(enable_train=True, detach=True), dict(enable_train=True, detach=False)):
        ddp.module.config.mtp_detach_heads = kwargs["detach"]
        actor = attach(new_engine(hf_dir, enable=True, **kwargs), ddp)
        start = tracker_snapshot()
        output, before, phase = run_pass(actor, None, forward_only=True)
        assert phase is Phase.LOGPROB and not calls
        assert all(torch.equal(before[k], start[k]) for k in start)  # tracker untouched
        assert not any(k.startswith("mtp_") for k in output["metrics"])
        for key in ("log_probs", "entropy"):
            for a, b in zip(output["model_output"][key].unbind(), baseline["model_output"][key].unbind()):
                assert torch.equal(a, b)

    # verl's reference model: same model_type, MtpConfig(enable=False), forward-only engine
    ref = attach(new_engine(hf_dir, enable=False, enable_train=False, detach=False, forward_only=True), ddp)
    output, before, phase = run_pass(ref, None, forward_only=True)
    assert phase is Phase.REF and not calls
    for a, b in zip(output["model_output"]["log_probs"].unbind(), baseline["model_output"]["log_probs"].unbind()):
        assert torch.equal(a, b)
    # and the update pass right after does run MTP (the hook counts)
    ddp.module.config.mtp_detach_heads = True
    run_pass(attach(new_engine(hf_dir), ddp), ppo_loss_fn, forward_only=False)
    assert len(calls) == 2


@pytest.mark.parametrize("mode", ["off", "frozen", "online", "joint"])
def test_forward_micro_batch_follows_the_policy_table(megatron_env, mode):
    """The engine's per-micro-batch function on one verl micro-batch: MTP runs only for train in
    online/joint; logits are the same in every phase."""
    from verl_mtp_plugin.testing import build_tiny_hybrid
    from verl_mtp_plugin.engine.megatron import forward_micro_batch

    torch.manual_seed(3)
    model = build_tiny_hybrid(mtp_detach_heads=(mode == "online"))
    calls = []
    model.mtp.register_forward_hook(lambda *a: calls.append(1))
    batch = verl_batch()
    outs = {}
    for phase in ("train", "logprob", "ref"):
        calls.clear()
        with torch.no_grad():
            outs[phase] = forward_micro_batch(model, batch, phase=phase, mode=mode, data_format="bshd")
        assert bool(calls) == (phase == "train" and mode in ("online", "joint")), phase
    for a, b in zip(outs["train"].unbind(), outs["logprob"].unbind()):
        assert a.shape == (b.shape[0], 128) and torch.equal(a, b)


def test_forward_step_needs_a_pass(megatron_env, registered, hf_dir):
    engine = attach(new_engine(hf_dir), tiny_ddp())
    with pytest.raises(RuntimeError, match="outside forward_backward_batch"):
        engine.forward_step(iter([verl_batch()]), engine.module[0], None, None)
    with engine.mtp_pass(False):
        with pytest.raises(RuntimeError, match="nested"):
            with engine.mtp_pass(True):
                pass
    ref = new_engine(hf_dir, enable=False, enable_train=False, forward_only=True)
    with pytest.raises(RuntimeError, match="forward-only engine"):
        with ref.mtp_pass(False):
            pass


# ---------------------------------------------------------------------------------------------- layout


def test_packed_thd_pass_matches_the_padded_pass(megatron_env, registered, hf_dir, ppo_loss_fn):
    """use_remove_padding=true with pad_to_length (verl's THD packing and bucket padding, the plugin's packed MTP
    mask and Mamba seq_idx, megatron's packed roll, verl's THD label roll and unpacking) gives the padded pass's
    log-probs, MTP loss, MTP targets, acceptance estimate and gradients on the Nemotron-shaped model."""
    results = {}
    for packed in (False, True):
        ddp = tiny_ddp(seed=11, detach=True)
        engine = attach(new_engine(hf_dir, packed=packed), ddp)
        output, before, phase = run_pass(engine, ppo_loss_fn, forward_only=False)
        assert phase is Phase.TRAIN
        logprobs, _, _ = run_pass(engine, None, forward_only=True)
        results[packed] = (output, before, grads(ddp), logprobs)
    (pad_out, pad_tr, pad_g, pad_lp), (thd_out, thd_tr, thd_g, thd_lp) = results[False], results[True]
    assert int(thd_tr["total_values"].sum()) == int(pad_tr["total_values"].sum()) == N_RESPONSE_TARGETS
    assert thd_out["metrics"]["mtp_losses/mtp_1_loss"][0] == pytest.approx(pad_out["metrics"]["mtp_losses/mtp_1_loss"][0])
    for key in ("mtp_expected_accept_rate", "mtp_argmax_draft_accept_rate", "mtp_expected_accept_length_k3"):
        assert thd_out["metrics"][key][0] == pytest.approx(pad_out["metrics"][key][0], rel=1e-5), key
    # every position but each sequence's last, whose rolled label wraps differently in verl's packed and
    # padded label roll (it scores no token: verl's no_padding_2_padding drops it)
    for a, b in zip(thd_lp["model_output"]["log_probs"].unbind(), pad_lp["model_output"]["log_probs"].unbind()):
        torch.testing.assert_close(a[:-1], b[:-1])
    for n in pad_g:
        torch.testing.assert_close(thd_g[n], pad_g[n], rtol=1e-4, atol=1e-6, msg=n)


def test_mtp_token_mask_from_a_verl_micro_batch():
    from verl_mtp_plugin.engine.megatron import mtp_token_mask

    mask = mtp_token_mask(verl_batch())
    rows = [m.tolist() for m in mask.unbind()]
    assert rows[0] == [0] * 6 + [1, 1, 1, 0, 0, 1, 1, 1]
    assert rows[3] == [0] * 2 + [1, 1]
    assert [len(r) for r in rows] == [p + r for p, r in zip(PROMPT_LENS, RESP_LENS)]
    assert sum(sum(r) for r in rows) == N_RESPONSE_TARGETS


def test_packed_params_get_mamba_sequence_index(megatron_env):
    """verl 0.9.1's THD packing leaves PackedSeqParams.seq_idx unset (Mamba state would flow from one
    packed sample into the next); the engine's packed forward adds it from the padded cu_seqlens."""
    from verl.models.mcore.util import preprocess_thd_engine

    from verl_mtp_plugin.engine.megatron import with_mamba_seq_idx

    ids = torch.nested.as_nested_tensor([torch.arange(5), torch.arange(4), torch.arange(3)], layout=torch.jagged)
    _, psp, _ = preprocess_thd_engine(ids, pre_process=True)
    assert psp.seq_idx is None
    fixed = with_mamba_seq_idx(psp)
    assert fixed.seq_idx.tolist() == [[0] * 5 + [1] * 4 + [2] * 3]
    assert torch.equal(fixed.cu_seqlens_q, psp.cu_seqlens_q) and fixed.max_seqlen_q == psp.max_seqlen_q
    assert with_mamba_seq_idx(fixed) is fixed
