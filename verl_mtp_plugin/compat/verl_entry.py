"""The plugin's start-up check under verl's own entry point (``python -m verl.trainer.main_ppo``).

verl's entry offers no driver-side hook with the config: its ``main`` validates and hands the config to a task
runner in a Ray actor (``TaskRunnerV1`` for ``trainer.use_v1=true``, the legacy ``main_ppo_v0.TaskRunner``
otherwise). The earliest point the plugin gets control with the config is there, before any worker:

* **v1 trainer**: the trainer's ``_setup`` builds ``HFModelConfig`` for the tokenizer first (``_init_tokenizer``),
  which imports ``actor_rollout_ref.model.external_lib`` (``verl_mtp_plugin``), and next calls
  ``self._init_dataloader()`` before any resource pool or worker exists: the check runs before
  ``PPOTrainer._init_dataloader``.
* **legacy trainer** (``trainer.use_v1=false``): the task runner builds ``HFModelConfig`` (importing the plugin)
  and the datasets, then constructs ``RayPPOTrainer`` and calls ``init_workers``: the check runs before
  ``RayPPOTrainer.__init__``.

:func:`install` wraps both (idempotent), so a bad config is refused before any worker builds a model, with the
same message as ``python -m verl_mtp_plugin.main_ppo`` and ``verl-mtp check``.

Checked once: a config that passed the check is marked (:func:`mark_checked`, an OmegaConf node flag that travels
with the config to the Ray task runner); the hooks skip a marked config. ``python -m verl_mtp_plugin.main_ppo``
marks the config its driver checked, so its task runner does not repeat the check; nothing a user sets (no
environment variable, no config key) can skip it.

Installed by the package ``__init__`` when verl's trainer modules are already imported (the task runner) and by
:mod:`verl_mtp_plugin.trainer.v1` on import (``VERL_USE_EXTERNAL_MODULES=verl_mtp_plugin.trainer.v1``).
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from typing import Any, Callable

__all__ = ["LEGACY_TARGET", "PASSED_LINE", "TARGET", "already_checked", "install", "installed", "mark_checked",
           "run_check_once"]

logger = logging.getLogger(__name__)

#: The verl methods the check runs before (module, class, method): the v1 trainer's and the legacy trainer's.
TARGET = ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "_init_dataloader")
LEGACY_TARGET = ("verl.trainer.ppo.ray_trainer", "RayPPOTrainer", "__init__")
_PARAMS = {TARGET: ("self",), LEGACY_TARGET: ("self", "config")}
#: Printed by the hook once the check passed (the trainer runs' logs show it).
PASSED_LINE = "verl_mtp_plugin: start-up check passed (verl's entry point, before the workers)"
_MARK = "_verl_mtp_startup_check"
#: The OmegaConf node flag of a config that passed the start-up check.
CHECKED_FLAG = "verl_mtp_startup_checked"


def mark_checked(config: Any) -> None:
    """Record on ``config`` (a DictConfig) that it passed the start-up check."""
    if hasattr(config, "_set_flag"):
        config._set_flag(CHECKED_FLAG, True)


def already_checked(config: Any) -> bool:
    return bool(hasattr(config, "_get_node_flag") and config._get_node_flag(CHECKED_FLAG))


def run_check_once(check: Callable[[Any], Any], config: Any) -> bool:
    """``check(config)`` unless ``config`` already passed it (then False); marks it on success (True)."""
    if already_checked(config):
        return False
    check(config)
    mark_checked(config)
    return True


def _target_of(kind: str) -> tuple[str, str, str]:
    return {"v1": TARGET, "legacy": LEGACY_TARGET}[kind]


def installed(kind: str = "v1") -> bool:
    module, cls, method = _target_of(kind)
    mod = sys.modules.get(module)
    return bool(mod is not None and getattr(getattr(getattr(mod, cls, None), method, None), _MARK, False))


def _install_one(target: tuple[str, str, str], check: Callable[[Any], Any]) -> None:
    from verl_mtp_plugin.compat.probes import probe

    module, cls_name, method = target
    mod = importlib.import_module(module)
    probe("verl", f"{module}.{cls_name}.{method}", params=_PARAMS[target],
          why="compat/verl_entry.py runs the start-up check before it")
    cls = getattr(mod, cls_name)
    original = getattr(cls, method)
    if getattr(original, _MARK, False):
        return

    if target is LEGACY_TARGET:

        @functools.wraps(original)
        def hooked(self, *args, **kwargs):
            config = kwargs["config"] if "config" in kwargs else args[0]
            if run_check_once(check, config):
                print(PASSED_LINE, flush=True)
            return original(self, *args, **kwargs)

    else:

        @functools.wraps(original)
        def hooked(self, *args, **kwargs):
            if run_check_once(check, self.config):
                print(PASSED_LINE, flush=True)
            return original(self, *args, **kwargs)

    setattr(hooked, _MARK, True)
    setattr(cls, method, hooked)


def install(check: Callable[[Any], Any], *, v1: bool | None = None) -> bool:
    """Wrap verl's legacy ``RayPPOTrainer.__init__`` and (``v1``; default: when verl's v1 trainer base is
    imported) ``PPOTrainer._init_dataloader`` so ``check(config)`` (the plugin's start-up check,
    :func:`verl_mtp_plugin.trainer.config.startup_check`) runs first, once per config (idempotent). Returns True
    when the hooks are in place."""
    _install_one(LEGACY_TARGET, check)
    if v1 if v1 is not None else TARGET[0] in sys.modules:
        _install_one(TARGET, check)
    return True
