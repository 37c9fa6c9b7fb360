"""Every weight path verl 0.9.1 offers syncs the drafter through the plugin's extension or is refused at
start-up; cluster failures (a vLLM worker dying mid-update, two jobs sharing a weight socket, a quantized
checkpoint named by a hub id) end the run with their cause. Real composed verl configs, verl's real weight
sender and receiver over a real ZMQ socket, a receiver process that really dies."""

import inspect
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from omegaconf import OmegaConf

from verl_mtp_plugin.testing import config_with
from verl_mtp_plugin.policy import MTPConfigError
from verl_mtp_plugin.trainer.config import (
    CHECKPOINT_BACKEND_KEY,
    IPC_BACKENDS,
    compose_recipe,
    validate_verl_config,
)
from verl_mtp_plugin.recipe_paths import CONFIG_DIR

MODES = ("sync", "colocate_async", "mtp_sync", "mtp_colocate_async", "separate_async", "mtp_separate_async")
BACKENDS = (*IPC_BACKENDS, "delta_sharded")


@pytest.fixture(autouse=True)
def _no_plugin_settings_in_this_process(monkeypatch):
    """The start-up check also reads the plugin's settings from this process's environment; earlier tests in the same
    process (the in-process vLLM engines of the CPU runtime) set some of them, which the recipes here do not."""
    for key in [k for k in os.environ if k.startswith("VERL_MTP_")]:
        monkeypatch.delenv(key)


@pytest.fixture(scope="module")
def recipe():
    """The shipped grpo_online recipe, composed as verl's entry point composes it (speculation on, the
    plugin's worker extension; its model path is a hub id)."""
    return compose_recipe(str(CONFIG_DIR), "grpo_online")


_with = config_with  # verl_mtp_plugin.testing


def _outcome(cfg):
    try:
        validate_verl_config(cfg)
        return "ok"
    except MTPConfigError as e:
        return str(e)


def test_backend_key_is_verls():
    """The key the check reads is where verl's own config keeps the backend (its default: naive)."""
    from verl_mtp_plugin.trainer.config import compose_ppo_trainer

    cfg = compose_ppo_trainer(["model_engine=megatron"])
    assert OmegaConf.select(cfg, CHECKPOINT_BACKEND_KEY) == "naive"


def test_colocated_trainers_force_the_naive_path_in_verl():
    """The premise of accepting every backend for sync / colocate_async: verl's v1 trainer builds the
    checkpoint manager of its colocated replicas with backend naive whatever the config says, and the naive
    path is the actor's update_weights into update_weights_from_ipc."""
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    setup = inspect.getsource(PPOTrainer)
    assert 'checkpoint_engine_config.backend = "naive"' in setup
    assert 'if self.backend == "naive":' in inspect.getsource(CheckpointEngineManager.update_weights)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_and_trainer_mode_syncs_the_drafter_or_is_refused(recipe, mode, backend):
    cfg = _with(recipe, trainer__v1__trainer_mode=mode, **{CHECKPOINT_BACKEND_KEY.replace(".", "__"): backend})
    out = _outcome(cfg)
    separate = "separate" in mode
    if separate and backend == "naive":
        assert f"trainer.v1.trainer_mode={mode} with {CHECKPOINT_BACKEND_KEY}=naive" in out, out
    elif separate and backend == "delta_sharded":
        assert f"{CHECKPOINT_BACKEND_KEY}=delta_sharded with MTP speculation" in out and "stale" in out, out
    else:
        assert out == "ok", out


def test_an_unknown_checkpoint_engine_is_refused_with_speculation(recipe):
    cfg = _with(recipe, trainer__v1__trainer_mode="mtp_separate_async",
                **{CHECKPOINT_BACKEND_KEY.replace(".", "__"): "my_engine"})
    assert f"{CHECKPOINT_BACKEND_KEY}='my_engine' with MTP speculation" in _outcome(cfg)


def test_delta_sharded_without_speculation_is_accepted(recipe):
    cfg = _with(recipe, trainer__v1__trainer_mode="separate_async",
                actor_rollout_ref__model__mtp__enable_rollout=False,
                **{CHECKPOINT_BACKEND_KEY.replace(".", "__"): "delta_sharded"})
    cfg = _with(cfg, **{"actor_rollout_ref__rollout__engine_kwargs__vllm__speculative_config": None})
    assert _outcome(cfg) == "ok"


# --------------------------------------------------------------------------------------------------------------
# a vLLM worker that dies mid-update

_RECEIVER = textwrap.dedent(
    """
    import os, signal, sys, threading, torch
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
    from verl_mtp_cpu.vllm_engine import _verl_platform

    seen = []

    def on_bucket(weights, is_last):
        seen.append(len(weights))
        print("bucket", len(seen), flush=True)
        if len(seen) == 2:
            if sys.argv[2] == "holding":  # dies while it holds the second bucket (before acknowledging it)
                os.kill(os.getpid(), signal.SIGKILL)
            # "idle": dies once it has acknowledged it, while it waits for the third (the trainer is slow)
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()

    with _verl_platform():
        BucketedWeightReceiver(sys.argv[1], torch.device("cpu"), use_shm=True).receive_weights(on_bucket)
    """
)

BOUND_S = 20.0  # from the receiver's death to the error in the sender's hands (2-core machine under load)


def _send_to_dying_receiver(tmp_path, handle, when="holding"):
    """verl's real BucketedWeightSender streams 6 buckets to verl's real receiver in another process, which
    SIGKILLs itself on the second; returns (the sender's error or None, seconds from death to error, alive)."""
    import asyncio

    import torch
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    from verl_mtp_cpu.vllm_engine import _verl_platform

    script = tmp_path / "receiver.py"
    script.write_text(_RECEIVER)
    proc = subprocess.Popen([sys.executable, str(script), handle, when], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    box = {}

    def send():
        def weights():  # 1 MiB each: one bucket each; the third bucket goes 3 s late (the worker dies meanwhile)
            for i in range(6):
                if i == 3 and when == "idle":  # a bucket goes out when the next tensor does not fit
                    time.sleep(3.0)
                yield f"w{i}", torch.full((1 << 18,), float(i))
        try:
            with _verl_platform():
                sender = BucketedWeightSender(handle, bucket_size_mb=1, use_shm=True)
                asyncio.run(sender.async_send_weights(weights()))
        except BaseException as e:  # noqa: BLE001
            box["error"] = e
        box["t"] = time.monotonic()

    t = threading.Thread(target=send, daemon=True)
    t.start()
    proc.wait(timeout=120)
    died = time.monotonic()
    t.join(BOUND_S)
    return box.get("error"), (box["t"] - died) if "t" in box else None, t.is_alive(), proc.returncode


@pytest.mark.parametrize("when", ["holding", "idle"])
def test_a_vllm_worker_killed_mid_update_fails_the_trainers_sender_in_seconds(tmp_path, when):
    """verl's sender waits for each acknowledgement in a blocking recv with no timeout: without the plugin's
    watch (installed with the plugin's engine registration) a receiver that dies mid-update leaves it waiting
    forever. With it the sender raises WeightReceiverLostError within seconds, naming the socket."""
    from verl_mtp_plugin.compat.verl_weight_sender import WeightReceiverLostError, install, installed, probe

    assert probe() == []
    install()
    assert installed()
    handle = f"ipc://{tmp_path}/w.sock"
    err, took, alive, rc = _send_to_dying_receiver(tmp_path, handle, when)
    assert rc == -9, rc  # the receiver really died (SIGKILL)
    assert not alive, "the sender still waits for the dead receiver"
    assert isinstance(err, WeightReceiverLostError), err
    assert took < BOUND_S
    # acknowledged: the buffer set-up, then bucket 1 (holding: dies with bucket 2) or buckets 1 and 2 (idle)
    acks, waiting = {"holding": (2, "before acknowledging"), "idle": (3, "before the next message")}[when]
    assert handle in str(err) and f"disconnected after {acks} acknowledged message(s), {waiting}" in str(err), err


def test_a_receiver_that_never_connects_fails_the_trainers_sender(tmp_path, monkeypatch):
    """The update call failed on vLLM's side before its receiver opened the socket (or the worker is gone): verl's
    sender waited forever for room to send (the RPC's error is awaited only after the send). With the watch it
    gives up after VERL_MTP_SYNC_RECV_TIMEOUT_S, naming the socket."""
    import asyncio

    import torch
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    from verl_mtp_cpu.vllm_engine import _verl_platform
    from verl_mtp_plugin.compat.verl_weight_sender import WeightReceiverLostError, install

    install()
    monkeypatch.setenv("VERL_MTP_SYNC_RECV_TIMEOUT_S", "2")
    handle = f"ipc://{tmp_path}/nobody.sock"
    box = {}

    def send():
        try:
            with _verl_platform():
                sender = BucketedWeightSender(handle, bucket_size_mb=1, use_shm=False)
                asyncio.run(sender.async_send_weights(iter([("w0", torch.zeros(16))])))
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t0 = time.monotonic()
    t = threading.Thread(target=send, daemon=True)
    t.start()
    t.join(BOUND_S)
    assert not t.is_alive(), "the sender still waits for a receiver that never connected"
    err = box.get("error")
    assert isinstance(err, WeightReceiverLostError), err
    assert f"no vLLM worker connected to receive it ({handle}) within 2 s" in str(err), err
    assert 2.0 <= time.monotonic() - t0 < BOUND_S


@pytest.mark.parametrize("mode", ["separate_async", "mtp_separate_async"])
@pytest.mark.parametrize("speculation", [True, False])
def test_separate_async_needs_the_plugins_module_in_verls_checkpoint_worker(recipe, mode, speculation, monkeypatch):
    """Under separate_async verl's CheckpointEngineWorker sends the updates on to vLLM in a process that imports only
    ``checkpoint_engine.custom_backend_module``: without a plugin module there (or VERL_USE_EXTERNAL_MODULES naming
    one) a dead vLLM worker hangs the update, so the start-up check refuses it naming the key, for every checkpoint
    engine that process runs, with or without speculation (colocated modes do not use that process)."""
    from verl_mtp_plugin.trainer.config import CHECKPOINT_WORKER_MODULE, CUSTOM_BACKEND_MODULE_KEY

    monkeypatch.delenv("VERL_USE_EXTERNAL_MODULES", raising=False)
    assert OmegaConf.select(recipe, CUSTOM_BACKEND_MODULE_KEY) == CHECKPOINT_WORKER_MODULE  # the recipes set it
    base = recipe
    if not speculation:
        base = _with(recipe, actor_rollout_ref__model__mtp__enable_rollout=False)
        base = _with(base, **{"actor_rollout_ref__rollout__engine_kwargs__vllm__speculative_config": None})
    key = CUSTOM_BACKEND_MODULE_KEY.replace(".", "__")
    backends = ("nccl", "kimi_ckpt_engine") + (() if speculation else ("delta_sharded", "my_engine"))
    for backend in backends:
        for module in (None, "my_pkg.backends"):
            cfg = _with(base, trainer__v1__trainer_mode=mode,
                        **{CHECKPOINT_BACKEND_KEY.replace(".", "__"): backend, key: module})
            out = _outcome(cfg)
            assert f"set {CUSTOM_BACKEND_MODULE_KEY}={CHECKPOINT_WORKER_MODULE}" in out, (backend, out)
            assert f"it is {module!r} now" in out, (backend, out)
            assert _outcome(_with(cfg, trainer__v1__trainer_mode="mtp_sync")) == "ok"  # colocated: not used
            # the plugin imported in every verl process by verl itself (the job's runtime env, or the driver's
            # environment a cluster the run starts inherits), a module of the user's own kept in the key
            env_key = "ray_kwargs__ray_init__runtime_env__env_vars__VERL_USE_EXTERNAL_MODULES"
            assert _outcome(_with(cfg, **{env_key: f"other_pkg,{CHECKPOINT_WORKER_MODULE}"})) == "ok", backend
            with monkeypatch.context() as m:
                m.setenv("VERL_USE_EXTERNAL_MODULES", "verl_mtp_plugin")
                assert _outcome(cfg) == "ok", backend
            assert f"add {CHECKPOINT_WORKER_MODULE} to ray_kwargs.ray_init.runtime_env.env_vars" in out
        # a plugin module that does not exist is refused before verl fails to import it after the start-up
        typo = _with(base, trainer__v1__trainer_mode=mode, **{CHECKPOINT_BACKEND_KEY.replace(".", "__"): backend,
                                                              key: CHECKPOINT_WORKER_MODULE + "s"})
        assert f"'{CHECKPOINT_WORKER_MODULE}s' is no module of the plugin" in _outcome(typo), backend
        cfg = _with(base, trainer__v1__trainer_mode=mode, **{CHECKPOINT_BACKEND_KEY.replace(".", "__"): backend})
        assert _outcome(cfg) == "ok", backend


def test_the_checkpoint_engines_named_are_the_ones_verl_registers():
    """The backends the start-up check accepts or refuses by name are the names verl 0.9.1's engines register
    (read from its source: engines whose transport is not installed here do not register on import)."""
    import pathlib
    import re

    import verl.checkpoint_engine as ce

    from verl_mtp_plugin.trainer.config import DELTA_BACKENDS

    names = set()
    for f in pathlib.Path(ce.__file__).parent.glob("*.py"):
        names |= set(re.findall(r'CheckpointEngineRegistry\.register\("([^"]+)"\)', f.read_text()))
    assert names == set(IPC_BACKENDS) | set(DELTA_BACKENDS), names


_CHECKPOINT_WORKER = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    from types import SimpleNamespace
    import torch
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry, CheckpointEngineWorker
    from verl.workers.config.rollout import CheckpointEngineConfig, RolloutConfig
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    @CheckpointEngineRegistry.register("loopback_for_test")
    class Loopback(CheckpointEngine):  # the trainer's side of the transport: one tensor received
        def __init__(self, bucket_size, **kwargs):
            self.bucket_size = bucket_size
        def prepare(self):
            return {}
        @classmethod
        def build_topology(cls, *args, **kwargs):
            return {}, {}
        def init_process_group(self, **kwargs):
            pass
        def finalize(self):
            pass
        async def send_weights(self, weights, global_steps=None):
            pass
        async def receive_weights(self, global_steps=None):
            yield "model.layers.0.mixer.weight", torch.zeros(16)

    class Adapter(SimpleNamespace):  # verl's vLLM ServerAdapter's update path; the vLLM worker never connects
        update_weights = ServerAdapter.update_weights
        async def _execute_method(self, *args, **kwargs):
            return None  # the RPC failed on vLLM's side before its receiver opened the socket

    module = sys.argv[2] or None
    plugin_before = any(m.startswith("verl_mtp_plugin") for m in sys.modules)
    cfg = RolloutConfig(name="vllm", checkpoint_engine=CheckpointEngineConfig(backend="loopback_for_test",
                                                                              custom_backend_module=module))
    adapter = Adapter(zmq_handle=sys.argv[1], use_shm=False, _has_server=False, replica_rank=0, rollout_rank=0,
                      config=SimpleNamespace(checkpoint_engine=SimpleNamespace(update_weights_bucket_megabytes=1)))
    worker = CheckpointEngineWorker(cfg, None, server_adapter=adapter)  # verl's constructor, as Ray runs it
    out = {"plugin_before": plugin_before,
           "watch": bool(getattr(BucketedWeightSender._init_socket, "_verl_mtp_receiver_watch", False))}
    if out["watch"]:  # without it verl's sender would wait for the receiver for good
        from verl_mtp_cpu.vllm_engine import _verl_platform
        t0 = time.monotonic()
        try:
            with _verl_platform():
                asyncio.run(CheckpointEngineWorker.update_weights(worker, global_steps=1))
        except Exception as e:
            out["error"], out["message"], out["took"] = type(e).__name__, str(e), time.monotonic() - t0
    print("RESULT " + json.dumps(out))
    """
)


def test_verls_checkpoint_worker_process_gets_the_watch_from_the_recipes_module(tmp_path, recipe):
    """verl's real ``CheckpointEngineWorker`` constructed in a fresh process that never imported the plugin (as Ray
    builds it for separate_async), with the recipe's ``custom_backend_module``: the sender's watch is installed there,
    and its ``update_weights`` (verl's ServerAdapter path) for a vLLM worker that never connects fails in seconds
    naming the socket. Without the module the process has no watch (the hang the start-up refusal prevents)."""
    import json
    import random

    from verl_mtp_plugin.trainer.config import CUSTOM_BACKEND_MODULE_KEY

    script = tmp_path / "checkpoint_worker.py"
    script.write_text(_CHECKPOINT_WORKER)
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(random.randint(20000, 40000)), "VERL_MTP_SYNC_RECV_TIMEOUT_S": "2"}
    results = {}
    for name, module in (("recipe", OmegaConf.select(recipe, CUSTOM_BACKEND_MODULE_KEY)), ("none", "")):
        handle = f"ipc://{tmp_path}/{name}.sock"
        p = subprocess.run([sys.executable, str(script), handle, module], env=env, capture_output=True, text=True,
                           timeout=300)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        assert p.returncode == 0 and line, p.stdout[-2000:] + p.stderr[-4000:]
        results[name] = (json.loads(line[-1][len("RESULT "):]), handle)
    got, handle = results["recipe"]
    assert not got["plugin_before"] and got["watch"], got
    assert got["error"] == "WeightReceiverLostError" and got["took"] < BOUND_S, got
    assert f"no vLLM worker connected to receive it ({handle}) within 2 s" in got["message"], got
    assert results["none"][0] == {"plugin_before": False, "watch": False}


def test_the_plugins_registration_with_verl_installs_the_watch():
    """verl imports the plugin (``external_lib``) in its workers after itself, which registers the engine
    (:func:`verl_mtp_plugin.engine.registry.register`): that registration installs the watch."""
    from verl_mtp_plugin.compat.verl_weight_sender import installed, uninstall
    from verl_mtp_plugin.engine.registry import register

    uninstall()
    assert not installed()
    register()
    assert installed()


# --------------------------------------------------------------------------------------------------------------
# two jobs on one host; quantized checkpoints named by a hub id


def test_a_run_that_starts_its_own_ray_cluster_is_warned_about_the_shared_weight_socket(recipe):
    """Ray gives the first job of every fresh cluster the same id and verl names the weight socket after it:
    the plugin's entry point warns (naming the socket and the fix) unless the run joins a running cluster."""
    import ray
    from verl.workers.rollout.vllm_rollout import vllm_rollout, utils

    from verl_mtp_plugin.trainer.main_ppo import shared_weight_socket_warning

    # the premise, in verl's source: both ends derive the socket from the Ray job id
    assert "rl-colocate-zmq-{job_id}" in inspect.getsource(vllm_rollout.ServerAdapter.__init__)
    assert "VERL_RAY_JOB_ID" in inspect.getsource(utils)
    text = shared_weight_socket_warning(recipe, environ={})
    assert "/tmp/rl-colocate-zmq-<Ray job id>" in text and "+ray_kwargs.ray_init.address=auto" in text
    assert shared_weight_socket_warning(recipe, environ={"RAY_ADDRESS": "10.0.0.1:6379"}) is None
    assert shared_weight_socket_warning(_with(recipe, ray_kwargs__ray_init__address="auto"), environ={}) is None
    assert ray.__version__  # the fix names Ray's own option


def _quantized_hf_dir(root):
    from verl_mtp_cpu.vllm_drafter import write_hf_config_dir

    path = write_hf_config_dir(root, pattern="M*-E/*E")
    import json

    cfg = json.loads((root / "config.json").read_text()) if (root / "config.json").exists() else None
    cfg = cfg or json.loads((__import__("pathlib").Path(path) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (__import__("pathlib").Path(path) / "config.json").write_text(json.dumps(cfg))
    return path


def test_a_quantized_checkpoint_named_by_a_hub_id_is_refused_at_start_up_from_the_local_cache(recipe, tmp_path,
                                                                                              monkeypatch):
    """A hub id whose config.json is in the local Hugging Face cache is read from there (no network) and a
    quantized one refused naming the key; an id not in the cache is left to the first sync."""
    import pathlib
    import shutil

    hub = tmp_path / "hub"
    snap = hub / "models--acme--tiny-fp8" / "snapshots" / ("0" * 40)
    src = pathlib.Path(_quantized_hf_dir(tmp_path / "src"))
    snap.mkdir(parents=True)
    shutil.copy(src / "config.json", snap / "config.json")
    (hub / "models--acme--tiny-fp8" / "refs").mkdir()
    (hub / "models--acme--tiny-fp8" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(hub))
    out = _outcome(_with(recipe, actor_rollout_ref__model__path="acme/tiny-fp8"))
    assert "actor_rollout_ref.model.path=acme/tiny-fp8" in out and "quant_method='fp8'" in out, out
    assert _outcome(_with(recipe, actor_rollout_ref__model__path="acme/not-in-the-cache")) == "ok"


def test_the_first_sync_refuses_a_quantized_checkpoint_from_the_config_vllm_loaded(tmp_path):
    """The extension's refusal reads vLLM's own ModelConfig of the checkpoint (quantization from its HF
    config) before any weight is loaded; an unquantized checkpoint passes."""
    from vllm.config import ModelConfig

    from verl_mtp_cpu.vllm_drafter import write_hf_config_dir
    from verl_mtp_plugin.rollout.worker.extension import quantized_checkpoint_error

    plain = write_hf_config_dir(tmp_path / "plain", pattern="M*-E/*E")
    q = _quantized_hf_dir(tmp_path / "q")
    from types import SimpleNamespace

    def vllm_config(path, **kw):
        try:
            mc = ModelConfig(model=str(path), tokenizer=None, skip_tokenizer_init=True, **kw)
        except Exception:  # noqa: BLE001 - vLLM validates the method against the platform: its HF config still holds it
            from transformers import AutoConfig

            mc = SimpleNamespace(model=str(path), quantization=None, hf_config=AutoConfig.from_pretrained(str(path)))
        return SimpleNamespace(model_config=mc)

    assert quantized_checkpoint_error(vllm_config(plain)) is None
    text = quantized_checkpoint_error(vllm_config(q))
    assert text and "'fp8'" in text and "refused before any weight was loaded" in text, text


def test_the_plugins_trainer_refuses_the_weight_path_also_under_verls_entry_point(recipe):
    """``python -m verl.trainer.main_ppo`` runs no start-up check: the plugin's trainer class (registered with verl)
    refuses a weight path that would leave the drafter stale in its constructor, before any worker starts."""
    import verl_mtp_plugin.trainer.v1 as v1

    cls = v1.MTPPPOTrainerSeparateAsync
    cfg = _with(recipe, trainer__v1__trainer_mode="mtp_separate_async",
                **{CHECKPOINT_BACKEND_KEY.replace(".", "__"): "delta_sharded"})
    with pytest.raises(MTPConfigError, match="delta_sharded with MTP speculation"):
        cls.__init__(cls.__new__(cls), cfg)
