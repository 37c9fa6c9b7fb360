"""The private verl / vLLM / Megatron internals the plugin overrides or reads, in one list, with start-up probes.

Each :class:`Joint` names an object by its dotted path and, for callables, the leading parameter names the plugin
relies on. :func:`probe_all` (run by the start-up check, :func:`verl_mtp_plugin.trainer.config.startup_check`) imports
each and fails with :class:`CompatError` naming the missing name or the changed signature and the installed versions
(the plugin is tested with :data:`TESTED`). Probing a library that is not installed is skipped (vLLM is optional on a
trainer-only host). Core module: imports the probed libraries only inside :func:`probe`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import inspect

from verl_mtp_plugin.policy import MTPConfigError

__all__ = ["JOINTS", "TESTED", "CompatError", "Joint", "installed_versions", "probe", "probe_all"]

#: The releases the plugin is tested with (pyproject pins verl to this release).
TESTED = {"verl": "0.9.1", "megatron-core": "0.19.2", "vllm": "0.31.0"}
_DIST = {"verl": "verl", "megatron": "megatron-core", "vllm": "vllm"}


class CompatError(MTPConfigError):
    """An internal of verl / vLLM / Megatron the plugin relies on is missing or changed."""


@dataclasses.dataclass(frozen=True)
class Joint:
    lib: str  # "verl", "vllm" or "megatron" (the top-level package)
    path: str  # dotted module path + attribute chain
    params: tuple[str, ...] | None = None  # leading parameter names of a callable (None: not checked)
    why: str = ""
    #: what earlier releases the plugin supports have instead, which the code falls back to (any one suffices)
    alternatives: tuple[str, ...] = ()


#: Every private joint (the compat list). Keep in sync with the code that uses them (named in ``why``).
JOINTS = (
    Joint("verl", "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension._update_weights",
          ("self", "weights", "peft_config", "base_sync_done"), "rollout/worker/extension.py overrides it"),
    Joint("verl", "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension.update_weights_from_ipc",
          ("self", "peft_config", "base_sync_done", "use_shm"), "rollout/worker/extension.py overrides it"),
    Joint("verl", "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension._get_drafter_model",
          ("self",), "rollout/worker/extension.py overrides it"),
    Joint("verl", "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension._get_draft_model_config",
          ("self",), "rollout/worker/extension.py calls it"),
    Joint("verl", "verl.workers.rollout.vllm_rollout.utils.build_mtp_speculative_config",
          ("method", "num_speculative_tokens", "engine_speculative_config"), "verl_config.speculative_config reuses it"),
    Joint("verl", "verl.workers.rollout.vllm_rollout.vllm_async_server.vLLMHttpServer._resolve_sleep_level",
          ("self",), "verl_config.sleep_level mirrors it"),
    Joint("verl", "verl.workers.engine.megatron.transformer_impl.MegatronEngineWithLMHead._build_tf_config",
          ("self",), "engine/megatron.py overrides it and swaps model_config.mtp around it"),
    Joint("verl", "verl.workers.engine.base.EngineRegistry._engines", None, "engine/registry.py reads it"),
    Joint("verl", "verl.workers.config.model.MtpConfig.__dataclass_fields__.enable_train", None,
          "engine/megatron.py hands verl a copy of model_config.mtp with enable/enable_train off"),
    Joint("verl", "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension._use_mtp_drafter_weight_sync",
          ("self",), "rollout/worker/extension.py overrides and calls it"),
    Joint("verl", "verl.trainer.ppo.v1.trainer_base.PPOTrainer._init_dataloader", ("self",),
          "compat/verl_entry.py runs the start-up check before it"),
    Joint("verl", "verl.trainer.ppo.ray_trainer.RayPPOTrainer.__init__", ("self", "config"),
          "compat/verl_entry.py runs the start-up check before it (legacy trainer, trainer.use_v1=false)"),
    Joint("megatron", "megatron.core.models.common.language_module.language_module.LanguageModule."
          "compute_language_model_loss", ("self", "labels", "logits"),
          "compat/megatron_loss.py replaces it per instance for soft_ce / tv / chained_tv"),
    Joint("verl", "verl.workers.engine.megatron.transformer_impl.MegatronEngine.save_checkpoint",
          ("self", "local_path", "hdfs_path", "global_step", "max_ckpt_to_keep"),
          "engine/megatron.py overrides it (records the MTP mode in the checkpoint)"),
    Joint("verl", "verl.workers.engine.megatron.transformer_impl.MegatronEngine.load_checkpoint",
          ("self", "local_path", "hdfs_path", "del_local_after_load"),
          "engine/megatron.py overrides it (resume check, fp32 masters refreshed; compat/checkpoint_resume.py)"),
    *(Joint("verl", f"verl.utils.checkpoint.megatron_checkpoint_manager.MegatronCheckpointManager.{flag}", None,
            "compat/checkpoint_resume.py reads it") for flag in ("should_load_model", "should_load_hf_model",
                                                                 "should_load_optimizer")),
    *(Joint("verl", f"verl.workers.rollout.vllm_rollout.bucketed_weight_transfer.BucketedWeightSender.{name}",
            ("self",), "compat/verl_weight_sender.py wraps it") for name in ("_init_socket", "_cleanup")),
    Joint("verl", "verl.workers.config.rollout.CheckpointEngineConfig.__dataclass_fields__.custom_backend_module", None,
          "verl imports it in CheckpointEngineWorker: rollout/checkpoint_worker.py installs the sender's watch there"),
    Joint("megatron", "megatron.core.optimizer.MegatronOptimizer.reload_model_params", ("self", "state_dict"),
          "compat/checkpoint_resume.py refreshes the fp32 masters with it after a model-only load"),
    Joint("megatron", "megatron.core.transformer.multi_token_prediction.roll_tensor",
          ("tensor", "shifts", "dims", "cp_group", "packed_seq_params"), "objective.py calls it"),
    Joint("megatron", "megatron.core.models.common.language_module.language_module.LanguageModule._scale_logits",
          ("self", "logits"), "objective.py scales the main head's target logits with it, chunk by chunk"),
    Joint("megatron", "megatron.core.tensor_parallel.mappings.gather_from_sequence_parallel_region",
          ("input_", "tensor_parallel_output_grad", "group"),
          "objective.py gathers the main hidden states for the target and the MTP head under sequence parallelism"),
    Joint("megatron", "megatron.core.tensor_parallel.mappings.copy_to_tensor_model_parallel_region",
          ("input_", "group"), "objective.py enters the MTP head's vocabulary-parallel region with it (TP, no SP)"),
    Joint("megatron", "megatron.core.models.hybrid.hybrid_model.process_mtp_loss",
          ("hidden_states", "labels", "loss_mask", "output_layer", "output_weight", "runtime_gather_output",
           "is_training", "compute_language_model_loss"),
          "compat/megatron_mtp_head.py rebinds it to pass the plugin's MTP output layer"),
    # joint mode: the chunked MTP loss hands the output weight's gradient to megatron as its output layer does
    Joint("megatron", "megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.backward",
          ("ctx", "grad_output"), "compat/megatron_mtp_head.py mirrors its main_grad / grad_added_to_main_grad protocol"),
    Joint("megatron", "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel."
          "_make_backward_post_hook", ("self", "param"),
          "compat/megatron_mtp_head.py: its hook skips param.grad once grad_added_to_main_grad is set"),
    Joint("megatron", "megatron.core.transformer.transformer_config.TransformerConfig.__dataclass_fields__."
          "defer_embedding_wgrad_compute", None, "compat/megatron_mtp_head.py keeps whole MTP logits under it"),
    Joint("verl", "verl.trainer.ppo.v1.trainer_base.PPOTrainer._build_replay_buffer", ("self",),
          "trainer/v1.py sets the poll interval of what it returns (compat/verl_replay_buffer.py)"),
    Joint("verl", "verl.trainer.ppo.v1.replay_buffer.ReplayBuffer.__init__",
          ("self", "trainer_mode", "trainer_config", "max_off_policy_threshold", "max_off_policy_strategy",
           "sampler_kwargs", "poll_interval"), "compat/verl_replay_buffer.py sets poll_interval"),
    Joint("verl", "verl.trainer.ppo.v1.replay_buffer.ReplayBuffer._wait_for_next_poll",
          ("self", "partition_id", "last_debug_time"), "sleeps poll_interval (compat/verl_replay_buffer.py)"),
    Joint("verl", "verl.workers.rollout.replica.RolloutReplicaRegistry._registry", None,
          "rollout/replica.py registers the plugin's replica under 'vllm' in place of verl's loader"),
    Joint("verl", "verl.workers.rollout.replica._load_vllm", (),
          "rollout/replica.py replaces only verl's own loader under 'vllm'"),
    Joint("verl", "verl.workers.rollout.vllm_rollout.vllm_async_server.vLLMReplica.__init__",
          ("self", "replica_rank", "config", "model_config"),
          "rollout/server.py subclasses it and replaces the server_class it sets"),
    Joint("verl", "verl.workers.rollout.vllm_rollout.vllm_async_server.vLLMHttpServer.generate",
          ("self", "prompt_ids", "sampling_params", "request_id"),
          "rollout/server.py overrides it (the sampling parameters through rollout/request.py's lean_request)"),
    # vLLM internals the plugin's worker extension and drafter sync read or call (rollout/worker/)
    Joint("vllm", "vllm.model_executor.model_loader.reload.initialize_layerwise_reload", ("model",),
          "rollout/worker/drafter_sync.py reloads the drafter with it"),
    Joint("vllm", "vllm.model_executor.model_loader.reload.finalize_layerwise_reload", None,
          "rollout/worker/drafter_sync.py calls it (model, model_config) after the drafter's load_weights"),
    Joint("vllm", "vllm.config.set_current_vllm_config", ("vllm_config",),
          "rollout/worker/drafter_sync.py loads the drafter inside it"),
    Joint("vllm", "vllm.model_executor.model_loader.utils.get_draft_load_config", ("vllm_config",),
          "rollout/worker/extension.py reads the drafter's start-up load format with it",
          # vLLM 0.26 (the H200 image's): no such function; the extension reads the field vLLM's drafter loads with
          alternatives=("vllm.config.SpeculativeConfig.__dataclass_fields__.draft_load_config",)),
    Joint("vllm", "vllm.distributed.get_tensor_model_parallel_rank", (),
          "rollout/worker/extension.py names the failing worker's rank with it"),
    *(Joint("vllm", f"vllm.{runner}.GPUModelRunner.get_draft_model", ("self",),
            "rollout/worker/drafter_lookup.py finds the drafter with it")
      for runner in ("v1.worker.gpu_model_runner", "v1.worker.gpu.model_runner")),
    *(Joint("vllm", f"vllm.config.{cls}.__dataclass_fields__.{field}", None,
            "rollout/worker/ reads it from the engine's vllm_config")
      for cls, fields in (("VllmConfig", ("speculative_config", "load_config", "model_config", "parallel_config")),
                          ("SpeculativeConfig", ("method",)), ("LoadConfig", ("load_format",)),
                          ("ModelConfig", ("model", "quantization", "hf_config")),
                          ("ParallelConfig", ("tensor_parallel_size", "enable_expert_parallel", "enable_eplb",
                                              "world_size")))
      for field in fields),
)


def installed_versions() -> str:
    out = []
    for dist in ("verl", "megatron-core", "vllm"):
        try:
            out.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{dist} not installed")
    tested = ", ".join(f"{k} {v}" for k, v in TESTED.items())
    return f"installed: {', '.join(out)}; verl_mtp_plugin is tested with {tested}"


def _resolve(path: str):
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for j, attr in enumerate(parts[i:], start=i):
            if isinstance(obj, dict):
                if attr not in obj:
                    raise AttributeError(".".join(parts[: j + 1]))
                obj = obj[attr]
            elif not hasattr(obj, attr):
                raise AttributeError(".".join(parts[: j + 1]))
            else:
                obj = getattr(obj, attr)
        return obj
    raise AttributeError(parts[0])


def _exists(path: str) -> bool:
    try:
        _resolve(path)
    except AttributeError:
        return False
    return True


def probe(lib: str, path: str, params: tuple[str, ...] | None = None, why: str = "",
          alternatives: tuple[str, ...] = ()) -> None:
    """Check that ``path`` exists (and, for a callable, starts with ``params``); CompatError otherwise. Where
    ``path`` is missing, one of ``alternatives`` existing (what an earlier release has instead) passes."""
    because = f" ({why})" if why else ""
    try:
        obj = _resolve(path)
    except AttributeError as e:
        if any(_exists(alt) for alt in alternatives):
            return
        instead = f" (nor {' or '.join(alternatives)})" if alternatives else ""
        raise CompatError(f"{path}: {e.args[0]} is missing in the installed {lib}{instead}{because}; "
                          f"{installed_versions()}") from None
    if params is None:
        return
    try:
        names = tuple(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return
    if names[: len(params)] != tuple(params):
        raise CompatError(f"{path}{inspect.signature(obj)}: the plugin expects parameters ({', '.join(params)}) "
                          f"in the installed {lib}{because}; {installed_versions()}")


def probe_all(libs: tuple[str, ...] = ("verl", "megatron", "vllm")) -> None:
    """Probe every joint of ``libs`` whose library is installed; one CompatError listing every failure."""
    failures = []
    for j in JOINTS:
        if j.lib not in libs or importlib.util.find_spec(j.lib) is None:
            continue
        try:
            probe(j.lib, j.path, j.params, j.why, j.alternatives)
        except CompatError as e:
            failures.append(str(e))
    if failures:
        raise CompatError("verl_mtp_plugin: private internals it relies on changed:\n  - " + "\n  - ".join(failures))
