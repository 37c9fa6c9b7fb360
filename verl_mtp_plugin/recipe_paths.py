"""Where the shipped recipes are: package data in ``verl_mtp_plugin/recipes/`` (the repository's ``recipes/``
links there), so a checkout and an installed wheel find the same files, through the package.

``python -m verl_mtp_plugin.main_ppo --config-name grpo_online`` reads :data:`CONFIG_DIR` when no
``--config-path`` is given, and the documented ``--config-path recipes/nemotron3_super_mtp/config`` means
the shipped folder when no such folder exists under verl's ``verl/trainer`` or the working directory
(:func:`verl_mtp_plugin.trainer.main_ppo.verl_relative_config_path`).
"""

from __future__ import annotations

import os
import pathlib

__all__ = ["CONFIG_DIR", "PACKAGE_DIR", "RECIPE_DIR", "RECIPES", "resolve_path", "shipped", "verl_trainer_dir"]

#: the package folder: ``recipes/...`` relative to it is the shipped recipes folder
PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
#: the Nemotron 3 Super recipe (verl-recipe layout: ``config/``, ``run_*.sh``, ``REQUIRED_VERL.txt``)
RECIPE_DIR = PACKAGE_DIR / "recipes" / "nemotron3_super_mtp"
#: its Hydra config folder (``--config-path``)
CONFIG_DIR = RECIPE_DIR / "config"
#: the runnable config names in :data:`CONFIG_DIR` (``super_mtp_common`` is composed into each)
RECIPES = ("grpo_frozen", "grpo_online", "grpo_joint", "ppo_frozen", "ppo_online")


def shipped(config_name: str) -> bool:
    """Whether ``config_name`` (``--config-name``, with or without ``.yaml``) is a shipped recipe."""
    return config_name.removesuffix(".yaml") in RECIPES


def verl_trainer_dir() -> str | None:
    """verl's ``verl/trainer`` folder, where ``python -m verl.trainer.main_ppo`` resolves a relative
    ``--config-path`` (Hydra: relative to the main module); None when verl is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("verl.trainer")
    return os.path.dirname(spec.origin) if spec is not None and spec.origin else None


def resolve_path(path: str, *, directory: bool = True) -> str:
    """A relative recipe path as users write it, the same for every entry point and check: the first of
    ``verl/trainer/<path>`` (what it means for verl's own entry point), ``<working directory>/<path>`` and
    ``<package>/<path>`` that exists, so the documented ``recipes/nemotron3_super_mtp/config`` means the shipped
    folder from a checkout and from an installed wheel. ``directory``: a config folder (``--config-path``); else a
    recipe file, with or without ``.yaml``. Absolute paths and URLs are returned as given; when none exists, the
    working directory's."""
    if os.path.isabs(path) or "://" in path:
        return path
    verl_dir = verl_trainer_dir()
    candidates = [*([os.path.join(verl_dir, path)] if verl_dir else []), os.path.abspath(path),
                  os.path.join(PACKAGE_DIR, path)]

    def found(c: str) -> bool:
        if directory:
            return os.path.isdir(c)
        return os.path.isfile(c) or (not c.endswith(".yaml") and os.path.isfile(c + ".yaml"))

    return os.path.normpath(next((c for c in candidates if found(c)), os.path.abspath(path)))
