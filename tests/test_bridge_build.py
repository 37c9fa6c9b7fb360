"""verl's real model-build path (Megatron-Bridge) for every shipped recipe and role, on CPU.

Each recipe in ``recipes/nemotron3_super_mtp/config`` is composed with verl's Hydra config, scaled down
to a tiny Nemotron-H checkpoint with the same MTP settings (one physical MTP block ``*E``,
``num_nextn_predict_layers: 1``; the recipes' ``mtp_num_layers: 2`` with ``mtp_use_repeated_layer``)
and world size 1. Then, per role, verl's own code builds the worker config
(``ActorRolloutRefWorker.init_model`` for actor and reference, the v1 trainer's critic config), the
engine (``EngineRegistry.new``: the plugin engine for actor and reference, verl's value-model engine
for the critic), the Megatron-Bridge provider (``_build_tf_config``: ``check_mtp_config``,
``AutoBridge.from_hf_pretrained`` -> ``NemotronHBridge`` -> ``HybridModelProvider.finalize``) and the
model (``make_megatron_module`` -> ``provide_distributed_model`` with the pre-wrap hooks). CPU limits
(see :mod:`verl_mtp_cpu.bridge`): a placeholder ``transformer_engine`` so Megatron-Bridge
imports, a TE-free spec with the production parameter names, fusions off, no DDP wrap, no weight load.
"""

import dataclasses
import pathlib

import pytest
import torch

from verl_mtp_plugin.policy import MTPConfigError, MTPMode
from verl_mtp_plugin.config_keys import MODEL_TYPE

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "recipes" / "nemotron3_super_mtp" / "config"
RECIPES = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem != "super_mtp_common")
RECIPE_MODE = {"grpo_frozen": "frozen", "grpo_online": "online", "grpo_joint": "joint", "ppo_frozen": "frozen", "ppo_online": "online"}


def test_every_shipped_recipe_is_covered():
    assert RECIPES == sorted(RECIPE_MODE)


@pytest.fixture(scope="module", autouse=True)
def _bridge_env(megatron_env):
    from verl_mtp_plugin.engine.registry import register
    from verl_mtp_cpu.bridge import install_te_import_placeholder

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERL_ENGINE_DEVICE", "cuda")
        mp.setenv("VERL_ENGINE_VENDOR", "nvidia")
        install_te_import_placeholder()
        register()
        yield


@pytest.fixture(scope="module")
def tiny_spec():
    from verl_mtp_plugin.testing import TinyHybridSpec

    # Super's MTP layout in small: one physical "*E" block (attention + latent MoE), repeated twice.
    return TinyHybridSpec(pattern="M*-E/*E/*E", mtp_use_repeated_layer=True, hidden_size=64, num_experts=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_spec):
    from verl_mtp_cpu.bridge import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("super_tiny"), tiny_spec)


def compose(name, checkpoint, extra=()):
    from verl_mtp_plugin.trainer.config import compose_recipe

    overrides = [
        f"actor_rollout_ref.model.path={checkpoint}",
        "+actor_rollout_ref.model.load_tokenizer=false",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.sequence_parallel=false",
    ]
    if name.startswith("ppo"):
        overrides += [
            "+critic.model.load_tokenizer=false",
            "critic.megatron.tensor_model_parallel_size=1",
            "critic.megatron.expert_model_parallel_size=1",
            "critic.megatron.sequence_parallel=false",
        ]
    return compose_recipe(str(CONFIG_DIR), name, overrides + list(extra))


def build(cfg, role, *, drop_overrides=(), keep_bridge=()):
    """verl's worker config -> engine -> provider -> model for ``role``; ``keep_bridge``: CPU provider overrides
    left out, so that Megatron-Bridge's own value reaches the engine."""
    from verl_mtp_cpu.bridge import build_role, cpu_build_overrides, role_engine, verl_worker_configs

    worker_config = verl_worker_configs(cfg, role)
    overrides = worker_config.engine_config.override_transformer_config
    for key in drop_overrides:
        overrides.pop(key, None)
    overrides.update({k: v for k, v in cpu_build_overrides().items() if k not in keep_bridge})
    return build_role(role_engine(worker_config))


def mtp_keys(model):
    return sorted(k for k in model.state_dict() if k.startswith("mtp."))


def assert_no_mtp(model):
    assert getattr(model, "mtp", None) is None and not getattr(model, "mtp_process", False)
    assert not mtp_keys(model)
    assert model.config.mtp_num_layers in (None, 0)
    assert "/" not in model.hybrid_layer_pattern


# --------------------------------------------------------------------------------------------------
# every recipe, every role


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_builds_mtp_exactly_where_it_belongs(name, checkpoint):
    """actor: MTP block with the recipe's depth (one physical layer applied twice) and the mode's
    build-time settings; reference: no MTP; critic (PPO): value head, no MTP."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithValueHead

    from verl_mtp_plugin.engine.megatron import NemotronHMTPMegatronEngine

    cfg = compose(name, checkpoint)
    mode = MTPMode(RECIPE_MODE[name])

    actor = build(cfg, "actor")
    assert type(actor.engine) is NemotronHMTPMegatronEngine and actor.engine.mtp_mode is mode
    model = actor.model
    assert type(model).__name__ == "HybridModel" and model.mtp_process
    assert model.config.mtp_num_layers == 2 and model.config.mtp_use_repeated_layer
    assert len(model.mtp.layers) == 1  # one physical block, as in the checkpoint
    assert model.hybrid_layer_pattern == "M*-E/*E/*E"  # Bridge: one pattern copy per depth
    assert model.config.mtp_detach_heads is (mode is MTPMode.ONLINE)
    assert model.config.mtp_loss_scaling_factor == pytest.approx(0.1 if mode is MTPMode.JOINT else 0.3)
    frozen = {n: not p.requires_grad for n, p in model.named_parameters() if n.startswith("mtp.")}
    assert frozen and all(frozen.values()) is (mode is MTPMode.FROZEN)
    assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith("mtp."))

    ref = build(cfg, "ref")
    assert type(ref.engine) is NemotronHMTPMegatronEngine and ref.engine.mtp_mode is MTPMode.OFF
    assert ref.engine.engine_config.forward_only
    assert_no_mtp(ref.model)
    assert set(ref.model.state_dict()) == {k for k in model.state_dict() if not k.startswith("mtp.")}

    if name.startswith("ppo"):
        critic = build(cfg, "critic")
        assert type(critic.engine) is MegatronEngineWithValueHead
        assert_no_mtp(critic.model)
        assert critic.model.output_layer.weight.shape[0] == 1  # verl's value head
    else:
        from verl.trainer.ppo.utils import need_critic

        assert not need_critic(cfg)  # GRPO: verl builds no critic


@pytest.mark.parametrize("mode", ["off", "frozen", "online", "joint"])
def test_actor_state_dict_keys_per_mode(mode, checkpoint):
    """The actor's checkpoint keys: every mode with MTP has the same keys (frozen changes requires_grad
    only); off has exactly the trunk's keys."""
    extra = {
        "off": [
            "actor_rollout_ref.model.mtp.enable=false",
            "actor_rollout_ref.model.mtp.enable_train=false",
            "actor_rollout_ref.model.mtp.enable_rollout=false",
            "~actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config",  # mode off drops the recipes' key
        ],
        "frozen": ["actor_rollout_ref.model.mtp.enable_train=false"],
        "online": [],
        "joint": ["actor_rollout_ref.model.mtp.detach_encoder=false"],
    }[mode]
    cfg = compose("grpo_online", checkpoint, extra)
    built = build(cfg, "actor")
    assert built.engine.mtp_mode is MTPMode(mode)
    keys = set(built.model.state_dict())
    trunk = {k for k in keys if not k.startswith("mtp.")}
    assert any(k.startswith("decoder.layers.") for k in trunk) and "output_layer.weight" in trunk
    mtp = sorted(keys - trunk)
    if mode == "off":
        assert_no_mtp(built.model)
    else:
        assert mtp and all(k.startswith("mtp.layers.0.") for k in mtp)  # repeated layer: one block
        # production (TE) names: the attention norm is fused into linear_qkv
        assert "mtp.layers.0.mtp_model_layer.layers.0.self_attention.linear_qkv.layer_norm_weight" in mtp
        assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight"} <= set(mtp)


# --------------------------------------------------------------------------------------------------
# what the plugin and the recipes prevent


def test_verls_own_reference_handling_still_builds_mtp_through_the_bridge(checkpoint):
    """Why the plugin engine clears the Bridge's MTP pattern in mode off: verl's reference handling
    (``mtp.enable=false`` -> ``check_mtp_config`` -> ``mtp_num_layers=None``) on verl's stock Megatron
    engine, same config, still gets an MTP block (``HybridModelProvider.finalize`` re-appends the
    pattern with ``mtp_use_repeated_layer`` on)."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from verl_mtp_cpu.bridge import build_role, cpu_build_overrides, role_engine, verl_worker_configs
    from verl_mtp_plugin.engine.settings import BRIDGE_NO_MTP_OVERRIDES

    cfg = compose("grpo_online", checkpoint)
    worker_config = verl_worker_configs(cfg, "ref")
    assert worker_config.model_config.mtp.enable is False and worker_config.model_type == MODEL_TYPE
    plugin_ref = role_engine(worker_config)
    assert BRIDGE_NO_MTP_OVERRIDES.items() <= plugin_ref.apply_mtp_overrides().items()

    stock_config = dataclasses.replace(verl_worker_configs(cfg, "ref"), model_type="language_model")
    stock_config.engine_config.override_transformer_config.update(cpu_build_overrides())
    stock = build_role(role_engine(stock_config))
    assert type(stock.engine) is MegatronEngineWithLMHead
    assert stock.engine.engine_config.override_transformer_config["mtp_num_layers"] is None  # verl's check_mtp_config
    assert stock.model.mtp_process and stock.model.config.mtp_num_layers == 1 and mtp_keys(stock.model)


def test_critic_without_the_recipes_override_gets_mtp_and_the_check_refuses_it(checkpoint):
    """verl's value-model engine on the same checkpoint builds an MTP block unless the recipe clears the
    Bridge's MTP pattern; ``verl-mtp check`` refuses that config, naming the key."""
    from verl_mtp_plugin.trainer.config import validate_verl_config

    cfg = compose("ppo_online", checkpoint)
    critic = build(cfg, "critic", drop_overrides=("mtp_hybrid_override_pattern", "mtp_use_repeated_layer"))
    assert critic.model.mtp_process and mtp_keys(critic.model)
    assert critic.model.output_layer.weight.shape[0] == 1  # ... next to the 1-wide value head

    from omegaconf import open_dict

    with open_dict(cfg):
        del cfg.critic.megatron.override_transformer_config["mtp_hybrid_override_pattern"]
    with pytest.raises(MTPConfigError, match=r"critic\.megatron\.override_transformer_config\.mtp_hybrid_override_pattern"):
        validate_verl_config(cfg)


def test_virtual_pipeline_parallelism_is_refused_before_the_bridge_asserts(checkpoint):
    from verl_mtp_cpu.bridge import role_engine, verl_worker_configs
    from verl_mtp_plugin.trainer.config import validate_verl_config

    cfg = compose("grpo_online", checkpoint, ["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"])
    with pytest.raises(MTPConfigError, match=r"actor\.megatron\.virtual_pipeline_model_parallel_size=2"):
        validate_verl_config(cfg)
    # the engine refuses it too (its constructor runs the engine-level checks)
    with pytest.raises(MTPConfigError, match="virtual_pipeline_model_parallel_size"):
        role_engine(verl_worker_configs(cfg, "actor"))


# --------------------------------------------------------------------------------------------------
# names on the real sync path: the Bridge's export -> the plugin's strict check -> vLLM's drafter


@pytest.fixture(scope="module")
def online_actor(checkpoint):
    torch.manual_seed(0)
    return build(compose("grpo_online", checkpoint), "actor")


@pytest.fixture(scope="module")
def drafter_models(tmp_path_factory, tiny_spec):
    from verl_mtp_cpu.vllm_drafter import build_drafter_for_spec

    return build_drafter_for_spec(tiny_spec, workdir=tmp_path_factory.mktemp("vllm_super_tiny"))


def test_bridge_export_names_equal_expected_keys_and_the_vllm_drafter(online_actor, drafter_models):
    from verl_mtp_plugin.export import canonical_drafter_name, expected_hf_mtp_keys

    engine = online_actor.engine
    stream = list(engine.bridge.export_hf_weights(online_actor.module))  # what verl's get_per_tensor_param yields
    names = [n for n, _ in stream]
    assert len(names) == len(set(names))
    bridge_mtp = {n for n in names if n.startswith("mtp.")}
    expected = expected_hf_mtp_keys(engine.model_config.hf_config)
    assert bridge_mtp == set(expected)
    drafter = drafter_models.drafter
    shared = {n for n, p in drafter.named_parameters() if any(p is q for q in drafter_models.target.parameters())}
    drafter_params = {canonical_drafter_name(n) for n, _ in drafter.named_parameters() if n not in shared}
    from verl_mtp_plugin.export import hf_mtp_digests

    assert set(hf_mtp_digests([(n, t) for n, t in stream if n in bridge_mtp])) == drafter_params
    # the trunk goes to the target: every non-MTP name is one of vLLM's target checkpoint names
    assert "backbone.embeddings.weight" in names and "lm_head.weight" in names


def test_strict_check_accepts_the_bridge_stream_and_rejects_one_changed_name(online_actor, drafter_models):
    from verl_mtp_cpu.vllm_drafter import make_syncer
    from verl_mtp_plugin.rollout.worker.drafter_sync import MTPSyncError

    stream = list(online_actor.engine.bridge.export_hf_weights(online_actor.module))
    sync = make_syncer(drafter_models)
    target_names = []
    metrics = sync.sync(stream, load_target=lambda part: target_names.extend(n for n, _ in part), bucket_tensors=7)
    assert metrics["sync/drafter_loaded"] == 1.0
    assert metrics["sync/tensors_drafter"] == sum(n.startswith("mtp.") for n, _ in stream)
    assert not any(n.startswith("mtp.") for n in target_names)
    loads = sync.post_process_count
    before = {n: p.detach().clone() for n, p in drafter_models.drafter.named_parameters() if p.numel()}

    victim = next(i for i, (n, _) in enumerate(stream) if n.startswith("mtp.") and "experts.0.up_proj" in n)
    renamed = list(stream)
    renamed[victim] = (renamed[victim][0].replace("experts.0.", "experts.00."), renamed[victim][1])
    with pytest.raises(MTPSyncError, match=r"1 missing .*experts\.0\.up_proj.*1 unexpected .*experts\.00\.up_proj"):
        sync.sync([(n, t * 2) for n, t in renamed], bucket_tensors=7)
    # nothing was loaded: no reload cycle ran and every drafter tensor is as before
    assert sync.post_process_count == loads
    after = dict(drafter_models.drafter.named_parameters())
    assert all(torch.equal(after[n].detach(), t) for n, t in before.items())


def test_latent_moe_checkpoint_builds_actor_and_reference_without_the_shared_expert_overlap(checkpoint):
    """Megatron-Bridge turns the shared-expert overlap on for every Nemotron-H; megatron-core refuses it with latent
    MoE in training and in verl's log-prob / reference passes (seen on the H200: verl's trainer stopped at its first
    log-prob pass on a Super-width checkpoint). The plugin engine turns it off for a latent-MoE checkpoint, in the
    actor and in the reference model (mode off), without the CPU runtime's own override of the key."""
    from verl_mtp_plugin.engine.settings import LATENT_MOE_OVERRIDES

    cfg = compose("grpo_online", checkpoint)
    for role in ("actor", "ref"):
        built = build(cfg, role, keep_bridge=tuple(LATENT_MOE_OVERRIDES))
        assert built.model.config.moe_latent_size, role
        assert built.model.config.moe_shared_expert_overlap is False, role
        assert built.engine.engine_config.override_transformer_config["moe_shared_expert_overlap"] is False, role


def test_without_apex_the_engine_turns_the_bridges_wgrad_fusion_off(checkpoint):
    """Megatron-Bridge turns gradient-accumulation fusion on whenever Transformer Engine imports (here: the CPU
    runtime's TE placeholder), and megatron-core's ColumnParallelLinear (HybridModel's output layer) then raises at
    construction without apex's kernel (seen on the H200 with pip's TE). The plugin engine turns it off unless the
    user set it; a user's value stands."""
    import importlib.util

    from verl_mtp_plugin.engine.megatron import WGRAD_FUSION_KEY, wgrad_fusion_override

    assert importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None  # no apex on this machine
    from megatron.bridge.utils.fusions import can_enable_gradient_accumulation_fusion

    assert can_enable_gradient_accumulation_fusion()  # the Bridge's default: on
    cfg = compose("grpo_online", checkpoint)
    built = build(cfg, "actor", keep_bridge=(WGRAD_FUSION_KEY,))
    assert built.model.config.gradient_accumulation_fusion is False
    assert built.engine.engine_config.override_transformer_config[WGRAD_FUSION_KEY] is False
    assert wgrad_fusion_override({WGRAD_FUSION_KEY: False}) == {}
    with pytest.raises(MTPConfigError, match="override_transformer_config.gradient_accumulation_fusion=True"):
        wgrad_fusion_override({WGRAD_FUSION_KEY: True})  # would raise deep in megatron's model build
