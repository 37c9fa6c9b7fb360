"""One reader of the verl config (verl_mtp_plugin.verl_config), one start-up check for every entry point, and the
probes of the private internals the plugin relies on (verl_mtp_plugin.compat.probes).

Real verl config composition (verl's ppo_trainer and the shipped recipes through Hydra), verl's own helpers for
parity; no trainer run.
"""

from __future__ import annotations

import itertools
import types

import pytest

from verl_mtp_plugin import verl_config
from verl_mtp_plugin.testing import config_with
from verl_mtp_plugin.compat import probes, verl_entry
from verl_mtp_plugin.policy import MTPConfigError
from verl_mtp_plugin.recipe_paths import CONFIG_DIR
from verl_mtp_plugin.trainer.config import compose_ppo_trainer, compose_recipe, startup_check, validate_verl_config

SPEC = "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config"
COMP = "actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config"
ENV = "ray_kwargs.ray_init.runtime_env.env_vars"


@pytest.fixture(scope="module")
def base():
    return compose_ppo_trainer(["model_engine=megatron", "actor_rollout_ref.rollout.name=vllm"])


with_ = config_with  # verl_mtp_plugin.testing


def online(overrides=()):
    return compose_recipe(str(CONFIG_DIR), "grpo_online", list(overrides))


# ------------------------------------------------------------------------------------- parity with verl


@pytest.mark.parametrize("user", [None, {"draft_sample_method": "probabilistic"}, '{"draft_sample_method": "greedy"}',
                                  {"num_speculative_tokens": 3, "draft_sample_method": None}])
def test_speculative_config_is_verls_build_mtp_speculative_config(base, user):
    from verl.workers.rollout.vllm_rollout.utils import build_mtp_speculative_config

    upd = {"actor_rollout_ref__model__mtp__enable": True, "actor_rollout_ref__model__mtp__enable_rollout": True,
           "actor_rollout_ref__model__mtp__num_speculative_tokens": 2}
    if user is not None:
        upd[SPEC.replace(".", "__")] = user
    cfg = with_(base, **upd)
    assert verl_config.speculative_config(cfg) == build_mtp_speculative_config("mtp", 2, user)


def test_speculative_config_calls_verls_helper(base, monkeypatch):
    import verl.workers.rollout.vllm_rollout.utils as vu

    seen = []
    monkeypatch.setattr(vu, "build_mtp_speculative_config", lambda *a: seen.append(a) or {"from": "verl"})
    cfg = with_(base, actor_rollout_ref__model__mtp__enable=True, actor_rollout_ref__model__mtp__enable_rollout=True)
    assert verl_config.speculative_config(cfg) == {"from": "verl"} and seen == [("mtp", 1, None)]


def test_sleep_level_is_verls_resolve_sleep_level(base):
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    for enable, rollout, rank, lrank, merge, free in itertools.product((False, True), (False, True), (0, 8), (0, 4),
                                                                       (False, True), (False, True)):
        cfg = with_(base, actor_rollout_ref__model__mtp__enable=enable, actor_rollout_ref__model__mtp__enable_rollout=rollout,
                    actor_rollout_ref__model__lora_rank=rank, actor_rollout_ref__model__lora__rank=lrank,
                    actor_rollout_ref__model__lora__merge=merge, actor_rollout_ref__rollout__free_cache_engine=free)
        model = types.SimpleNamespace(lora_rank=rank, lora={"rank": lrank, "merge": merge})
        server = types.SimpleNamespace(config=types.SimpleNamespace(mtp=cfg.actor_rollout_ref.model.mtp),
                                       lora_as_adapter=vLLMHttpServer.lora_as_adapter.fget(
                                           types.SimpleNamespace(model_config=model)))
        verl_level = vLLMHttpServer._resolve_sleep_level(server) if free else None  # verl sleeps only then
        assert verl_config.sleep_level(cfg) == verl_level, (enable, rollout, rank, lrank, merge, free)
    # the start-up check reports the same level
    assert validate_verl_config(online()).sleep_level == 1


# ------------------------------------------------------------------ the three speculative_config readers agree


def test_a_drafting_method_only_block_does_not_switch_speculation_on_for_any_reader(base):
    from verl_mtp_plugin.rollout.monitor.desync_guard import guard_from_verl_config

    cfg = with_(base, **{SPEC.replace(".", "__"): {"draft_sample_method": "probabilistic"}})
    assert not verl_config.speculation_on(cfg)
    assert verl_config.draft_estimate_metric(cfg) is None
    assert guard_from_verl_config(cfg).speculation is False  # the guard said True before the one reader
    assert verl_config.speculative_config(cfg) is None
    # with verl's speculation on, all of them see it with the block's method
    on = with_(cfg, actor_rollout_ref__model__mtp__enable=True, actor_rollout_ref__model__mtp__enable_rollout=True)
    guard = guard_from_verl_config(on)
    assert guard.speculation is True and guard.config is not None
    assert verl_config.draft_estimate_metric(on) == "actor/mtp_expected_accept_rate"
    assert verl_config.speculative_config(on)["draft_sample_method"] == "probabilistic"


# ----------------------------------------------------------------------- bad values refused naming their key


@pytest.mark.parametrize("overrides,needle", [
    ([f"~{SPEC}", f"+{SPEC}='{{not json'"], f"{SPEC}='{{not json' is not valid JSON"),
    ([f"~{COMP}", f"+{COMP}='[1, 2]'"], f"{COMP}='[1, 2]': must be a mapping"),
    ([f"+{ENV}.VERL_MTP_SYNC_RECV_TIMEOUT_S=soon"], f"{ENV}.VERL_MTP_SYNC_RECV_TIMEOUT_S='soon': must be a number"),
    ([f"+{ENV}.VERL_MTP_SYNC_CHECKSUM=maybe"], f"{ENV}.VERL_MTP_SYNC_CHECKSUM='maybe': allowed values"),
])
def test_bad_values_are_refused_at_start_up_naming_the_key(overrides, needle):
    with pytest.raises(MTPConfigError) as e:
        validate_verl_config(online(overrides))
    assert needle in str(e.value)


def test_settings_in_the_drivers_environment_are_checked_too(monkeypatch):
    monkeypatch.setenv("VERL_MTP_SYNC_STAGE", "gpu")
    with pytest.raises(MTPConfigError) as e:
        validate_verl_config(online())
    assert "VERL_MTP_SYNC_STAGE (this process's environment)='gpu': allowed values are device, host" in str(e.value)
    monkeypatch.setenv("VERL_MTP_SYNC_RECV_TIMEOUT_S", "-1")
    with pytest.raises(MTPConfigError) as e:
        validate_verl_config(online())
    assert "VERL_MTP_SYNC_RECV_TIMEOUT_S (this process's environment)='-1'" in str(e.value)
    # the recipe's env_vars win over the driver's environment (Ray gives them precedence)
    monkeypatch.delenv("VERL_MTP_SYNC_RECV_TIMEOUT_S")
    validate_verl_config(online([f"+{ENV}.VERL_MTP_SYNC_STAGE=host"]))


def test_drafter_settings_without_speculation_are_warned_about(caplog):
    cfg = online(["actor_rollout_ref.model.mtp.enable_rollout=false", f"~{SPEC}", f"+{ENV}.VERL_MTP_SYNC_STAGE=host"])
    validate_verl_config(cfg)
    assert f"{ENV}.VERL_MTP_SYNC_STAGE set but vLLM does not speculate" in caplog.text


# --------------------------------------------------------------------- one check for every entry point


BAD = [f"+{ENV}.VERL_MTP_SYNC_STAGE=gpu", "actor_rollout_ref.model.mtp.enable=false"]


def _hook_message(cfg, monkeypatch):
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    calls = []
    monkeypatch.setattr(PPOTrainer, "_init_dataloader", lambda self: calls.append(self), raising=True)
    assert verl_entry.install(startup_check) and verl_entry.installed()
    trainer = types.SimpleNamespace(config=cfg)
    try:
        PPOTrainer._init_dataloader(trainer)
    except MTPConfigError as e:
        assert calls == []  # refused before verl's own step (and so before any worker)
        return str(e)
    assert calls == [trainer]
    return None


def test_every_entry_point_refuses_the_same_config_with_the_same_message(monkeypatch, tmp_path, capsys):
    from verl_mtp_plugin.cli import main as cli_main
    from verl_mtp_plugin.trainer.main_ppo import check as plugin_entry_check

    with pytest.raises(MTPConfigError) as e:
        plugin_entry_check(online(BAD))
    plugin_msg = str(e.value)
    assert "VERL_MTP_SYNC_STAGE='gpu'" in plugin_msg and "enable_train=true needs" in plugin_msg
    assert _hook_message(online(BAD), monkeypatch) == plugin_msg  # python -m verl.trainer.main_ppo
    assert cli_main(["check", str(CONFIG_DIR / "grpo_online.yaml"), *BAD]) == 2  # verl-mtp check
    assert plugin_msg in capsys.readouterr().err
    # and a good config passes the hook into verl's own step
    monkeypatch.delenv(verl_entry.DRIVER_CHECKED_ENV, raising=False)
    assert _hook_message(online(), monkeypatch) is None


def test_the_hook_is_installed_by_the_plugins_import_in_verls_task_runner():
    """verl's trainer imports external_lib (HFModelConfig in _init_tokenizer) with its trainer base loaded."""
    import subprocess
    import sys

    code = ("import verl.trainer.ppo.v1.trainer_base, importlib; importlib.import_module('verl_mtp_plugin'); "
            "from verl_mtp_plugin.compat import verl_entry; print(verl_entry.installed())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]


# --------------------------------------------------------------------------------------- private joints


def test_the_private_joints_probe_clean_on_the_tested_releases():
    probes.probe_all()
    assert {j.lib for j in probes.JOINTS} == {"verl", "megatron"} | ({"vllm"} & {j.lib for j in probes.JOINTS})


def test_a_missing_private_name_fails_the_start_up_check_naming_it(monkeypatch):
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    monkeypatch.delattr(vLLMColocateWorkerExtension, "_update_weights")
    with pytest.raises(probes.CompatError) as e:
        startup_check(online())
    msg = str(e.value)
    assert "vLLMColocateWorkerExtension._update_weights is missing in the installed verl" in msg
    assert "installed: verl 0.9.1" in msg and "tested with verl 0.9.1" in msg


def test_a_changed_signature_fails_naming_the_parameters(monkeypatch):
    import megatron.core.transformer.multi_token_prediction as mtp

    monkeypatch.setattr(mtp, "roll_tensor", lambda tensor, shift=-1: tensor)
    with pytest.raises(probes.CompatError) as e:
        probes.probe_all(("megatron",))
    assert "roll_tensor(tensor, shift=-1): the plugin expects parameters (tensor, shifts, dims" in str(e.value)


def test_the_objective_patches_megatron_only_through_compat():
    import pathlib

    import verl_mtp_plugin.objective as objective

    src = pathlib.Path(objective.__file__).read_text()
    assert "replace_language_model_loss" in src and ".compute_language_model_loss =" not in src
