"""Start-up validation (verl_mtp_plugin.trainer.config) on verl 0.9.1's real composed trainer config:
each error is raised with its key names; valid configs resolve to the expected settings."""

import copy
import dataclasses

import pytest
from omegaconf import OmegaConf, open_dict

from verl_mtp_plugin.policy import MTPConfigError, MTPMode
from verl_mtp_plugin.config_keys import MODEL_TYPE
from verl_mtp_plugin.engine.settings import apply_mtp_overrides, resolve_engine_settings
from verl_mtp_plugin.trainer.config import PLUGIN_EXTENSIONS, main, validate_verl_config


def write_hf_dir(path, num_nextn_predict_layers=1):
    """A tiny Nemotron-H HF config dir (the tiny megatron model's shapes; no MTP when 0 layers)."""
    from verl_mtp_cpu.vllm_drafter import write_hf_config_dir

    return write_hf_config_dir(path, pattern="M*-E/*E" if num_nextn_predict_layers else "M*-E")


@pytest.fixture(scope="module")
def verl_base():
    """verl's own ppo_trainer composed with model_engine=megatron (real schema and defaults)."""
    from verl_mtp_plugin.trainer.config import compose_ppo_trainer

    return compose_ppo_trainer(["model_engine=megatron", "actor_rollout_ref.rollout.name=vllm"])


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"mtp": write_hf_dir(root / "mtp", 1), "nomtp": write_hf_dir(root / "nomtp", 0)}


def make(verl_base, hf_dirs, *, hf="mtp", **updates):
    """A plugin config (online, speculation, vLLM settings of the recipes) with dotted-key updates."""
    cfg = copy.deepcopy(verl_base)
    base = {
        "actor_rollout_ref.model.path": hf_dirs[hf],
        "actor_rollout_ref.model.external_lib": "verl_mtp_plugin",
        "actor_rollout_ref.model.model_type": MODEL_TYPE,
        "actor_rollout_ref.model.mtp.enable": True,
        "actor_rollout_ref.model.mtp.enable_train": True,
        "actor_rollout_ref.model.mtp.detach_encoder": True,
        "actor_rollout_ref.model.mtp.enable_rollout": True,
        "actor_rollout_ref.model.mtp.num_speculative_tokens": 2,
        "actor_rollout_ref.rollout.enable_prefix_caching": False,
        "actor_rollout_ref.rollout.engine_kwargs.vllm.mamba_cache_mode": None,
        "actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls": PLUGIN_EXTENSIONS[0],
    }
    base.update({k.replace("__", "."): v for k, v in updates.items()})
    with open_dict(cfg):
        for key, value in base.items():
            OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def errors_of(cfg, **kw):
    with pytest.raises(MTPConfigError) as e:
        validate_verl_config(cfg, **kw)
    return str(e.value)


@pytest.mark.parametrize(
    "enable,enable_train,detach,mode,trains",
    [
        (False, False, False, MTPMode.OFF, False),
        (True, False, False, MTPMode.FROZEN, False),
        (True, True, True, MTPMode.ONLINE, True),
        (True, True, False, MTPMode.JOINT, True),
    ],
)
def test_verl_mtp_keys_map_to_plugin_modes(verl_base, hf_dirs, enable, enable_train, detach, mode, trains):
    cfg = make(
        verl_base,
        hf_dirs,
        actor_rollout_ref__model__mtp__enable=enable,
        actor_rollout_ref__model__mtp__enable_train=enable_train,
        actor_rollout_ref__model__mtp__detach_encoder=detach,
        actor_rollout_ref__model__mtp__enable_rollout=enable,
        actor_rollout_ref__model__mtp__mtp_loss_scaling_factor=0.25,
    )
    s = validate_verl_config(cfg)
    assert s.engine_selected and s.strategy == "megatron" and s.mode is mode
    assert s.run_mtp_forward == {
        "load": False, "train": trains, "logprob": False, "ref": False, "sync": False, "rollout": False
    }
    assert s.mtp_loss_scaling_factor == (None if mode is MTPMode.OFF else 0.25)
    assert s.hf_mtp_layers == 1 and s.hybrid_model is True
    assert s.rollout_speculation is enable
    if enable:
        assert s.speculative_config == {"method": "mtp", "num_speculative_tokens": 2}
        assert s.sleep_level == 1  # verl's _resolve_sleep_level: MTP rollout keeps level-1 sleep


def test_mtp_enabled_on_a_checkpoint_without_mtp_layers(verl_base, hf_dirs):
    msg = errors_of(make(verl_base, hf_dirs, hf="nomtp"))
    assert "actor_rollout_ref.model.mtp.enable=true" in msg and "num_nextn_predict_layers" in msg
    assert "actor_rollout_ref.model.path" in msg


def test_rollout_speculation_while_mtp_is_off(verl_base, hf_dirs):
    cfg = make(
        verl_base,
        hf_dirs,
        actor_rollout_ref__model__mtp__enable=False,
        actor_rollout_ref__model__mtp__enable_train=False,
    )
    msg = errors_of(cfg)
    assert "actor_rollout_ref.model.mtp.enable_rollout=true" in msg
    assert "actor_rollout_ref.model.mtp.enable=false" in msg


def test_a_second_k_in_speculative_config_is_refused(verl_base, hf_dirs):
    """verl hands vLLM the speculative_config's num_speculative_tokens over mtp.num_speculative_tokens, which the
    trainer's engine reads (its drafted estimate's k): a different value there is refused naming both keys; the same
    value is accepted."""
    spec = "actor_rollout_ref__rollout__engine_kwargs__vllm__speculative_config"
    msg = errors_of(make(verl_base, hf_dirs, **{spec: {"num_speculative_tokens": 3}}))
    assert "speculative_config.num_speculative_tokens=3 overrides actor_rollout_ref.model.mtp.num_speculative_tokens=2" in msg
    s = validate_verl_config(make(verl_base, hf_dirs, **{spec: {"num_speculative_tokens": 2}}))
    assert s.speculative_config["num_speculative_tokens"] == 2


def test_speculation_on_a_rollout_other_than_vllm_is_refused(verl_base, hf_dirs):
    """The drafter sync is vLLM's worker extension: another rollout engine with MTP speculation is refused naming
    the key; without speculation the rollout engine is verl's business."""
    msg = errors_of(make(verl_base, hf_dirs, actor_rollout_ref__rollout__name="sglang"))
    assert "actor_rollout_ref.rollout.name='sglang': the plugin's MTP drafter sync supports vLLM only" in msg
    assert "mtp.enable_rollout=false" in msg
    validate_verl_config(make(verl_base, hf_dirs, actor_rollout_ref__rollout__name="sglang",
                              actor_rollout_ref__model__mtp__enable_rollout=False))


def test_speculation_behind_verls_back_gets_level_2_sleep(verl_base, hf_dirs):
    """vLLM speculation through engine_kwargs only: verl 0.9.1 does not know MTP rollout is on and
    sleeps vLLM at level 2 (drafter weights discarded, acceptance 0 after wake-up)."""
    cfg = make(
        verl_base,
        hf_dirs,
        actor_rollout_ref__model__mtp__enable_rollout=False,
        actor_rollout_ref__rollout__engine_kwargs__vllm__speculative_config={"method": "mtp", "num_speculative_tokens": 3},
    )
    msg = errors_of(cfg)
    for key in (
        "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config",
        "actor_rollout_ref.rollout.free_cache_engine=True",
        "actor_rollout_ref.model.mtp.enable_rollout",
        "level 2",
    ):
        assert key in msg
    # without sleeping (free_cache_engine=false) the same setup is still refused (no drafter sync) but
    # the message no longer claims level-2 sleep
    cfg.actor_rollout_ref.rollout.free_cache_engine = False
    msg = errors_of(cfg)
    assert "level 2" not in msg and "speculative_config" in msg


def test_hybrid_speculation_with_prefix_caching_needs_mamba_cache_mode_align(verl_base, hf_dirs):
    cfg = make(
        verl_base,
        hf_dirs,
        actor_rollout_ref__rollout__enable_prefix_caching=True,
        actor_rollout_ref__rollout__engine_kwargs__vllm__mamba_cache_mode="all",
    )
    msg = errors_of(cfg)
    assert "actor_rollout_ref.rollout.engine_kwargs.vllm.mamba_cache_mode=align" in msg
    assert "actor_rollout_ref.rollout.enable_prefix_caching=true" in msg
    # engine_kwargs.vllm.enable_prefix_caching wins over rollout.enable_prefix_caching (it is spread last)
    cfg2 = make(
        verl_base,
        hf_dirs,
        actor_rollout_ref__rollout__engine_kwargs__vllm__enable_prefix_caching=True,
        actor_rollout_ref__rollout__engine_kwargs__vllm__mamba_cache_mode=None,
    )
    assert "actor_rollout_ref.rollout.engine_kwargs.vllm.enable_prefix_caching=true" in errors_of(cfg2)
    # fixes: align, or prefix caching off
    ok = make(
        verl_base,
        hf_dirs,
        actor_rollout_ref__rollout__enable_prefix_caching=True,
        actor_rollout_ref__rollout__engine_kwargs__vllm__mamba_cache_mode="align",
    )
    s = validate_verl_config(ok)
    assert s.prefix_caching is True and s.mamba_cache_mode == "align"
    s = validate_verl_config(make(verl_base, hf_dirs, actor_rollout_ref__rollout__engine_kwargs__vllm__mamba_cache_mode=None))
    assert s.prefix_caching is False


def test_plugin_model_type_with_fsdp_strategy(verl_base, hf_dirs):
    cfg = make(verl_base, hf_dirs, actor_rollout_ref__actor__strategy="fsdp", actor_rollout_ref__ref__strategy="fsdp")
    msg = errors_of(cfg)
    assert "actor_rollout_ref.actor.strategy='fsdp'" in msg and "model_engine=megatron" in msg
    assert "actor_rollout_ref.ref.strategy='fsdp'" in msg


def test_all_errors_are_collected_into_one_exception(verl_base, hf_dirs):
    cfg = make(
        verl_base,
        hf_dirs,
        hf="nomtp",
        actor_rollout_ref__actor__strategy="fsdp",
        actor_rollout_ref__rollout__enable_prefix_caching=True,
        actor_rollout_ref__rollout__engine_kwargs__vllm__mamba_cache_mode=None,
        actor_rollout_ref__model__external_lib=None,
    )
    msg = errors_of(cfg)
    assert msg.count("\n  - ") == 4
    for key in (
        "actor_rollout_ref.model.external_lib",
        "actor_rollout_ref.actor.strategy",
        "num_nextn_predict_layers",
        "mamba_cache_mode",
    ):
        assert key in msg


def test_repeated_mtp_layer_depth_must_match_the_checkpoint(verl_base, hf_dirs):
    key = "actor_rollout_ref__actor__megatron__override_transformer_config__"
    msg = errors_of(make(verl_base, hf_dirs, **{key + "mtp_num_layers": 2}))
    assert "override_transformer_config.mtp_num_layers=2" in msg and "mtp_use_repeated_layer=true" in msg
    s = validate_verl_config(
        make(verl_base, hf_dirs, **{key + "mtp_num_layers": 2, key + "mtp_use_repeated_layer": True})
    )
    assert s.mtp_num_layers == 2 and s.hf_mtp_layers == 1


def test_mtp_on_a_hybrid_model_without_the_plugin_engine(verl_base, hf_dirs):
    msg = errors_of(make(verl_base, hf_dirs, actor_rollout_ref__model__model_type="language_model"))
    assert "actor_rollout_ref.model.model_type=nemotron_h_mtp" in msg
    # MTP off on verl's own engine is not the plugin's business
    cfg = make(
        verl_base,
        hf_dirs,
        actor_rollout_ref__model__model_type="language_model",
        actor_rollout_ref__model__mtp__enable=False,
        actor_rollout_ref__model__mtp__enable_train=False,
        actor_rollout_ref__model__mtp__enable_rollout=False,
    )
    s = validate_verl_config(cfg)
    assert not s.engine_selected and s.mode is MTPMode.OFF and not s.rollout_speculation


def test_engine_level_settings_the_plugin_cannot_run(verl_base, hf_dirs):
    meg = "actor_rollout_ref__actor__megatron__"
    cfg = make(
        verl_base,
        hf_dirs,
        actor_rollout_ref__model__use_fused_kernels=True,
        **{
            meg + "vanilla_mbridge": True,
            meg + "context_parallel_size": 2,
            meg + "router_replay__mode": "R3",
            meg + "override_transformer_config__mtp_detach_heads": False,
            meg + "override_transformer_config__mtp_loss_scaling_factor": 0.5,
        },
    )
    msg = errors_of(cfg)
    for key in (
        "actor_rollout_ref.model.use_fused_kernels=true",
        "actor_rollout_ref.actor.megatron.vanilla_mbridge=true",
        "actor_rollout_ref.actor.megatron.context_parallel_size=2",
        "actor_rollout_ref.actor.megatron.router_replay.mode='R3'",
        "override_transformer_config.mtp_detach_heads=False contradicts mode 'online'",
        "override_transformer_config.mtp_loss_scaling_factor=0.5",
    ):
        assert key in msg, key


def test_lora_with_mtp_training(verl_base, hf_dirs):
    msg = errors_of(make(verl_base, hf_dirs, actor_rollout_ref__model__lora__rank=16))
    assert "actor_rollout_ref.model.lora.rank=16" in msg and "enable_train" in msg
    frozen = make(
        verl_base, hf_dirs, actor_rollout_ref__model__lora__rank=16, actor_rollout_ref__model__mtp__enable_train=False
    )
    assert validate_verl_config(frozen).mode is MTPMode.FROZEN


def test_frozen_drafter_sync_while_mtp_trains(verl_base, hf_dirs):
    env = "ray_kwargs__ray_init__runtime_env__env_vars__VERL_MTP_DRAFTER_SYNC"
    msg = errors_of(make(verl_base, hf_dirs, **{env: "frozen"}))
    assert "ray_kwargs.ray_init.runtime_env.env_vars.VERL_MTP_DRAFTER_SYNC=frozen" in msg and "stale" in msg
    assert "allowed values" in errors_of(make(verl_base, hf_dirs, **{env: "sometimes"}))
    frozen = make(verl_base, hf_dirs, actor_rollout_ref__model__mtp__enable_train=False, **{env: "frozen"})
    assert validate_verl_config(frozen).drafter_sync == "frozen"
    assert not [w for w in validate_verl_config(frozen).warnings if "VERL_MTP_DRAFTER_SYNC" in w]


def test_mode_frozen_without_the_frozen_drafter_sync_is_warned_about(verl_base, hf_dirs, monkeypatch):
    """Mode frozen with the drafter sync left at online: correct, but the drafter reloads unchanged weights every
    sync; the start-up check says so naming the key (a warning: `verl-mtp check --strict` refuses it)."""
    monkeypatch.delenv("VERL_MTP_DRAFTER_SYNC", raising=False)
    env = "ray_kwargs__ray_init__runtime_env__env_vars__VERL_MTP_DRAFTER_SYNC"
    for value, shown in ((None, "online (unset)"), ("online", "online")):
        extra = {} if value is None else {env: value}
        settings = validate_verl_config(make(verl_base, hf_dirs, actor_rollout_ref__model__mtp__enable_train=False,
                                             **extra))
        (w,) = [w for w in settings.warnings if "VERL_MTP_DRAFTER_SYNC" in w]
        assert f"ray_kwargs.ray_init.runtime_env.env_vars.VERL_MTP_DRAFTER_SYNC={shown} in mode frozen" in w
        assert "VERL_MTP_DRAFTER_SYNC=frozen to load them once" in w
    online = validate_verl_config(make(verl_base, hf_dirs))  # mode online reloads by design: no warning
    assert not [w for w in online.warnings if "VERL_MTP_DRAFTER_SYNC" in w]
    quiet = validate_verl_config(make(verl_base, hf_dirs, actor_rollout_ref__model__mtp__enable_train=False,
                                      actor_rollout_ref__model__mtp__enable_rollout=False))  # no drafter to sync
    assert not [w for w in quiet.warnings if "VERL_MTP_DRAFTER_SYNC" in w]


def test_drafter_sync_staging_place_is_checked_at_start_up(verl_base, hf_dirs):
    env = "ray_kwargs__ray_init__runtime_env__env_vars__VERL_MTP_SYNC_STAGE"
    msg = errors_of(make(verl_base, hf_dirs, **{env: "gpu"}))
    assert "ray_kwargs.ray_init.runtime_env.env_vars.VERL_MTP_SYNC_STAGE='gpu'" in msg and "device, host" in msg
    validate_verl_config(make(verl_base, hf_dirs, **{env: "host"}))  # accepted


def test_enable_train_without_enable(verl_base, hf_dirs):
    cfg = make(verl_base, hf_dirs, actor_rollout_ref__model__mtp__enable=False, actor_rollout_ref__model__mtp__enable_rollout=False)
    msg = errors_of(cfg)
    assert "actor_rollout_ref.model.mtp.enable_train=true needs actor_rollout_ref.model.mtp.enable=true" in msg


def test_engine_side_check_on_verls_real_dataclasses(hf_dirs):
    """What the engine constructor runs: verl HFModelConfig (loads the HF config) + McoreEngineConfig."""
    from verl.workers.config import HFModelConfig, McoreEngineConfig, MtpConfig

    online = MtpConfig(enable=True, enable_train=True, detach_encoder=True, mtp_loss_scaling_factor=0.2)
    mc = HFModelConfig(path=hf_dirs["mtp"], load_tokenizer=False, mtp=online)
    s = resolve_engine_settings(mc, McoreEngineConfig())
    assert s.mode is MTPMode.ONLINE and s.mtp_loss_scaling_factor == 0.2 and s.set_scaling_factor
    assert s.draft_k is None  # vLLM does not draft: the drafted estimate drafts as many as the MTP depths
    drafting = dataclasses.replace(online, enable_rollout=True, num_speculative_tokens=3)
    s = resolve_engine_settings(HFModelConfig(path=hf_dirs["mtp"], load_tokenizer=False, mtp=drafting), McoreEngineConfig())
    assert s.draft_k == 3  # vLLM's k reaches the engine's drafted estimate

    # verl's reference model: MtpConfig(enable=False) -> off, whatever the actor overrides say
    ref = HFModelConfig(path=hf_dirs["mtp"], load_tokenizer=False, mtp=MtpConfig(enable=False))
    s = resolve_engine_settings(ref, McoreEngineConfig(forward_only=True, override_transformer_config={"mtp_num_layers": 2}))
    assert s.mode is MTPMode.OFF and s.mtp_loss_scaling_factor is None

    bad = HFModelConfig(path=hf_dirs["nomtp"], load_tokenizer=False, mtp=online)
    with pytest.raises(MTPConfigError, match="num_nextn_predict_layers"):
        resolve_engine_settings(bad, McoreEngineConfig())
    with pytest.raises(MTPConfigError, match="use_fused_kernels"):
        resolve_engine_settings(mc, McoreEngineConfig(use_fused_kernels=True))


def test_apply_mtp_overrides_writes_the_mode_fields(hf_dirs):
    from verl.workers.config import HFModelConfig, McoreEngineConfig, MtpConfig

    from verl_mtp_plugin.engine.settings import LATENT_MOE_OVERRIDES as LATENT  # the test checkpoint's MoE is latent

    def overrides_for(mtp, existing=None):
        mc = HFModelConfig(path=hf_dirs["mtp"], load_tokenizer=False, mtp=mtp)
        ec = McoreEngineConfig(override_transformer_config=dict(existing or {}))
        return apply_mtp_overrides(dict(ec.override_transformer_config), resolve_engine_settings(mc, ec))

    assert overrides_for(MtpConfig(enable=True, enable_train=True, detach_encoder=True)) == {
        "mtp_detach_heads": True,
        "mtp_loss_scaling_factor": 0.1,
        **LATENT,
    }
    assert overrides_for(MtpConfig(enable=True, mtp_loss_scaling_factor=0.3)) == {
        "mtp_detach_heads": False,
        "mtp_loss_scaling_factor": 0.3,
        **LATENT,
    }
    # off: Megatron-Bridge would re-append the checkpoint's MTP pattern unless it is cleared too
    assert overrides_for(MtpConfig(enable=False)) == {
        "mtp_num_layers": None, "mtp_hybrid_override_pattern": None, "mtp_use_repeated_layer": False, **LATENT
    }
    # a factor already in override_transformer_config is verl's (check_mtp_config keeps it): not rewritten
    assert overrides_for(
        MtpConfig(enable=True, enable_train=True, mtp_loss_scaling_factor=0.3), {"mtp_loss_scaling_factor": 0.3}
    ) == {"mtp_loss_scaling_factor": 0.3, "mtp_detach_heads": False, **LATENT}


def test_preflight_cli_composes_and_reports(tmp_path, hf_dirs, capsys):
    (tmp_path / "bad.yaml").write_text(
        "hydra:\n  searchpath:\n    - pkg://verl.trainer.config\n"
        "defaults:\n  - ppo_trainer\n  - _self_\n  - override model_engine: megatron\n"
        "actor_rollout_ref:\n  model:\n"
        f"    path: {hf_dirs['nomtp']}\n    external_lib: verl_mtp_plugin\n    model_type: {MODEL_TYPE}\n"
        "    mtp:\n      enable: true\n"
        "  rollout:\n    name: vllm\n"
    )
    assert main(["--config-path", str(tmp_path), "--config-name", "bad"]) == 1
    assert "num_nextn_predict_layers" in capsys.readouterr().err
    assert main(
        ["--config-path", str(tmp_path), "--config-name", "bad", f"actor_rollout_ref.model.path={hf_dirs['mtp']}"]
    ) == 0
    out = capsys.readouterr().out
    assert "mode: frozen" in out and "engine_selected: True" in out


def test_trainer_mode_rollout_metrics_and_guard_block(verl_base, hf_dirs):
    # verl's own sync trainer: valid, but no plugin rollout metrics
    s = validate_verl_config(make(verl_base, hf_dirs))
    assert s.trainer_mode == "sync" and not s.rollout_metrics
    s = validate_verl_config(make(verl_base, hf_dirs, trainer__v1__trainer_mode="mtp_sync"))
    assert s.trainer_mode == "mtp_sync" and s.rollout_metrics
    # speculation off: the plugin trainer runs, there is nothing to measure
    off = make(verl_base, hf_dirs, trainer__v1__trainer_mode="mtp_sync", actor_rollout_ref__model__mtp__enable_rollout=False)
    assert not validate_verl_config(off).rollout_metrics

    msg = errors_of(make(verl_base, hf_dirs, trainer__v1__trainer_mode="mtp_synk"))
    assert "trainer.v1.trainer_mode='mtp_synk' is not a plugin trainer" in msg and "mtp_sync" in msg
    msg = errors_of(make(verl_base, hf_dirs, trainer__v1__trainer_mode="mtp_sync", trainer__use_v1=False))
    assert "trainer.v1.trainer_mode=mtp_sync needs verl's v1 trainer" in msg and "trainer.use_v1=true" in msg
    # the guard block's errors join the same message, each with its full key
    msg = errors_of(
        make(verl_base, hf_dirs, trainer__v1__trainer_mode="mtp_foo", verl_mtp_plugin__mtp_guard__patience=0,
             verl_mtp_plugin__mtp_guard__actoin="fail")
    )
    assert "trainer.v1.trainer_mode='mtp_foo'" in msg
    assert "verl_mtp_plugin.mtp_guard.patience" in msg and "verl_mtp_plugin.mtp_guard.actoin: unknown key" in msg
    # the verify-step cost table too: refused at start-up naming the key
    msg = errors_of(make(verl_base, hf_dirs, verl_mtp_plugin__mtp_guard__verify_cost=[1.3, 1.2]))
    assert "verl_mtp_plugin.mtp_guard.verify_cost: costs [1.3, 1.2] decrease with k" in msg
    msg = errors_of(make(verl_base, hf_dirs, actor_rollout_ref__rollout__mtp_guard__action="fail"))
    assert "actor_rollout_ref.rollout.mtp_guard is not a verl key" in msg


def test_sample_poll_interval_is_checked_at_start_up(verl_base, hf_dirs):
    validate_verl_config(make(verl_base, hf_dirs, trainer__v1__trainer_mode="mtp_sync",
                              verl_mtp_plugin__sample_poll_s=0.2))
    for bad in (0, -1, "soon", True, float("inf")):
        msg = errors_of(make(verl_base, hf_dirs, trainer__v1__trainer_mode="mtp_sync", verl_mtp_plugin__sample_poll_s=bad))
        assert f"verl_mtp_plugin.sample_poll_s={bad!r}" in msg and "must be a number > 0" in msg


def test_mamba_cache_mode_without_prefix_caching_is_refused_not_dropped(verl_base, hf_dirs):
    """vLLM resets any mamba_cache_mode to 'none' when prefix caching is off (only a log line)."""
    for mode in ("align", "all"):
        msg = errors_of(make(verl_base, hf_dirs, actor_rollout_ref__rollout__engine_kwargs__vllm__mamba_cache_mode=mode))
        assert f"actor_rollout_ref.rollout.engine_kwargs.vllm.mamba_cache_mode='{mode}' with prefix caching off" in msg
        assert "actor_rollout_ref.rollout.enable_prefix_caching=false" in msg and "no effect" in msg
    s = validate_verl_config(
        make(verl_base, hf_dirs, actor_rollout_ref__rollout__engine_kwargs__vllm__mamba_cache_mode="none")
    )
    assert s.mamba_cache_mode == "none"


def test_quantized_rollout_with_the_plugins_drafter_sync_is_refused(verl_base, hf_dirs):
    msg = errors_of(make(verl_base, hf_dirs, actor_rollout_ref__rollout__quantization="fp8"))
    assert "actor_rollout_ref.rollout.quantization='fp8'" in msg and "worker_extension_cls" in msg
    msg = errors_of(make(verl_base, hf_dirs, actor_rollout_ref__actor__megatron__qat__enable=True))
    assert "actor_rollout_ref.actor.megatron.qat.enable=true" in msg
    # without MTP speculation there is no drafter sync: allowed
    validate_verl_config(
        make(verl_base, hf_dirs, actor_rollout_ref__rollout__quantization="fp8", actor_rollout_ref__model__mtp__enable_rollout=False)
    )


def test_virtual_pipeline_parallelism_is_refused(verl_base, hf_dirs):
    msg = errors_of(make(verl_base, hf_dirs, actor_rollout_ref__actor__megatron__virtual_pipeline_model_parallel_size=1))
    assert "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=1" in msg
    # the reference model and mode off too (Megatron-Bridge asserts for every hybrid build)
    msg = errors_of(
        make(
            verl_base,
            hf_dirs,
            actor_rollout_ref__model__mtp__enable=False,
            actor_rollout_ref__model__mtp__enable_train=False,
            actor_rollout_ref__model__mtp__enable_rollout=False,
            actor_rollout_ref__actor__megatron__virtual_pipeline_model_parallel_size=2,
        )
    )
    assert "virtual_pipeline_model_parallel_size=2" in msg


def test_critic_on_an_mtp_checkpoint_must_clear_the_bridge_mtp_pattern(verl_base, hf_dirs):
    crit = "critic__megatron__override_transformer_config__"
    base = dict(algorithm__adv_estimator="gae", critic__strategy="megatron", critic__model__path=hf_dirs["mtp"])
    msg = errors_of(make(verl_base, hf_dirs, **base))
    assert "critic.megatron.override_transformer_config.mtp_hybrid_override_pattern is not null" in msg
    assert "num_nextn_predict_layers=1" in msg
    ok = validate_verl_config(make(verl_base, hf_dirs, **base, **{crit + "mtp_hybrid_override_pattern": None}))
    assert ok.mode is MTPMode.ONLINE
    # a checkpoint without MTP layers needs nothing; GRPO (no critic) needs nothing
    validate_verl_config(make(verl_base, hf_dirs, **{**base, "critic__model__path": hf_dirs["nomtp"]}))
    validate_verl_config(make(verl_base, hf_dirs, **{**base, "algorithm__adv_estimator": "grpo"}))
    # critic.enable wins over the estimator (verl's need_critic)
    assert "mtp_hybrid_override_pattern" in errors_of(
        make(verl_base, hf_dirs, **{**base, "algorithm__adv_estimator": "grpo"}, critic__enable=True)
    )
    msg = errors_of(
        make(
            verl_base,
            hf_dirs,
            **base,
            **{crit + "mtp_hybrid_override_pattern": None},
            critic__megatron__virtual_pipeline_model_parallel_size=2,
            critic__model__mtp__enable=True,
        )
    )
    assert "critic.megatron.virtual_pipeline_model_parallel_size=2" in msg and "critic.model.mtp.enable=true" in msg


def test_quantized_checkpoint_with_the_plugins_drafter_sync_is_refused(verl_base, hf_dirs, tmp_path):
    """An FP8 (or any quantized) checkpoint: the sync exports bf16 MTP tensors into a quantized drafter."""
    import json
    import pathlib

    fp8 = pathlib.Path(write_hf_dir(tmp_path / "fp8", 1))
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    dirs = {**hf_dirs, "fp8": str(fp8)}
    msg = errors_of(make(verl_base, dirs, hf="fp8"))
    assert "actor_rollout_ref.model.path is quantized (quantization_config.quant_method='fp8')" in msg
    assert "actor_rollout_ref.model.mtp.enable_rollout=false" in msg
    validate_verl_config(make(verl_base, dirs, hf="fp8", actor_rollout_ref__model__mtp__enable_rollout=False))
    validate_verl_config(make(verl_base, hf_dirs))  # the bf16 checkpoint: accepted


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_checksum_mode_with_a_sharded_rollout_is_refused_at_start_up(verl_base, hf_dirs, monkeypatch, tp, ep):
    """Checksum mode compares whole tensors; at vLLM TP/EP > 1 each rank holds a shard of the drafter."""
    env = "ray_kwargs__ray_init__runtime_env__env_vars__VERL_MTP_SYNC_CHECKSUM"
    monkeypatch.delenv("VERL_MTP_SYNC_CHECKSUM", raising=False)
    sharded = {"actor_rollout_ref__rollout__tensor_model_parallel_size": tp,
               "actor_rollout_ref__rollout__expert_parallel_size": ep}
    msg = errors_of(make(verl_base, hf_dirs, **{env: "1"}, **sharded))
    assert "ray_kwargs.ray_init.runtime_env.env_vars.VERL_MTP_SYNC_CHECKSUM=1" in msg
    assert (f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}, "
            f"actor_rollout_ref.rollout.expert_parallel_size={ep}") in msg
    whole = {"actor_rollout_ref__rollout__tensor_model_parallel_size": 1,
             "actor_rollout_ref__rollout__expert_parallel_size": 1}
    validate_verl_config(make(verl_base, hf_dirs, **{env: "1"}, **whole))  # TP=EP=1: whole tensors, accepted
    validate_verl_config(make(verl_base, hf_dirs, **{env: "0"}, **sharded))  # off: accepted
    # set in the driver's own environment (Ray hands it to the workers) counts too
    monkeypatch.setenv("VERL_MTP_SYNC_CHECKSUM", "true")
    assert "VERL_MTP_SYNC_CHECKSUM (this process's environment)=true" in errors_of(make(verl_base, hf_dirs, **sharded))


def test_checksum_mode_on_a_sharded_vllm_rank_is_refused_by_the_drafter_sync():
    """The worker side refuses too (the check verl's start-up cannot make for a hand-set extension option)."""
    from types import SimpleNamespace

    from verl_mtp_plugin.rollout.worker.drafter_sync import MTPDrafterSync, MTPSyncError, sharded_drafter

    def vc(tp, ep):
        return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp, enable_expert_parallel=ep))

    assert sharded_drafter(vc(1, False)) is None and sharded_drafter(None) is None
    assert sharded_drafter(vc(2, True)) == "tensor_parallel_size=2, enable_expert_parallel=true"
    sync = MTPDrafterSync.__new__(MTPDrafterSync)  # the property alone: no drafter needed
    sync.vllm_config = vc(2, False)
    with pytest.raises(MTPSyncError, match="VERL_MTP_SYNC_CHECKSUM=1 .*shard of the drafter .*tensor_parallel_size=2") as e:
        sync.verify_checksums = True
    assert e.value.phase == "config"
    sync.verify_checksums = False
    assert sync.verify_checksums is False
    sync.vllm_config = vc(1, False)
    sync.verify_checksums = True
    assert sync.verify_checksums is True


# --------------------------------------------------------------------------- MTP objective, drafting method

_OBJ = "ray_kwargs__ray_init__runtime_env__env_vars__VERL_MTP_OBJECTIVE"
_DRAFT = "actor_rollout_ref__rollout__engine_kwargs__vllm__speculative_config__draft_sample_method"


@pytest.mark.parametrize("objective", ["hard_ce", "soft_ce", "tv", "chained_tv"])
def test_objective_is_read_from_the_recipe_and_resolved(verl_base, hf_dirs, objective, monkeypatch):
    monkeypatch.delenv("VERL_MTP_OBJECTIVE", raising=False)
    assert validate_verl_config(make(verl_base, hf_dirs)).objective == "hard_ce"  # unset: megatron's own loss
    s = validate_verl_config(make(verl_base, hf_dirs, **{_OBJ: objective.upper()}))
    assert s.objective == objective and s.mode is MTPMode.ONLINE


def test_objective_errors_name_the_key(verl_base, hf_dirs):
    key = "ray_kwargs.ray_init.runtime_env.env_vars.VERL_MTP_OBJECTIVE"
    msg = errors_of(make(verl_base, hf_dirs, **{_OBJ: "kl"}))
    assert f"{key}='kl'; allowed: hard_ce, soft_ce, tv, chained_tv" in msg
    assert f"{key}='chained-tv'; allowed:" in errors_of(make(verl_base, hf_dirs, **{_OBJ: "chained-tv"}))
    frozen = make(verl_base, hf_dirs, actor_rollout_ref__model__mtp__enable_train=False, **{_OBJ: "tv"})
    assert f"{key}=tv trains the MTP block, but mode 'frozen' never trains it" in errors_of(frozen)
    validate_verl_config(make(verl_base, hf_dirs, actor_rollout_ref__model__mtp__enable_train=False, **{_OBJ: "hard_ce"}))
    greedy = make(verl_base, hf_dirs, actor_rollout_ref__rollout__temperature=0.0, **{_OBJ: "soft_ce"})
    assert f"{key}=soft_ce matches the policy's distribution at the rollout temperature" in errors_of(greedy)
    assert "actor_rollout_ref.rollout.temperature=0.0" in errors_of(greedy)
    greedy = make(verl_base, hf_dirs, actor_rollout_ref__rollout__temperature=0.0, **{_OBJ: "chained_tv"})
    assert f"{key}=chained_tv matches the policy's distribution at the rollout temperature" in errors_of(greedy)
    frozen = make(verl_base, hf_dirs, actor_rollout_ref__model__mtp__enable_train=False, **{_OBJ: "chained_tv"})
    assert f"{key}=chained_tv trains the MTP block, but mode 'frozen' never trains it" in errors_of(frozen)


def test_engine_reads_the_objective_from_its_environment(hf_dirs, monkeypatch):
    """Every worker gets the recipe's Ray environment: the actor's engine trains with it; verl's reference model
    (MTP off) shares the environment and just runs without MTP; a bad value fails the engine naming the key."""
    from verl.workers.config import HFModelConfig, McoreEngineConfig, MtpConfig

    monkeypatch.setenv("VERL_MTP_OBJECTIVE", "tv")
    online = HFModelConfig(path=hf_dirs["mtp"], load_tokenizer=False,
                           mtp=MtpConfig(enable=True, enable_train=True, detach_encoder=True))
    assert resolve_engine_settings(online, McoreEngineConfig()).objective == "tv"
    ref = HFModelConfig(path=hf_dirs["mtp"], load_tokenizer=False, mtp=MtpConfig(enable=False))
    s = resolve_engine_settings(ref, McoreEngineConfig(forward_only=True))
    assert s.mode is MTPMode.OFF and s.objective == "hard_ce"
    monkeypatch.setenv("VERL_MTP_OBJECTIVE", "l2")
    with pytest.raises(MTPConfigError, match="VERL_MTP_OBJECTIVE='l2'"):
        resolve_engine_settings(online, McoreEngineConfig())


def test_drafting_method_is_validated_and_its_memory_named(verl_base, hf_dirs):
    s = validate_verl_config(make(verl_base, hf_dirs))
    assert s.draft_sample_method == "greedy" and "token ids only" in s.draft_memory  # vLLM's default
    s = validate_verl_config(make(verl_base, hf_dirs, actor_rollout_ref__rollout__max_num_seqs=64,
                                  **{_DRAFT: "probabilistic"}))
    assert s.draft_sample_method == "probabilistic" and s.speculative_config["draft_sample_method"] == "probabilistic"
    assert s.draft_memory == "draft probabilities max_num_seqs 64 x k 2 x vocab 128 x 4 B (float32) = 0.1 MiB per decode step"
    msg = errors_of(make(verl_base, hf_dirs, **{_DRAFT: "typical"}))
    assert ("actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.draft_sample_method='typical': allowed "
            "values are greedy, probabilistic") in msg
    off = make(verl_base, hf_dirs, actor_rollout_ref__model__mtp__enable_rollout=False)
    assert validate_verl_config(off).draft_sample_method is None


@pytest.mark.parametrize("off", ["enable_rollout", "enable"])
def test_a_drafting_method_without_verls_speculation_says_to_drop_the_key(verl_base, hf_dirs, off):
    """The recipes set speculative_config.draft_sample_method; mode off on top of them (mtp.enable=false or
    mtp.enable_rollout=false) leaves a speculative config that enables nothing, which verl would hand to vLLM
    untouched: the start-up check says so and names both fixes."""
    keys = {"actor_rollout_ref__model__mtp__enable_rollout": False}
    if off == "enable":
        keys.update(actor_rollout_ref__model__mtp__enable=False, actor_rollout_ref__model__mtp__enable_train=False)
    msg = errors_of(make(verl_base, hf_dirs, **keys, **{_DRAFT: "probabilistic"}))
    vllm = "actor_rollout_ref.rollout.engine_kwargs.vllm"
    assert (f"{vllm}.speculative_config.draft_sample_method=probabilistic only tunes MTP speculation, but verl does "
            "not speculate (actor_rollout_ref.model.mtp.enable=") in msg
    assert f"add the Hydra override ~{vllm}.speculative_config" in msg
    assert ("or speculate with actor_rollout_ref.model.mtp.enable=true and "
            "actor_rollout_ref.model.mtp.enable_rollout=true") in msg
    assert "behind verl's back" not in msg and "prefix caching" not in msg  # this one error, not speculation's
    # the fixes: drop the key (mode off) or let verl speculate
    assert validate_verl_config(make(verl_base, hf_dirs, **keys)).rollout_speculation is False
    assert validate_verl_config(make(verl_base, hf_dirs, **{_DRAFT: "probabilistic"})).draft_sample_method == "probabilistic"


def test_allowed_drafting_methods_are_vllms():
    import typing

    from vllm.config.speculative import DraftSampleMethod, SpeculativeConfig

    from verl_mtp_plugin.config_keys import DRAFT_METHOD_ESTIMATE_METRIC

    assert set(typing.get_args(DraftSampleMethod)) == set(DRAFT_METHOD_ESTIMATE_METRIC)
    assert SpeculativeConfig.__dataclass_fields__["draft_sample_method"].default == "greedy"


def test_shared_expert_overlap_with_a_latent_moe_checkpoint_is_refused_at_start_up(verl_base, hf_dirs):
    """megatron-core refuses the shared-expert overlap with latent MoE outside its NVLS inference dispatcher (every
    verl pass): set explicitly, it is refused before any worker starts, naming the key; unset or false, the run
    starts (the plugin engine turns it off)."""
    from verl_mtp_plugin.engine.settings import EngineMTPSettings, apply_mtp_overrides, hf_latent_moe

    key = "actor_rollout_ref__actor__megatron__override_transformer_config__moe_shared_expert_overlap"
    msg = errors_of(make(verl_base, hf_dirs, **{key: True}))
    assert "override_transformer_config.moe_shared_expert_overlap=True" in msg and "latent" in msg
    for value in (False, None):
        cfg = make(verl_base, hf_dirs, **({key: value} if value is not None else {}))
        validate_verl_config(cfg)
    import json
    import pathlib

    hf = json.loads((pathlib.Path(hf_dirs["mtp"]) / "config.json").read_text())
    assert hf_latent_moe(hf) and not hf_latent_moe({**hf, "moe_latent_size": None})
    for mode in MTPMode:
        written = apply_mtp_overrides({}, EngineMTPSettings(mode, None, False, latent_moe=True))
        assert written["moe_shared_expert_overlap"] is False
        assert "moe_shared_expert_overlap" not in apply_mtp_overrides({}, EngineMTPSettings(mode, None, False))
