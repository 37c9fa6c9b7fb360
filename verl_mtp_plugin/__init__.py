"""verl-mtp-plugin: per-phase MTP control for verl + Megatron-Core HybridModel (Nemotron 3) and exact
MTP weight sync into vLLM's drafter.

``import verl_mtp_plugin`` is light (no torch, Megatron, verl or vLLM import): the policy names are
eager, everything else is loaded on first attribute access. verl imports this package in every
process that builds a model config when a recipe sets
``actor_rollout_ref.model.external_lib: verl_mtp_plugin``; that import registers the plugin's engine
with verl (:func:`register`) when verl is importable.
"""

from __future__ import annotations

import importlib

from verl_mtp_plugin._version import __version__
from verl_mtp_plugin.policy import (
    MTPConfigError,
    MTPMode,
    MTPObjective,
    Phase,
    mode_from_verl_mtp,
    rollout_may_speculate,
    run_mtp_forward,
)

# name -> module that defines it (loaded lazily)
_LAZY = {
    "hybrid_forward": "verl_mtp_plugin.control",
    "forward_for_phase": "verl_mtp_plugin.control",
    "freeze_mtp": "verl_mtp_plugin.control",
    "configure_transformer_config": "verl_mtp_plugin.control",
    "validate_model_for_mode": "verl_mtp_plugin.control",
    "native_mtp_kwarg": "verl_mtp_plugin.control",
    "unwrap_model": "verl_mtp_plugin.control",
    "mtp_parameters": "verl_mtp_plugin.control",
    "UnsupportedMTPModelError": "verl_mtp_plugin.control",
    "collect_mtp_metrics": "verl_mtp_plugin.metrics",
    "reset_mtp_metrics": "verl_mtp_plugin.metrics",
    "mtp_objective_scope": "verl_mtp_plugin.objective",
    "export_mtp_weights": "verl_mtp_plugin.export",
    "expected_hf_mtp_keys": "verl_mtp_plugin.export",
    "MTPExportError": "verl_mtp_plugin.export",
    "MTPDrafterSync": "verl_mtp_plugin.rollout.worker.drafter_sync",
    "MTPSyncError": "verl_mtp_plugin.rollout.worker.drafter_sync",
    "register": "verl_mtp_plugin.engine.registry",
    "MODEL_TYPE": "verl_mtp_plugin.config_keys",
    "validate_verl_config": "verl_mtp_plugin.trainer.config",
    "NemotronHMTPMegatronEngine": "verl_mtp_plugin.engine.megatron",
}

__all__ = [
    "MTPConfigError",
    "MTPMode",
    "MTPObjective",
    "Phase",
    "__version__",
    "mode_from_verl_mtp",
    "rollout_may_speculate",
    "run_mtp_forward",
    *_LAZY,
]


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'verl_mtp_plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


import os as _os  # noqa: E402
import sys as _sys  # noqa: E402

if "verl" in _sys.modules:
    # Imported by verl (actor_rollout_ref.model.external_lib) or after verl: register the engine with
    # verl's EngineRegistry. A bare `import verl_mtp_plugin` elsewhere (vLLM workers, tools) stays light.
    from verl_mtp_plugin.engine.registry import register as _register_with_verl

    _register_with_verl()
    # verl's rollout registry: its `vllm` replica starts the plugin's server (requests without detokenization)
    from verl_mtp_plugin.rollout.replica import install as _install_rollout_server

    _install_rollout_server()
    if "verl.trainer.ppo.v1.trainer_base" in _sys.modules or "verl.trainer.ppo.ray_trainer" in _sys.modules:
        # verl's task runner (python -m verl.trainer.main_ppo, v1 or legacy trainer): it imports external_lib while
        # it builds the tokenizer, before any worker; the plugin's start-up check runs next (compat/verl_entry.py)
        from verl_mtp_plugin.compat.verl_entry import install as _install_startup_check
        from verl_mtp_plugin.trainer.config import startup_check as _startup_check

        _install_startup_check(_startup_check)
    elif "verl_mtp_plugin" in [m.strip() for m in _os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",")]:
        # verl imports VERL_USE_EXTERNAL_MODULES as it is itself imported, before its trainer modules: the bare
        # package there means what the documented verl_mtp_plugin.trainer.v1 does (the plugin's trainers and the
        # start-up check under verl's entry point), which would otherwise never be installed in this process
        importlib.import_module("verl_mtp_plugin.trainer.v1")
