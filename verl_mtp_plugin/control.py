"""Call-time MTP control for Megatron-Core ``HybridModel`` (and ``GPTModel``), plus the mode helpers.

* :func:`hybrid_forward` runs one forward with ``run_mtp_forward`` chosen by the caller (usually
  from :func:`verl_mtp_plugin.policy.run_mtp_forward`). It passes the native megatron kwarg when the
  installed release has one (``run_mtp_forward`` or upstream's ``compute_mtp_loss``) and otherwise
  uses :mod:`verl_mtp_plugin.compat.megatron_mtp_skip`.
* :func:`freeze_mtp` is the frozen mode's pre-wrap hook (before DDP and the optimizer).
* :func:`configure_transformer_config` sets the Megatron config fields a mode needs at build time.
* :func:`validate_model_for_mode` fails early, naming the setting, on contradictions.

Megatron is imported lazily inside functions: importing this module costs only ``torch``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Iterator

import torch

from verl_mtp_plugin.policy import MTPConfigError, MTPMode

__all__ = [
    "NATIVE_MTP_KWARGS",
    "UnsupportedMTPModelError",
    "configure_transformer_config",
    "forward_for_phase",
    "freeze_mtp",
    "hybrid_forward",
    "model_has_mtp",
    "mtp_parameters",
    "native_mtp_kwarg",
    "unwrap_model",
    "validate_model_for_mode",
    "validate_pattern",
]

#: Keyword-only forward arguments that control the MTP forward natively, in order of preference:
#: ``run_mtp_forward`` (Megatron-LM PR #6084 design) and ``compute_mtp_loss`` (PR #6119, main).
NATIVE_MTP_KWARGS = ("run_mtp_forward", "compute_mtp_loss")


class UnsupportedMTPModelError(MTPConfigError, TypeError):
    """The model carries MTP layers but is neither a ``HybridModel`` nor a ``GPTModel``."""


def unwrap_model(model: Any) -> torch.nn.Module:
    """Strip Megatron/torch wrappers (``DistributedDataParallel``, ``Float16Module``, ...) that keep
    the wrapped model in ``.module``."""
    seen = 0
    while isinstance(getattr(model, "module", None), torch.nn.Module) and seen < 8:
        model = model.module
        seen += 1
    return model


def _supported_classes() -> tuple[type, ...]:
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    return (HybridModel, GPTModel)


def _check_supported(inner: torch.nn.Module) -> None:
    if isinstance(inner, _supported_classes()):
        return
    if getattr(inner, "mtp", None) is not None or getattr(inner, "mtp_process", False):
        raise UnsupportedMTPModelError(
            f"unsupported MTP-bearing model: {type(inner).__module__}.{type(inner).__qualname__} carries "
            "MTP layers but is neither megatron.core HybridModel nor GPTModel; verl_mtp_plugin cannot "
            "control its MTP forward. Use a HybridModel (Nemotron 3) or set the mode to 'off'."
        )
    raise UnsupportedMTPModelError(
        f"unsupported model: {type(inner).__qualname__} is neither megatron.core HybridModel nor GPTModel"
    )


@functools.lru_cache(maxsize=None)
def _native_kwarg_for_class(cls: type) -> str | None:
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return None
    for name in NATIVE_MTP_KWARGS:
        p = params.get(name)
        if p is not None and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
            return name
    return None


def native_mtp_kwarg(model: Any) -> str | None:
    """The native MTP-control kwarg of ``model``'s forward (``run_mtp_forward``/``compute_mtp_loss``),
    or ``None`` when the installed megatron-core has neither (0.19.x: the compat path is used)."""
    return _native_kwarg_for_class(type(unwrap_model(model)))


def _is_inference_call(forward_kwargs: dict) -> bool:
    if forward_kwargs.get("inference_context") is not None or forward_kwargs.get("inference_params") is not None:
        return True
    from megatron.core.inference.utils import InferenceMode

    return bool(InferenceMode.is_active())


def hybrid_forward(model, input_ids, position_ids, attention_mask, *, run_mtp_forward: bool, **forward_kwargs):
    """Run ``model``'s forward with the MTP forward on or off for this call only.

    Args:
        model: a megatron ``HybridModel`` (or ``GPTModel``), possibly wrapped in DDP/Float16Module.
        input_ids (Tensor): ``[b, s]`` token ids.
        position_ids (Tensor): ``[b, s]`` positions.
        attention_mask (Tensor | None): megatron mask, True = masked.
        run_mtp_forward (bool): ``True`` = the library's own behaviour, unchanged. ``False`` = skip
            the MTP forward and the MTP loss; the MTP module, its parameters and state-dict keys stay;
            the base output (logits ``[b, s, V]`` when ``labels`` is None, else per-token loss
            ``[b, s]``; hidden states on intermediate pipeline stages) is returned. Ranks without an
            MTP module and inference / speculative-decoding calls are never changed.
        **forward_kwargs: passed to the model's forward (``labels``, ``loss_mask``,
            ``packed_seq_params``, ``inference_context``, ``runtime_gather_output``, ...).

    Returns:
        whatever the model's forward returns.

    Raises:
        UnsupportedMTPModelError: the model carries MTP layers but is not HybridModel/GPTModel.
    """
    inner = unwrap_model(model)
    _check_supported(inner)
    kw = _native_kwarg_for_class(type(inner))
    if kw is not None:
        forward_kwargs[kw] = bool(run_mtp_forward)
        return model(input_ids, position_ids, attention_mask, **forward_kwargs)
    if run_mtp_forward or _is_inference_call(forward_kwargs):
        return model(input_ids, position_ids, attention_mask, **forward_kwargs)
    from verl_mtp_plugin.compat.megatron_mtp_skip import skip_mtp_forward

    with skip_mtp_forward(inner):
        return model(input_ids, position_ids, attention_mask, **forward_kwargs)


def forward_for_phase(model, mode, phase, input_ids, position_ids, attention_mask, **forward_kwargs):
    """:func:`hybrid_forward` with ``run_mtp_forward`` looked up in the policy table."""
    from verl_mtp_plugin.policy import run_mtp_forward

    return hybrid_forward(
        model, input_ids, position_ids, attention_mask, run_mtp_forward=run_mtp_forward(mode, phase), **forward_kwargs
    )


def mtp_parameters(model) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` for every MTP parameter (names relative to the unwrapped model)."""
    for name, p in unwrap_model(model).named_parameters():
        if name.startswith("mtp."):
            yield name, p


def model_has_mtp(model) -> bool:
    """True when the model was built with MTP layers (``config.mtp_num_layers`` set), on any rank."""
    inner = unwrap_model(model)
    cfg = getattr(inner, "config", None)
    return bool(getattr(cfg, "mtp_num_layers", None)) or getattr(inner, "mtp", None) is not None


def freeze_mtp(model) -> list[str]:
    """Frozen mode's pre-wrap hook: ``requires_grad=False`` on every MTP parameter.

    Call it before DDP wrapping and optimizer construction: megatron's DDP and optimizer (and
    torch's) then allocate no gradient buffer and no optimizer state for these parameters.
    Checkpoint keys are unchanged (parameters stay registered), so strict loading still works.
    Works on a list of model chunks (what Megatron-Bridge pre-wrap hooks receive) too.

    Returns:
        list[str]: the names frozen (empty on a pipeline rank without the MTP module).
    """
    if isinstance(model, (list, tuple)):
        names: list[str] = []
        for chunk in model:
            names += freeze_mtp(chunk)
        return names
    names = []
    for name, p in mtp_parameters(model):
        p.requires_grad_(False)
        names.append(name)
    return names


def configure_transformer_config(config, mode, *, mtp_loss_scaling_factor: float | None = None):
    """Set the build-time Megatron fields for ``mode`` on a ``TransformerConfig`` or an override dict.

    off: ``mtp_num_layers=None`` (MTP not built). online: ``mtp_detach_heads=True`` (MTP loss reaches
    MTP parameters only). joint and frozen: ``mtp_detach_heads=False``. ``mtp_loss_scaling_factor`` is
    passed through when given.

    Returns:
        the same object, updated.
    """
    mode = MTPMode.parse(mode, "mode")

    def put(key, value):
        if isinstance(config, dict):
            config[key] = value
        else:
            setattr(config, key, value)

    if mode is MTPMode.OFF:
        put("mtp_num_layers", None)
        return config
    put("mtp_detach_heads", mode is MTPMode.ONLINE)
    if mtp_loss_scaling_factor is not None:
        put("mtp_loss_scaling_factor", float(mtp_loss_scaling_factor))
    return config


def validate_pattern(pattern: str | None, mtp_num_layers: int | None) -> list[str]:
    """Errors for a hybrid layer pattern whose MTP depth disagrees with ``mtp_num_layers``."""
    if not pattern:
        return []
    from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern

    try:
        parsed = parse_hybrid_pattern(pattern)
    except Exception as e:  # megatron's own message names the bad symbol
        return [f"hybrid_layer_pattern={pattern!r} is invalid: {e}"]
    depths = parsed.mtp_num_depths or 0
    if (mtp_num_layers or 0) != depths:
        return [
            f"hybrid_layer_pattern={pattern!r} has {depths} MTP depth(s) but mtp_num_layers={mtp_num_layers}; "
            "megatron builds MTP from both and needs them equal (Megatron-Bridge builds the pattern as "
            "main + '/' + '/'.join([mtp_hybrid_override_pattern] * mtp_num_layers))"
        ]
    return []


def validate_model_for_mode(model, mode, *, freeze_base: bool = False) -> MTPMode:
    """Check that ``model`` can run in ``mode``; raise one :class:`MTPConfigError` listing every problem.

    Args:
        model: the (possibly wrapped) megatron model, after :func:`freeze_mtp` where applicable.
        mode (MTPMode | str): the requested mode.
        freeze_base (bool): the plugin option ``freeze_base`` (train MTP only, base frozen).

    Returns:
        MTPMode: the parsed mode.
    """
    mode = MTPMode.parse(mode, "mode")
    inner = unwrap_model(model)
    _check_supported(inner)
    errors: list[str] = []
    cfg = inner.config
    has_mtp = model_has_mtp(inner)
    if mode is not MTPMode.OFF and not has_mtp:
        errors.append(
            f"MTP mode '{mode}' requested but the model has no MTP layers (config.mtp_num_layers="
            f"{cfg.mtp_num_layers}); the checkpoint's HF config needs num_nextn_predict_layers > 0 and the "
            "hybrid pattern a '/<mtp pattern>' suffix, or set mode 'off'"
        )
    if mode is MTPMode.OFF and getattr(inner, "mtp", None) is not None:
        errors.append(
            "mode 'off' but the model was built with MTP layers; build it with mtp_num_layers=None "
            "(actor_rollout_ref.model.mtp.enable=false does this through verl's check_mtp_config)"
        )
    errors += validate_pattern(getattr(inner, "hybrid_layer_pattern", None), cfg.mtp_num_layers)
    if mode is MTPMode.FROZEN and freeze_base:
        errors.append(
            "mode 'frozen' together with freeze_base=true: the MTP layers and the base model would both be "
            "frozen and nothing trains; use mode 'online' to train MTP only, or drop freeze_base"
        )
    if mode in (MTPMode.ONLINE, MTPMode.JOINT):
        frozen = [n for n, p in mtp_parameters(inner) if not p.requires_grad]
        if frozen:
            errors.append(
                f"mode '{mode}' trains the MTP layers but {len(frozen)} MTP parameter(s) have requires_grad=False "
                f"(e.g. {frozen[0]}); do not call freeze_mtp / a freeze hook in this mode, or use mode 'frozen'"
            )
        detach = bool(getattr(cfg, "mtp_detach_heads", False))
        if mode is MTPMode.ONLINE and not detach:
            errors.append(
                "mode 'online' needs the MTP gradient isolated from the trunk: config.mtp_detach_heads=True "
                "(configure_transformer_config sets it; verl key actor_rollout_ref.model.mtp.detach_encoder=true)"
            )
        if mode is MTPMode.JOINT and detach:
            errors.append(
                "mode 'joint' trains the trunk with the MTP loss but config.mtp_detach_heads=True blocks it "
                "(verl key actor_rollout_ref.model.mtp.detach_encoder=false)"
            )
    if errors:
        raise MTPConfigError("invalid MTP setup:\n  - " + "\n  - ".join(errors))
    return mode
