"""The plugin's start-up check under verl's own entry point (``python -m verl.trainer.main_ppo``).

verl's entry offers no driver-side hook with the config: its ``main`` validates and hands the config to
``TaskRunnerV1.run`` in a Ray actor. The earliest point the plugin gets control with the config is there: the
trainer's ``_setup`` builds ``HFModelConfig`` for the tokenizer first (``_init_tokenizer``), which imports
``actor_rollout_ref.model.external_lib`` (``verl_mtp_plugin``), and next calls ``self._init_dataloader()``
before any resource pool or worker exists. :func:`install` wraps ``PPOTrainer._init_dataloader`` so the
start-up check runs right there, once per trainer: a bad config is refused before any worker builds a model,
with the same message as ``python -m verl_mtp_plugin.main_ppo`` and ``verl-mtp check``.

Installed by the package ``__init__`` when verl's v1 trainer base is already imported (the task runner) and by
:mod:`verl_mtp_plugin.trainer.v1` on import (``VERL_USE_EXTERNAL_MODULES=verl_mtp_plugin.trainer.v1``). The
legacy trainer (``trainer.use_v1=false``) has no such hook; there the plugin engine's constructor check in the
workers (before weights load) is the first.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from typing import Any, Callable

__all__ = ["DRIVER_CHECKED_ENV", "PASSED_LINE", "checked_in_driver", "TARGET", "install", "installed"]

logger = logging.getLogger(__name__)

#: The verl method the check runs before (module, class, method).
TARGET = ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "_init_dataloader")
#: Printed by the hook once the check passed (the trainer runs' logs show it).
PASSED_LINE = "verl_mtp_plugin: start-up check passed (verl's entry point, before the workers)"
_MARK = "_verl_mtp_startup_check"


#: Set (to "1") by ``python -m verl_mtp_plugin.main_ppo``'s task runner: its driver already ran the check.
DRIVER_CHECKED_ENV = "VERL_MTP_STARTUP_CHECKED"


def checked_in_driver() -> bool:
    return os.environ.get(DRIVER_CHECKED_ENV) == "1"


def installed() -> bool:
    mod = sys.modules.get(TARGET[0])
    return bool(mod is not None and getattr(getattr(getattr(mod, TARGET[1], None), TARGET[2], None), _MARK, False))


def install(check: Callable[[Any], Any]) -> bool:
    """Wrap verl's ``PPOTrainer._init_dataloader`` so ``check(config)`` (the plugin's start-up check,
    :func:`verl_mtp_plugin.trainer.config.startup_check`) runs first (idempotent). Returns True when the hook is
    in place."""
    from verl_mtp_plugin.compat.probes import probe

    mod = importlib.import_module(TARGET[0])
    probe("verl", f"{TARGET[0]}.{TARGET[1]}.{TARGET[2]}", params=("self",))
    cls = getattr(mod, TARGET[1])
    original = getattr(cls, TARGET[2])
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def _init_dataloader(self, *args, **kwargs):
        if not getattr(self, _MARK, False) and not checked_in_driver():
            check(self.config)
            self.__dict__[_MARK] = True
            print(PASSED_LINE, flush=True)
        return original(self, *args, **kwargs)

    setattr(_init_dataloader, _MARK, True)
    setattr(cls, TARGET[2], _init_dataloader)
    return True
