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
VLLM = "actor_rollout_ref.rollout.engine_kwargs.vllm"


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
    # Ray's runtime_env takes strings only: ray.init stopped with a TypeError that named no key
    ([f"+{ENV}.VERL_MTP_SYNC_CHECKSUM=1"], f"{ENV}.VERL_MTP_SYNC_CHECKSUM=1: Ray's runtime_env takes strings only"),
    ([f"+{ENV}.SOME_VAR=null"], f"{ENV}.SOME_VAR=None: Ray's runtime_env takes strings only"),
    # speculation without the plugin's drafter sync: verl's own extension finds no drafter on vLLM's V2 runner
    ([f"~{VLLM}.worker_extension_cls"], f"({VLLM}.worker_extension_cls unset: verl's own worker extension"),
    ([f"{VLLM}.worker_extension_cls=verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"],
     "is not the plugin's worker extension or a subclass of it"),
])
def test_bad_values_are_refused_at_start_up_naming_the_key(overrides, needle):
    with pytest.raises(MTPConfigError) as e:
        validate_verl_config(online(overrides))
    assert needle in str(e.value)


def test_a_subclass_of_the_plugins_worker_extension_is_accepted_and_refused_like_it(tmp_path, monkeypatch):
    """A user's subclass (the CPU runtime and the GPU benchmarks have theirs) is the plugin's drafter sync: accepted,
    and a quantized rollout with it is refused as with the plugin's own path (its drafter would be reloaded with
    bf16 weights)."""
    (tmp_path / "my_extension.py").write_text(
        "from verl_mtp_plugin.rollout.worker.extension import MTPColocateWorkerExtension\n"
        "class MyExtension(MTPColocateWorkerExtension):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = "my_extension.MyExtension"
    assert validate_verl_config(online([f"{VLLM}.worker_extension_cls={path}"])).worker_extension_cls == path
    with pytest.raises(MTPConfigError) as e:
        validate_verl_config(online([f"{VLLM}.worker_extension_cls={path}", "actor_rollout_ref.rollout.quantization=fp8"]))
    assert "a quantized drafter would be reloaded with unquantized weights" in str(e.value)


def test_an_extension_not_importable_here_is_warned_about_not_refused(caplog):
    """A module shipped to the workers only (runtime_env py_modules): the workers import it, and fail loudly if
    they cannot; the driver cannot check it and says so."""
    import logging

    with caplog.at_level(logging.WARNING):
        validate_verl_config(online([f"{VLLM}.worker_extension_cls=workers_only_module.Extension"]))
    assert "worker_extension_cls=workers_only_module.Extension could not be imported on this host" in caplog.text


def test_a_driver_only_setting_is_warned_about_when_the_run_joins_a_running_cluster(monkeypatch, caplog):
    """Workers of a cluster begun by `ray start` inherit that command's environment, not the driver's: the check
    would pass the driver's value while they may run the default. Not when the job's runtime_env carries it
    (ray job submit: Ray merges it into the workers'), nor on a fresh local cluster (it inherits it)."""
    import json
    import logging

    monkeypatch.setenv("VERL_MTP_SYNC_RECV_TIMEOUT_S", "600")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    needle = "VERL_MTP_SYNC_RECV_TIMEOUT_S='600' is set in this process's environment only"
    with caplog.at_level(logging.WARNING):
        validate_verl_config(online())
        assert needle not in caplog.text
        validate_verl_config(online(["+ray_kwargs.ray_init.address=auto"]))
        assert needle in caplog.text and f"set it in {ENV}.VERL_MTP_SYNC_RECV_TIMEOUT_S" in caplog.text
        caplog.clear()
        validate_verl_config(online(["+ray_kwargs.ray_init.address=auto", f"+{ENV}.VERL_MTP_SYNC_RECV_TIMEOUT_S='600'"]))
        monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(
            {"runtime_env": {"env_vars": {"VERL_MTP_SYNC_RECV_TIMEOUT_S": "600"}}}))
        validate_verl_config(online(["+ray_kwargs.ray_init.address=auto"]))
        assert needle not in caplog.text


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


@pytest.fixture(autouse=True)
def _no_plugin_settings_in_this_process(monkeypatch):
    """The start-up check also reads the plugin's settings from this process's environment; in-process vLLM engines
    of earlier tests leave some there."""
    import os

    for key in [k for k in os.environ if k.startswith("VERL_MTP_")]:
        monkeypatch.delenv(key)


BAD = [f"+{ENV}.VERL_MTP_SYNC_STAGE=gpu", "actor_rollout_ref.model.mtp.enable=false"]
#: bad inputs every entry point refuses (one or more per kind of check)
PARITY_BAD = {
    "env setting and MTP mode": BAD,
    "non-integer num_speculative_tokens": ["actor_rollout_ref.model.mtp.num_speculative_tokens=1.5"],
    "boolean given as a word": ["actor_rollout_ref.model.mtp.enable_train=maybe"],
    "unknown objective": [f"{ENV}.VERL_MTP_OBJECTIVE=bogus"],
    "drafter sync value": [f"{ENV}.VERL_MTP_DRAFTER_SYNC=sometimes"],
}


@pytest.fixture
def verl_hooks(monkeypatch):
    """verl's two trainer steps the hooks run before (v1 ``PPOTrainer._init_dataloader``, legacy
    ``RayPPOTrainer.__init__``) replaced by recorders (restored after the test), with the plugin's hooks installed
    around them as the task runner installs them."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    calls = []
    monkeypatch.setattr(PPOTrainer, "_init_dataloader", lambda self: calls.append(("v1", self)))
    monkeypatch.setattr(RayPPOTrainer, "__init__", lambda self, config, *a, **k: calls.append(("legacy", config)))
    assert verl_entry.install(startup_check) and verl_entry.installed("v1") and verl_entry.installed("legacy")
    return calls


def _hook_message(cfg, calls, kind="v1"):
    """What verl's task runner meets: the v1 trainer's ``_init_dataloader`` or the legacy ``RayPPOTrainer(config=...)``."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    calls.clear()
    trainer = types.SimpleNamespace(config=cfg)
    try:
        if kind == "v1":
            PPOTrainer._init_dataloader(trainer)
        else:
            RayPPOTrainer.__init__(object.__new__(RayPPOTrainer), config=cfg, tokenizer=None,
                                   role_worker_mapping={}, resource_pool_manager=None)
    except MTPConfigError as e:
        assert calls == []  # refused before verl's own step (and so before any worker)
        return str(e)
    assert [c[0] for c in calls] == [kind]
    return None


@pytest.mark.parametrize("case", sorted(PARITY_BAD))
def test_every_entry_point_refuses_the_same_config_with_the_same_message(case, verl_hooks, capsys):
    """verl-mtp check, python -m verl_mtp_plugin.main_ppo and python -m verl.trainer.main_ppo (v1 and legacy
    trainer) refuse the same bad inputs with the same message."""
    from verl_mtp_plugin.cli import main as cli_main
    from verl_mtp_plugin.trainer.main_ppo import check as plugin_entry_check

    bad = PARITY_BAD[case]
    with pytest.raises(MTPConfigError) as e:
        plugin_entry_check(online(bad))
    plugin_msg = str(e.value)
    assert plugin_msg.startswith("invalid verl config for verl_mtp_plugin:\n  - ")
    assert _hook_message(online(bad), verl_hooks) == plugin_msg  # python -m verl.trainer.main_ppo, v1 trainer
    assert cli_main(["check", str(CONFIG_DIR / "grpo_online.yaml"), *bad]) == 2  # verl-mtp check
    assert plugin_msg in capsys.readouterr().err
    # the legacy trainer: verl's entry refuses it with the same message; the plugin's entry, which runs the v1
    # trainers only, adds its own line for trainer.use_v1=false after it
    legacy = [*bad, "trainer.use_v1=false", "trainer.v1.trainer_mode=sync"]
    legacy_msg = _hook_message(online(legacy), verl_hooks, "legacy")
    assert legacy_msg is not None
    assert cli_main(["check", str(CONFIG_DIR / "grpo_online.yaml"), *legacy]) == 2
    assert legacy_msg in capsys.readouterr().err
    with pytest.raises(MTPConfigError) as e:
        plugin_entry_check(online(legacy))
    assert str(e.value).startswith(legacy_msg + "\n  - trainer.use_v1=false: python -m verl_mtp_plugin.main_ppo")


def test_a_good_config_passes_both_hooks_into_verls_own_step(verl_hooks, capsys):
    assert _hook_message(online(), verl_hooks) is None
    legacy = online(["trainer.use_v1=false", "trainer.v1.trainer_mode=sync"])
    assert _hook_message(legacy, verl_hooks, "legacy") is None
    assert capsys.readouterr().out.count(verl_entry.PASSED_LINE) == 2


def test_the_check_runs_once_under_the_plugins_entry(verl_hooks, monkeypatch, capsys):
    """python -m verl_mtp_plugin.main_ppo checks in the driver and marks the config; its task runner (where the
    verl-entry hook is installed too) gets the config through Ray (pickled) and does not check it again."""
    import cloudpickle

    import verl_mtp_plugin.trainer.config as tc
    import verl_mtp_plugin.trainer.main_ppo as entry

    checked = []
    real = tc.validate_verl_config
    monkeypatch.setattr(tc, "validate_verl_config", lambda cfg, **kw: checked.append(cfg) or real(cfg, **kw))
    shipped = []
    monkeypatch.setattr(entry, "run_ppo", lambda config, task_runner_class: shipped.append(
        cloudpickle.loads(cloudpickle.dumps(config))))
    monkeypatch.setattr(entry, "validate_config", lambda **kw: None)  # verl's own validation: not under test here
    entry.main(online())  # the plugin entry's Hydra main, given the composed config
    assert len(checked) == 1 and len(shipped) == 1
    assert _hook_message(shipped[0], verl_hooks) is None  # the task runner's hook: verl's step runs, no check
    assert len(checked) == 1 and verl_entry.PASSED_LINE not in capsys.readouterr().out
    # a config that did not pass through the plugin's entry is checked by the hook
    assert _hook_message(online(), verl_hooks) is None and len(checked) == 2


def test_no_environment_variable_skips_the_check_under_verls_entry(verl_hooks, monkeypatch):
    """Only a config the plugin's entry checked is skipped: a leftover or exported variable (the earlier marker,
    VERL_MTP_STARTUP_CHECKED=1) does not switch the check off."""
    monkeypatch.setenv("VERL_MTP_STARTUP_CHECKED", "1")
    assert "VERL_MTP_SYNC_STAGE='gpu'" in (_hook_message(online(BAD), verl_hooks) or "")
    assert "VERL_MTP_SYNC_STAGE='gpu'" in (_hook_message(online(BAD), verl_hooks, "legacy") or "")


@pytest.mark.timeout(900)
def test_the_hooks_are_installed_by_the_plugins_import_in_verls_task_runners():
    """verl's task runners import external_lib (HFModelConfig) with their trainer modules loaded: the v1 trainer base
    (TaskRunnerV1) or the legacy ray_trainer (main_ppo_v0.TaskRunner); VERL_USE_EXTERNAL_MODULES imports the plugin's
    trainers with verl. The four processes run side by side: each imports verl, megatron-core and vLLM, ~20 s of CPU
    but 2 min of wall time for one of them on a loaded 2-core host (a CI run's trainer runs beside it)."""
    import os
    import subprocess
    import sys
    import tempfile

    show = "from verl_mtp_plugin.compat import verl_entry; print(verl_entry.installed('v1'), verl_entry.installed('legacy'))"
    cases = [  # (what it is, code, extra environment, the expected last line)
        ("v1 trainer base", "import verl.trainer.ppo.v1.trainer_base, importlib; importlib.import_module('verl_mtp_plugin'); ",
         {}, "True True"),
        ("legacy task runner", "import verl.trainer.main_ppo_v0, importlib; importlib.import_module('verl_mtp_plugin'); ",
         {}, "False True"),
        # the documented module, and the bare package (which verl imports before its trainer modules)
        *((modules, "import verl; ", {"VERL_USE_EXTERNAL_MODULES": modules}, "True True")
          for modules in ("verl_mtp_plugin.trainer.v1", "verl_mtp_plugin")),
    ]
    # their output to files, not pipes: a process waited on last must not block on a full pipe meanwhile
    procs = []
    try:
        for name, code, extra, want in cases:
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            proc = subprocess.Popen([sys.executable, "-c", code + show], stdout=out, stderr=err, text=True,
                                    env=dict(os.environ, **extra))
            procs.append((name, want, proc, out, err))
        for name, want, proc, out, err in procs:
            proc.wait(timeout=840)
            out.seek(0), err.seek(0)
            assert out.read().strip().splitlines()[-1:] == [want], (name, err.read()[-2000:])
    finally:
        for _, _, proc, out, err in procs:
            proc.kill()
            out.close(), err.close()


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


def test_a_missing_vllm_internal_fails_the_start_up_check_naming_it_and_the_versions(monkeypatch):
    """The vLLM internals the worker extension / drafter sync read are probed at start-up (in the driver, before
    any vLLM engine starts): a renamed one is reported with its name and the installed releases."""
    import importlib.metadata

    import vllm.model_executor.model_loader.reload as reload

    monkeypatch.delattr(reload, "finalize_layerwise_reload")
    with pytest.raises(probes.CompatError) as e:
        startup_check(online())
    msg = str(e.value)
    assert "vllm.model_executor.model_loader.reload.finalize_layerwise_reload is missing in the installed vllm" in msg
    assert f"vllm {importlib.metadata.version('vllm')}" in msg and "tested with" in msg


def test_a_changed_vllm_signature_fails_naming_the_parameters(monkeypatch):
    import vllm.config

    monkeypatch.setattr(vllm.config, "set_current_vllm_config", lambda config, check_compile=False: None)
    with pytest.raises(probes.CompatError) as e:
        probes.probe_all(("vllm",))
    assert "set_current_vllm_config(config, check_compile=False): the plugin expects parameters (vllm_config)" in str(e.value)


def test_a_name_an_earlier_supported_vllm_lacks_passes_through_its_alternative_and_the_code_falls_back(monkeypatch):
    """vLLM 0.26 (the H200 image's) has no ``get_draft_load_config``; its drafter loads with
    ``speculative_config.draft_load_config``. The probe passes on that field and the extension reads it; with
    neither name the start-up check fails naming both."""
    import types

    import vllm.config
    import vllm.model_executor.model_loader.utils as loader_utils

    from verl_mtp_plugin.rollout.worker.extension import _drafter_loaded_at_start

    monkeypatch.delattr(loader_utils, "get_draft_load_config")
    probes.probe_all(("vllm",))
    spec = types.SimpleNamespace(draft_load_config=types.SimpleNamespace(load_format="dummy"))
    config = types.SimpleNamespace(speculative_config=spec, load_config=types.SimpleNamespace(load_format="auto"))
    assert _drafter_loaded_at_start(config) is False
    spec.draft_load_config = None
    assert _drafter_loaded_at_start(config) is True

    fields = dict(vllm.config.SpeculativeConfig.__dataclass_fields__)
    del fields["draft_load_config"]
    monkeypatch.setattr(vllm.config.SpeculativeConfig, "__dataclass_fields__", fields)
    with pytest.raises(probes.CompatError) as e:
        probes.probe_all(("vllm",))
    assert ("get_draft_load_config is missing in the installed vllm "
            "(nor vllm.config.SpeculativeConfig.__dataclass_fields__.draft_load_config)") in str(e.value)


def test_every_vllm_name_the_rollout_worker_imports_is_a_probed_joint():
    """Each ``from vllm.X import Y`` in the plugin's vLLM worker code has its joint in compat/probes.py."""
    import pathlib
    import re

    import verl_mtp_plugin.rollout.worker as worker

    joints = {j.path for j in probes.JOINTS if j.lib == "vllm"}
    imported = set()
    for path in pathlib.Path(worker.__file__).parent.glob("*.py"):
        for mod, grouped, names in re.findall(r"from (vllm[\w.]*) import (?:\(([^)]*)\)|([\w, ]+))", path.read_text()):
            imported |= {f"{mod}.{n.strip()}" for n in (grouped or names).split(",") if n.strip()}
    assert imported and imported <= joints, sorted(imported - joints)


# --------------------------------------------------------------- numbers, booleans and enums refused by key


MTPK = "actor_rollout_ref.model.mtp"


@pytest.mark.parametrize("override,needle", [
    (f"{MTPK}.num_speculative_tokens=1.5", f"{MTPK}.num_speculative_tokens=1.5: must be an integer >= 1"),
    (f"{MTPK}.num_speculative_tokens=two", f"{MTPK}.num_speculative_tokens='two': must be an integer >= 1"),
    (f"{MTPK}.num_speculative_tokens=true", f"{MTPK}.num_speculative_tokens=True: must be an integer >= 1"),
    (f"{MTPK}.num_speculative_tokens=0", f"{MTPK}.num_speculative_tokens=0: must be an integer >= 1"),
    (f"{MTPK}.num_speculative_tokens=null", f"{MTPK}.num_speculative_tokens=null: give a value"),
    (f"{MTPK}.enable_train=maybe", f"{MTPK}.enable_train='maybe': must be a boolean"),
    (f"{MTPK}.enable_rollout=2", f"{MTPK}.enable_rollout=2: must be a boolean"),
    (f"{MTPK}.mtp_loss_scaling_factor=abc", f"{MTPK}.mtp_loss_scaling_factor='abc': must be a number >= 0"),
    (f"{MTPK}.method=medusa", f"{MTPK}.method='medusa' is not one of vLLM's MTP methods"),
    ("actor_rollout_ref.rollout.temperature=hot", "actor_rollout_ref.rollout.temperature='hot': must be a number"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=x",
     "actor_rollout_ref.rollout.tensor_model_parallel_size='x': must be an integer >= 1"),
    ("actor_rollout_ref.rollout.expert_parallel_size=-2",
     "actor_rollout_ref.rollout.expert_parallel_size=-2: must be an integer >= 1"),
    ("actor_rollout_ref.rollout.max_num_seqs=1.5", "actor_rollout_ref.rollout.max_num_seqs=1.5: must be an integer"),
    ("actor_rollout_ref.rollout.max_num_batched_tokens=x", "actor_rollout_ref.rollout.max_num_batched_tokens='x'"),
    ("+actor_rollout_ref.rollout.cudagraph_capture_sizes=[8,big]", "actor_rollout_ref.rollout.cudagraph_capture_sizes="),
    ("actor_rollout_ref.rollout.free_cache_engine=maybe", "actor_rollout_ref.rollout.free_cache_engine='maybe'"),
    ("actor_rollout_ref.model.lora_rank=x", "actor_rollout_ref.model.lora_rank='x': must be an integer >= 0"),
    ("actor_rollout_ref.actor.megatron.context_parallel_size=x",
     "actor_rollout_ref.actor.megatron.context_parallel_size='x': must be an integer >= 1"),
    ("trainer.use_v1=maybe", "trainer.use_v1='maybe': must be a boolean"),
    # verl hands engine_kwargs' speculative_config to vLLM as it is: 'abc' escaped as int()'s ValueError
    ("+actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.num_speculative_tokens=abc",
     "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.num_speculative_tokens='abc': must be an "
     "integer >= 1"),
    ("+actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.num_speculative_tokens=2.5",
     "speculative_config.num_speculative_tokens=2.5: must be an integer >= 1"),
])
def test_bad_numbers_booleans_and_methods_are_refused_at_start_up_naming_the_key(override, needle):
    """Each escaped before as a raw ValueError/TypeError (int('two')) or was read silently as something else
    (as_bool('maybe') is False, 1.5 speculative tokens reached vLLM)."""
    with pytest.raises(MTPConfigError) as e:
        startup_check(online([override]))
    assert needle in str(e.value)


def test_every_typed_key_of_the_shipped_recipes_and_verls_defaults_is_accepted(base):
    from verl_mtp_plugin.recipe_paths import RECIPES

    assert verl_config.value_errors(base) == []
    for name in RECIPES:
        assert verl_config.value_errors(compose_recipe(str(CONFIG_DIR), name)) == [], name


# ------------------------------------------------------ environment settings named by where they are set


BAD_ENV = {"VERL_MTP_OBJECTIVE": "bogus", "VERL_MTP_DRAFTER_SYNC": "sometimes", "VERL_MTP_SYNC_CHECKSUM": "maybe",
           "VERL_MTP_SYNC_STAGE": "gpu", "VERL_MTP_SYNC_RECV_TIMEOUT_S": "soon"}


def test_every_plugin_environment_setting_has_a_bad_value_case():
    assert set(BAD_ENV) == set(verl_config.PLUGIN_ENV_VARS)


@pytest.mark.parametrize("name", sorted(BAD_ENV))
def test_a_bad_environment_setting_is_refused_naming_where_it_was_set(name, monkeypatch):
    """Set in the recipe (ray_kwargs.ray_init.runtime_env.env_vars): the error names that config key. Set only in the
    driver's environment (which the Ray workers inherit): the error says it came from the environment variable."""
    bad = BAD_ENV[name]
    key = f"{ENV}.{name}"
    with pytest.raises(MTPConfigError) as e:
        startup_check(online([f"++{key}={bad}"]))
    assert f"{key}={bad!r}" in str(e.value)
    monkeypatch.setenv(name, bad)
    with pytest.raises(MTPConfigError) as e:
        startup_check(online([f"~{key}"] if name in ("VERL_MTP_OBJECTIVE", "VERL_MTP_DRAFTER_SYNC") else []))
    msg = str(e.value)
    assert f"{name} (this process's environment)={bad!r}" in msg and key not in msg
