"""What one Megatron engine of the plugin checks and sets at build time.

:func:`resolve_engine_settings` is the part of the start-up check (:mod:`verl_mtp_plugin.trainer.config`)
that the engine can run itself from its ``HFModelConfig`` and ``McoreEngineConfig`` (it runs in every
engine constructor); :func:`apply_mtp_overrides` writes the mode's Megatron fields into verl's
``override_transformer_config``. Imports no verl: the start-up check reads it without starting verl's engines.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from verl_mtp_plugin.config_keys import ACTOR as _ACTOR
from verl_mtp_plugin.config_keys import ACTOR_MEGATRON as _MEG
from verl_mtp_plugin.config_keys import BACKEND, MODEL_TYPE, OBJECTIVE_CONFIG_KEY, OBJECTIVE_ENV, as_bool, get_key, to_plain
from verl_mtp_plugin.config_keys import MODEL as _M
from verl_mtp_plugin.config_keys import MTP as _MTP
from verl_mtp_plugin.policy import MTPConfigError, MTPMode, MTPObjective, mode_from_verl_mtp

__all__ = [
    "BRIDGE_NO_MTP_OVERRIDES",
    "EngineMTPSettings",
    "LATENT_MOE_OVERRIDES",
    "apply_mtp_overrides",
    "engine_errors",
    "hf_latent_moe",
    "hf_mtp_num_layers",
    "is_hybrid_hf_config",
    "model_lora_rank",
    "objective_errors",
    "resolve_engine_settings",
    "strategy_error",
]

#: ``override_transformer_config`` entries that make Megatron-Bridge's ``HybridModelProvider`` build
#: no MTP block (with ``mtp_num_layers=None``, which verl's ``check_mtp_config`` sets when the
#: engine's MTP is off): ``finalize`` appends ``mtp_hybrid_override_pattern`` to the layer pattern
#: whenever it is set and ``mtp_use_repeated_layer`` is on.
BRIDGE_NO_MTP_OVERRIDES = {"mtp_hybrid_override_pattern": None, "mtp_use_repeated_layer": False}


def hf_mtp_num_layers(hf_config: Any) -> int:
    """MTP layer count of an HF config, read like verl's ``check_mtp_config`` (``num_nextn_predict_layers``,
    ``mtp_num_hidden_layers``, ``text_config.mtp_num_hidden_layers``); 0 when none."""
    for owner, key in ((hf_config, "num_nextn_predict_layers"), (hf_config, "mtp_num_hidden_layers")):
        value = getattr(owner, key, None) or 0
        if value > 0:
            return int(value)
    text = getattr(hf_config, "text_config", None)
    value = getattr(text, "mtp_num_hidden_layers", None) or 0 if text is not None else 0
    return int(value) if value > 0 else 0


def is_hybrid_hf_config(hf_config: Any) -> bool:
    """True for hybrid Mamba models (Nemotron-H / Nemotron 3)."""
    if getattr(hf_config, "model_type", None) in ("nemotron_h", "nemotron_h_puzzle"):
        return True
    blocks = getattr(hf_config, "layers_block_type", None) or []
    if any(str(b).lower() == "mamba" for b in blocks):
        return True
    return "M" in str(getattr(hf_config, "hybrid_override_pattern", "") or "")


@dataclasses.dataclass(frozen=True)
class EngineMTPSettings:
    """What the plugin engine needs at build time.

    Attributes:
        mode: the MTP mode for this engine (``off`` for verl's reference model, whose MTP config verl
            forces to ``enable=false``).
        mtp_loss_scaling_factor: the value Megatron will use (``override_transformer_config`` wins, as
            in verl's ``check_mtp_config``), None for mode ``off``.
        set_scaling_factor: whether the plugin must write ``mtp_loss_scaling_factor`` into the
            overrides (False when the user already set it there).
        objective: the MTP block's training objective (:data:`~verl_mtp_plugin.config_keys.OBJECTIVE_CONFIG_KEY`;
            :mod:`verl_mtp_plugin.objective`), ``hard_ce`` when unset.
        latent_moe: the checkpoint's MoE layers are latent (HF ``moe_latent_size``, Nemotron 3 Super): the plugin
            turns Megatron's shared-expert overlap off (:data:`LATENT_MOE_OVERRIDES`) unless the user set it.
        draft_k: vLLM's drafts per verify step (``actor_rollout_ref.model.mtp.num_speculative_tokens`` where verl
            speculates, ``mtp.enable`` and ``mtp.enable_rollout``; the start-up check refuses a different
            ``speculative_config.num_speculative_tokens``), the ``k`` of the trainer's drafted acceptance estimate; None
            without speculation (the estimate then drafts as many as the MTP depths).
    """

    mode: MTPMode
    mtp_loss_scaling_factor: float | None
    set_scaling_factor: bool
    objective: MTPObjective = MTPObjective.HARD_CE
    latent_moe: bool = False
    draft_k: int | None = None


#: ``override_transformer_config`` entries for a checkpoint with latent MoE (HF ``moe_latent_size``; Nemotron 3
#: Super). Megatron-Bridge 0.6.2 turns the shared-expert overlap on for every Nemotron-H
#: (``megatron/bridge/models/nemotronh/nemotron_h_bridge.py:296``), and megatron-core 0.19.2 refuses it with latent
#: projections in training and in every forward outside its NVLS inference dispatcher
#: (``megatron/core/transformer/moe/moe_layer.py:468-479``: verl's log-prob, reference and update passes).
#: Measured on the H200: verl's trainer on a Super-width checkpoint stopped at its first log-prob pass.
LATENT_MOE_OVERRIDES = {"moe_shared_expert_overlap": False}
LATENT_MOE_KEY = f"{_MEG}.override_transformer_config.moe_shared_expert_overlap"


def hf_latent_moe(hf_config: Any) -> bool:
    """Whether the HF config's MoE layers project to a latent size (``moe_latent_size``)."""
    if hf_config is None:
        return False
    value = hf_config.get("moe_latent_size") if isinstance(hf_config, Mapping) else getattr(hf_config, "moe_latent_size", None)
    return bool(value)


def objective_errors(value: Any, mode: MTPMode | None, errors: list[str], *, check_mode: bool = True,
                     key: str = OBJECTIVE_CONFIG_KEY) -> MTPObjective:
    """The MTP objective (:data:`~verl_mtp_plugin.config_keys.OBJECTIVE_CONFIG_KEY`), checked; appends each problem
    to ``errors``, naming ``key`` (where it was set: the recipe's key or the driver's environment variable). Unset: ``hard_ce``. Another value trains the MTP block and so needs mode online or joint:
    an error at start-up (``check_mode``); an engine whose mode trains no MTP (verl's reference model, which
    shares the workers' environment) just gets ``hard_ce``."""
    if value is None or str(value).strip() == "":
        return MTPObjective.HARD_CE
    try:
        objective = MTPObjective.parse(value, key)
    except MTPConfigError as e:
        errors.append(str(e))
        return MTPObjective.HARD_CE
    if objective is not MTPObjective.HARD_CE and mode in (MTPMode.OFF, MTPMode.FROZEN):
        if not check_mode:
            return MTPObjective.HARD_CE
        errors.append(
            f"{key}={objective} trains the MTP block, but mode '{mode}' never trains it; set it to hard_ce "
            f"(or drop it) or {_MTP}.enable_train=true (online: detach_encoder=true)"
        )
    return objective


def engine_errors(
    *,
    mtp: Any,
    hf_config: Any,
    overrides: Mapping[str, Any],
    use_fused_kernels: bool,
    vanilla_mbridge: bool,
    context_parallel_size: int,
    dynamic_context_parallel: bool,
    router_replay_mode: str,
    lora_rank: int,
    errors: list[str],
    virtual_pipeline_model_parallel_size: Any = None,
    objective: Any = None,
    check_objective_mode: bool = True,
    objective_key: str = OBJECTIVE_CONFIG_KEY,
) -> EngineMTPSettings | None:
    """The engine-level checks on already-read settings; appends each problem to ``errors``.

    Returns:
        EngineMTPSettings, or None when the MTP mode itself could not be resolved.
    """
    try:
        mode = mode_from_verl_mtp(
            as_bool(get_key(mtp, "enable", False)),
            as_bool(get_key(mtp, "enable_train", False)),
            as_bool(get_key(mtp, "detach_encoder", False)),
        )
    except MTPConfigError as e:
        errors.append(str(e))
        mode = None

    if use_fused_kernels:
        errors.append(
            f"{_M}.use_fused_kernels=true is not supported by model_type={MODEL_TYPE}: verl's fused "
            "forward patches GPTModel's output layer and HybridModel has no such hook; set it to false"
        )
    if vanilla_mbridge:
        errors.append(
            f"{_MEG}.vanilla_mbridge=true: the plugin engine needs Megatron-Bridge (vanilla_mbridge=false) to "
            "install its pre-wrap hook (MTP freezing before DDP); the legacy mbridge has no Nemotron-H mapping"
        )
    if int(context_parallel_size or 1) > 1 or dynamic_context_parallel:
        errors.append(
            f"{_MEG}.context_parallel_size={context_parallel_size} / dynamic_context_parallel="
            f"{dynamic_context_parallel}: the plugin engine supports context parallel size 1 only (its MTP loss "
            "mask is packed for CP=1)"
        )
    if virtual_pipeline_model_parallel_size is not None:
        errors.append(
            f"{_MEG}.virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size}: Megatron-Bridge "
            "refuses virtual pipeline parallelism for hybrid (Nemotron-H) models (HybridModelProvider.provide "
            "asserts it is None) and verl passes any value through; set it to null"
        )
    if str(router_replay_mode or "disabled") != "disabled":
        errors.append(
            f"{_MEG}.router_replay.mode={router_replay_mode!r}: router replay is not supported by "
            f"model_type={MODEL_TYPE} yet; set it to 'disabled'"
        )

    if mode is None:
        return None
    objective = objective_errors(objective, mode, errors, check_mode=check_objective_mode, key=objective_key)

    hf_layers = hf_mtp_num_layers(hf_config) if hf_config is not None else None
    if mode is not MTPMode.OFF and hf_layers == 0:
        errors.append(
            f"{_MTP}.enable=true but the model's HF config has no MTP layers (num_nextn_predict_layers / "
            f"mtp_num_hidden_layers = 0 in {_M}.path); use a checkpoint with MTP or set {_MTP}.enable=false"
        )

    latent = hf_latent_moe(hf_config)
    if latent and as_bool(overrides.get("moe_shared_expert_overlap", False)):
        errors.append(
            f"{LATENT_MOE_KEY}={overrides['moe_shared_expert_overlap']} with a latent-MoE checkpoint (moe_latent_size="
            f"{hf_config.get('moe_latent_size') if isinstance(hf_config, Mapping) else getattr(hf_config, 'moe_latent_size', None)} "
            f"in {_M}.path): megatron-core refuses the shared-expert overlap with latent projections in training and "
            "in verl's log-prob and reference passes (moe_layer.py: it needs the NVLS inference dispatcher); remove "
            "the override (the plugin turns the overlap off for latent MoE) or set it to false"
        )
    scale = get_key(mtp, "mtp_loss_scaling_factor", 0.1)
    over_scale = overrides.get("mtp_loss_scaling_factor")
    if mode is MTPMode.OFF:
        return EngineMTPSettings(mode, None, False, objective, latent)
    if int(lora_rank or 0) > 0 and mode in (MTPMode.ONLINE, MTPMode.JOINT):
        errors.append(
            f"{_M}.lora.rank={lora_rank} with MTP training ({_MTP}.enable_train=true): LoRA freezes every base "
            "parameter, the MTP block included, so it would never train; use mode frozen (enable_train=false) "
            "or full fine-tuning"
        )

    depth = overrides.get("mtp_num_layers", hf_layers)
    if depth is not None and hf_layers and int(depth) != hf_layers and not as_bool(
        overrides.get("mtp_use_repeated_layer", False)
    ):
        errors.append(
            f"{_MEG}.override_transformer_config.mtp_num_layers={depth} differs from the checkpoint's "
            f"num_nextn_predict_layers={hf_layers} without mtp_use_repeated_layer=true: Megatron would build "
            f"{depth} separate MTP layers the checkpoint does not have (and vLLM's drafter ignores layers past "
            "the first); set override_transformer_config.mtp_use_repeated_layer=true (Nemotron 3 Super: "
            "mtp_num_layers=2 applies the one MTP block twice)"
        )
    if "mtp_detach_heads" in overrides and as_bool(overrides["mtp_detach_heads"]) != (mode is MTPMode.ONLINE):
        errors.append(
            f"{_MEG}.override_transformer_config.mtp_detach_heads={overrides['mtp_detach_heads']} contradicts "
            f"mode '{mode}' ({_MTP}.detach_encoder={get_key(mtp, 'detach_encoder', False)}); remove the override: "
            f"the plugin sets it from {_MTP}.detach_encoder"
        )
    if over_scale is not None and scale is not None and float(over_scale) != float(scale):
        errors.append(
            f"{_MEG}.override_transformer_config.mtp_loss_scaling_factor={over_scale} and "
            f"{_MTP}.mtp_loss_scaling_factor={scale} disagree (verl silently keeps the override); set one"
        )
    effective = float(over_scale if over_scale is not None else scale)
    if effective < 0:
        errors.append(f"{_MTP}.mtp_loss_scaling_factor={effective} must be >= 0")
    return EngineMTPSettings(mode, effective, over_scale is None, objective, latent)


def resolve_engine_settings(model_config: Any, engine_config: Any) -> EngineMTPSettings:
    """Engine-side validation (runs in the plugin engine's constructor).

    Args:
        model_config: verl ``HFModelConfig`` (``mtp``, ``hf_config``, ``use_fused_kernels``).
        engine_config: verl ``McoreEngineConfig``.

    Returns:
        EngineMTPSettings.

    Raises:
        MTPConfigError: every problem found, one per line, naming the verl keys.
    """
    errors: list[str] = []
    strategy = get_key(engine_config, "strategy", BACKEND)
    if strategy != BACKEND:
        errors.append(strategy_error(strategy))
    settings = engine_errors(
        mtp=get_key(model_config, "mtp"),
        hf_config=get_key(model_config, "hf_config"),
        overrides=dict(to_plain(get_key(engine_config, "override_transformer_config", {})) or {}),
        use_fused_kernels=as_bool(get_key(engine_config, "use_fused_kernels", False))
        or as_bool(get_key(model_config, "use_fused_kernels", False)),
        vanilla_mbridge=as_bool(get_key(engine_config, "vanilla_mbridge", False)),
        context_parallel_size=get_key(engine_config, "context_parallel_size", 1),
        dynamic_context_parallel=as_bool(get_key(engine_config, "dynamic_context_parallel", False)),
        router_replay_mode=get_key(engine_config, "router_replay.mode", "disabled"),
        lora_rank=model_lora_rank(model_config),
        errors=errors,
        virtual_pipeline_model_parallel_size=get_key(engine_config, "virtual_pipeline_model_parallel_size"),
        objective=os.environ.get(OBJECTIVE_ENV),
        check_objective_mode=False,
        objective_key=OBJECTIVE_ENV,  # this worker's environment (the recipe's env_vars key or the driver's, unknown here)
    )
    if errors:
        raise MTPConfigError(f"invalid MTP setup for model_type={MODEL_TYPE}:\n  - " + "\n  - ".join(errors))
    assert settings is not None
    mtp = get_key(model_config, "mtp")
    if as_bool(get_key(mtp, "enable", False)) and as_bool(get_key(mtp, "enable_rollout", False)):  # verl speculates
        k = get_key(mtp, "num_speculative_tokens", None)
        if isinstance(k, int) and not isinstance(k, bool) and k >= 1:  # the start-up check refuses anything else
            settings = dataclasses.replace(settings, draft_k=k)
    return settings


def model_lora_rank(model_cfg: Any) -> int:
    """Megatron LoRA rank (``model.lora.rank``) or the FSDP-style ``model.lora_rank``."""
    return int(get_key(model_cfg, "lora.rank", 0) or 0) or int(get_key(model_cfg, "lora_rank", 0) or 0)


def strategy_error(strategy: str) -> str:
    return (
        f"{_M}.model_type={MODEL_TYPE} needs the Megatron backend but {_ACTOR}.strategy={strategy!r}; set "
        f"model_engine=megatron (actor/ref strategy megatron) or drop {_M}.model_type"
    )


def apply_mtp_overrides(overrides: dict, settings: EngineMTPSettings) -> dict:
    """Write the build-time Megatron fields for ``settings.mode`` into verl's
    ``override_transformer_config`` dict (before verl builds the Megatron-Bridge provider).

    off: ``mtp_num_layers=None`` and :data:`BRIDGE_NO_MTP_OVERRIDES` (Megatron-Bridge's
    ``HybridModelProvider.finalize`` re-appends ``mtp_hybrid_override_pattern`` and sets
    ``mtp_num_layers=1`` whenever ``mtp_use_repeated_layer`` is on, which the Bridge defaults to for
    any checkpoint with MTP layers: ``mtp_num_layers=None`` alone still builds ``model.mtp``);
    online: ``mtp_detach_heads=True``; frozen/joint: ``mtp_detach_heads=False``;
    ``mtp_loss_scaling_factor`` unless the user set it there; a latent-MoE checkpoint (every mode, the reference
    model's too): :data:`LATENT_MOE_OVERRIDES`.
    """
    from verl_mtp_plugin.control import configure_transformer_config

    configure_transformer_config(
        overrides,
        settings.mode,
        mtp_loss_scaling_factor=settings.mtp_loss_scaling_factor if settings.set_scaling_factor else None,
    )
    if settings.mode is MTPMode.OFF:
        overrides.update(BRIDGE_NO_MTP_OVERRIDES)
    if settings.latent_moe:
        overrides.update(LATENT_MOE_OVERRIDES)
    return overrides
