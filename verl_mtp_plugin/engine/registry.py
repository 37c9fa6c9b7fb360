"""Register the plugin's engines with verl's ``EngineRegistry`` (idempotent).

verl imports ``actor_rollout_ref.model.external_lib`` (``verl_mtp_plugin``) in every process that
builds an ``HFModelConfig``; the package ``__init__`` then calls :func:`register`. A recipe selects the
engine with ``actor_rollout_ref.model.model_type: nemotron_h_mtp`` (verl passes
``model_config.model_type`` to ``EngineRegistry.new``).

Registered keys (``EngineRegistry._engines[model_type][backend][device]``):

* ``(nemotron_h_mtp, megatron, cuda)`` -> :class:`verl_mtp_plugin.engine.megatron.NemotronHMTPMegatronEngine`
  (a ``MegatronEngineWithLMHead``; ``backend="megatron"`` keeps every ``strategy == "megatron"`` check in
  verl working);
* ``(nemotron_h_mtp, <fsdp|fsdp2|fsdp_turbo|veomni|torchtitan|automodel>, cuda|npu)`` ->
  :class:`verl_mtp_plugin.engine.megatron.UnsupportedStrategyEngine`, whose constructor raises
  :class:`~verl_mtp_plugin.policy.MTPConfigError` naming the keys to change (instead of verl's bare
  ``AssertionError: Unknown backend``).

Import cost: ``EngineRegistry.register`` asserts ``issubclass(engine_class, BaseEngine)`` and the
registry lives in ``verl.workers.engine``, whose package ``__init__`` imports every engine (FSDP,
Megatron with megatron-core, ...). Reaching the registry therefore already imports verl's Megatron
engine module, and a lazily-imported engine class would save nothing. :func:`register` costs one
import of ``verl.workers.engine`` (about 16 s cold on a 2-core CPU machine; free in a trainer worker,
where ``TrainingWorker`` imports it anyway) plus about 10 ms for :mod:`verl_mtp_plugin.engine.megatron`.
``import verl_mtp_plugin.engine.registry`` itself imports nothing heavy.
"""

from __future__ import annotations

import importlib.util

from verl_mtp_plugin.config_keys import BACKEND, MODEL_TYPE

__all__ = [
    "DEVICES",
    "UNSUPPORTED_BACKENDS",
    "register",
    "registered_engines",
]

#: Devices the Megatron engine is registered for (verl registers its own Megatron LM engine for CUDA).
DEVICES = ("cuda",)
#: verl backends that cannot run the plugin (registered to fail with a clear message).
UNSUPPORTED_BACKENDS = ("fsdp", "fsdp2", "fsdp_turbo", "veomni", "torchtitan", "automodel")
_UNSUPPORTED_DEVICES = ("cuda", "npu")


def _wanted():
    from verl_mtp_plugin.engine.megatron import NemotronHMTPMegatronEngine, UnsupportedStrategyEngine

    keys = {(BACKEND, d): NemotronHMTPMegatronEngine for d in DEVICES}
    for b in UNSUPPORTED_BACKENDS:
        for d in _UNSUPPORTED_DEVICES:
            keys[(b, d)] = UnsupportedStrategyEngine
    return keys


def _same_class(a: type, b: type) -> bool:
    # A re-imported module (importlib.reload, a second import path) creates a new class object.
    return a is b or (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def registered_engines() -> dict[tuple[str, str], type]:
    """``{(backend, device): engine class}`` currently registered under :data:`MODEL_TYPE`."""
    from verl.workers.engine.base import EngineRegistry

    table = EngineRegistry._engines.get(MODEL_TYPE, {})  # verl has no public per-key lookup
    return {(b, d): cls for b, per_dev in table.items() for d, cls in per_dev.items()}


def register() -> bool:
    """Register the plugin engines with verl's ``EngineRegistry``.

    Idempotent: verl's ``EngineRegistry.register`` asserts on a duplicate key, so keys that already
    hold the plugin's class are skipped.

    Returns:
        bool: True when at least one key was registered by this call; False when verl is not
        installed or everything was already registered.

    Raises:
        RuntimeError: verl is installed but its Megatron engine cannot be imported, or a key under
            ``model_type="nemotron_h_mtp"`` already holds a different engine class.
    """
    if importlib.util.find_spec("verl") is None:
        return False
    try:
        from verl.workers.engine.base import EngineRegistry
        from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead  # noqa: F401

        wanted = _wanted()
    except ImportError as e:
        raise RuntimeError(
            "verl_mtp_plugin: verl is installed but its Megatron engine cannot be imported "
            f"({type(e).__name__}: {e}); the plugin engine '{MODEL_TYPE}' needs verl's Megatron backend "
            "(megatron-core) in this environment"
        ) from e

    existing = registered_engines()
    todo = []
    for key, cls in wanted.items():
        have = existing.get(key)
        if have is None:
            todo.append((key, cls))
        elif not _same_class(have, cls):
            raise RuntimeError(
                f"verl_mtp_plugin: EngineRegistry key model_type={MODEL_TYPE!r}, backend={key[0]!r}, "
                f"device={key[1]!r} already holds {have.__module__}.{have.__qualname__}; refusing to shadow it"
            )
    for (backend, device), cls in todo:
        EngineRegistry.register(model_type=MODEL_TYPE, backend=backend, device=device)(cls)
    # the trainer's weight sender fails in seconds when the vLLM worker receiving an update dies
    from verl_mtp_plugin.compat.verl_weight_sender import install as _watch_weight_receiver

    _watch_weight_receiver()
    return bool(todo)
