"""recipes/nemotron3_super_mtp: every recipe composes through verl 0.9.1's real Hydra config (search
path pkg://verl.trainer.config), passes the plugin's validation, instantiates verl's own config
dataclasses, and selects the plugin engine with the intended mode and phase behaviour."""

import copy
import os
import re
import subprocess
from pathlib import Path

import pytest
from omegaconf import open_dict

from verl_mtp_plugin.policy import MTPMode, Phase
from verl_mtp_plugin.trainer.config import compose_recipe, main, validate_verl_config
from verl_mtp_plugin.config_keys import MODEL_TYPE

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "nemotron3_super_mtp"
CONFIG_DIR = RECIPE / "config"
RECIPES = {
    "grpo_frozen": ("grpo", MTPMode.FROZEN, 8),
    "grpo_online": ("grpo", MTPMode.ONLINE, 8),
    "grpo_joint": ("grpo", MTPMode.JOINT, 8),
    "ppo_frozen": ("gae", MTPMode.FROZEN, 16),
    "ppo_online": ("gae", MTPMode.ONLINE, 16),
}
EXTENSION = "verl_mtp_plugin.rollout.worker_extension.MTPColocateWorkerExtension"


@pytest.fixture(scope="module")
def composed():
    return {name: compose_recipe(str(CONFIG_DIR), name) for name in RECIPES}


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """Stands in for the 120B checkpoint: Nemotron-H HF config with one MTP layer ("*E")."""
    from verl_mtp_cpu.vllm_drafter import write_hf_config_dir

    return write_hf_config_dir(tmp_path_factory.mktemp("super_stand_in"))


def ref_config(cfg):
    """The reference model's McoreActorConfig, prepared exactly as verl's ActorRolloutRefWorker.init_model
    does (engine_workers.py) before omega_conf_to_dataclass."""
    from verl.utils.config import omega_conf_to_dataclass

    ref = copy.deepcopy(cfg.actor_rollout_ref.ref)
    with open_dict(ref):
        ref.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
    return omega_conf_to_dataclass(ref)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_composes_on_verls_ppo_trainer_and_resolves(composed, name):
    adv, mode, nodes = RECIPES[name]
    cfg = composed[name]
    arr = cfg.actor_rollout_ref
    # verl's megatron engine group was selected through the defaults list
    assert arr.actor._target_ == "verl.workers.config.McoreActorConfig" and arr.actor.strategy == "megatron"
    assert arr.ref.strategy == "megatron" and cfg.algorithm.adv_estimator == adv
    assert arr.model.external_lib == "verl_mtp_plugin" and arr.model.model_type == MODEL_TYPE
    # parallelism of the 120B run
    meg = arr.actor.megatron
    assert (meg.tensor_model_parallel_size, meg.expert_model_parallel_size, meg.pipeline_model_parallel_size) == (2, 16, 1)
    assert meg.context_parallel_size == 1 and meg.sequence_parallel and meg.use_distributed_optimizer
    assert (arr.rollout.tensor_model_parallel_size, arr.rollout.expert_parallel_size) == (8, 8)
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (nodes, 8)
    # the reference model inherits the actor's overrides (verl interpolation) but builds MTP off
    assert arr.ref.megatron.override_transformer_config.mtp_num_layers == 2

    s = validate_verl_config(cfg)
    assert s.engine_selected and s.strategy == "megatron" and s.mode is mode
    trains = mode in (MTPMode.ONLINE, MTPMode.JOINT)
    assert s.run_mtp_forward[Phase.TRAIN.value] is trains
    assert not any(s.run_mtp_forward[p.value] for p in (Phase.LOGPROB, Phase.REF, Phase.SYNC, Phase.ROLLOUT))
    assert s.mtp_num_layers == 2  # one repeated "*E" block, two depths (Megatron-Bridge Super recipe)
    assert s.mtp_loss_scaling_factor == (0.1 if mode is MTPMode.JOINT else 0.3)
    assert s.rollout_speculation and s.speculative_config == {"method": "mtp", "num_speculative_tokens": 2,
                                                              "draft_sample_method": "probabilistic"}
    assert s.draft_sample_method == "probabilistic"  # the recipes draft probabilistically
    assert s.sleep_level == 1 and s.prefix_caching is False and s.mamba_cache_mode is None  # vLLM would drop it
    assert s.worker_extension_cls == EXTENSION
    assert s.drafter_sync == ("frozen" if mode is MTPMode.FROZEN else "online")
    # rollout speculation metrics + desync guard: the plugin's sync trainer, guard block valid
    assert s.trainer_mode == "mtp_sync" and s.rollout_metrics
    assert cfg.verl_mtp_plugin.mtp_guard.action == "warn"


def test_recipe_worker_extension_resolves_to_a_verl_extension_subclass():
    """vLLM imports worker_extension_cls by its qualified name: it must be the plugin's subclass of
    verl's colocated extension (verl's bucketed weight transfer kept)."""
    import importlib

    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    module, _, name = EXTENSION.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert isinstance(cls, type) and issubclass(cls, vLLMColocateWorkerExtension)


@pytest.mark.parametrize("name", ["grpo_online", "ppo_frozen"])
def test_recipe_instantiates_verls_config_dataclasses(name, tiny_checkpoint):
    from verl.utils.config import omega_conf_to_dataclass

    cfg = compose_recipe(
        str(CONFIG_DIR),
        name,
        [f"actor_rollout_ref.model.path={tiny_checkpoint}", "+critic.model.load_tokenizer=false"],
    )
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert type(actor).__name__ == "McoreActorConfig" and actor.engine.expert_model_parallel_size == 16
    assert actor.engine.override_transformer_config["mtp_use_repeated_layer"] is True
    ref = ref_config(cfg)
    assert ref.engine.forward_only is True
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)  # asserts EP == TP x DP
    assert rollout.mtp.enable_rollout and rollout.mtp.num_speculative_tokens == 2
    assert rollout.engine_kwargs["vllm"]["worker_extension_cls"] == EXTENSION
    assert rollout.enable_prefix_caching is False
    if name.startswith("ppo"):
        critic = omega_conf_to_dataclass(cfg.critic)
        assert type(critic).__name__ == "McoreCriticConfig" and critic.model.use_remove_padding is False
    # with the checkpoint readable, the HF-dependent checks run too
    assert validate_verl_config(cfg).hf_mtp_layers == 1


def test_recipe_selects_the_plugin_engine_for_actor_and_ref(megatron_env, tiny_checkpoint, monkeypatch):
    """What verl's ActorRolloutRefWorker.init_model does with the recipe: HFModelConfig (imports the
    external_lib) -> EngineRegistry.new(model_type, strategy) for the actor, and for the reference model
    the same model_type with MtpConfig(enable=False)."""
    from verl.trainer.config import CheckpointConfig
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import MtpConfig
    from verl.workers.engine import EngineRegistry

    from verl_mtp_plugin.engine.megatron import NemotronHMTPMegatronEngine
    from verl_mtp_plugin.engine.registry import register

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "nvidia")
    register()  # what `import verl_mtp_plugin` (external_lib) does when verl is importable
    cfg = compose_recipe(
        str(CONFIG_DIR),
        "grpo_online",
        [f"actor_rollout_ref.model.path={tiny_checkpoint}", "+actor_rollout_ref.model.load_tokenizer=false"],
    )
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    engine = EngineRegistry.new(
        model_type=model_config.get("model_type", "language_model"),
        backend=actor.engine.strategy,
        model_config=model_config,
        engine_config=actor.engine,
        optimizer_config=actor.optim,
        checkpoint_config=CheckpointConfig(),
    )
    assert type(engine) is NemotronHMTPMegatronEngine and engine.mtp_mode is MTPMode.ONLINE
    from verl_mtp_plugin.engine.settings import LATENT_MOE_OVERRIDES as LATENT  # the tiny checkpoint's MoE is latent

    assert engine.apply_mtp_overrides() == {"mtp_detach_heads": True, "mtp_loss_scaling_factor": 0.3, **LATENT}

    ref_model = copy.deepcopy(model_config)
    ref_model.mtp = MtpConfig(enable=False)
    ref_cfg = ref_config(cfg)
    ref = EngineRegistry.new(
        model_type=MODEL_TYPE, backend="megatron", model_config=ref_model, engine_config=ref_cfg.engine,
        optimizer_config=None, checkpoint_config=CheckpointConfig(),
    )
    assert ref.mtp_mode is MTPMode.OFF
    # MTP not built for the reference model (the Bridge's MTP pattern cleared too)
    assert ref.apply_mtp_overrides() == {
        "mtp_num_layers": None, "mtp_hybrid_override_pattern": None, "mtp_use_repeated_layer": False, **LATENT
    }
    with ref.mtp_pass(forward_only=True) as phase:
        assert phase is Phase.REF


def test_preflight_cli_accepts_every_recipe_and_reports_bad_overrides(capsys):
    for name in RECIPES:
        assert main(["--config-path", str(CONFIG_DIR), "--config-name", name]) == 0
    assert main(
        ["--config-path", str(CONFIG_DIR), "--config-name", "grpo_online", "actor_rollout_ref.rollout.enable_prefix_caching=true",
         "+actor_rollout_ref.rollout.engine_kwargs.vllm.mamba_cache_mode=all"]
    ) == 1
    assert "mamba_cache_mode=align" in capsys.readouterr().err


def test_required_verl_pin_matches_the_installed_verl():
    import verl

    lines = [ln.strip() for ln in (RECIPE / "REQUIRED_VERL.txt").read_text().splitlines()]
    pin = next(ln for ln in lines if ln and not ln.startswith("#"))
    assert re.fullmatch(r"v\d+\.\d+\.\d+", pin)
    assert pin == f"v{verl.__version__}"


@pytest.mark.parametrize("script,names", [("run_grpo.sh", ["grpo_frozen", "grpo_online", "grpo_joint"]), ("run_ppo.sh", ["ppo_frozen", "ppo_online"])])
def test_run_scripts_launch_the_plugin_entrypoint_on_these_configs(script, names):
    path = RECIPE / script
    text = path.read_text()
    assert os.access(path, os.X_OK)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert "python3 -m verl_mtp_plugin.main_ppo --config-path" in text  # registers trainer mode mtp_sync
    assert "python3 -m verl_mtp_plugin.trainer.config --config-path" in text  # pre-flight
    prefix = re.search(r"CONFIG_NAME=(\w+)_\$\{MODE\}", text).group(1)
    for name in names:
        assert name.startswith(prefix + "_") and (CONFIG_DIR / f"{name}.yaml").is_file()
