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

__all__ = ["CONFIG_DIR", "PACKAGE_DIR", "RECIPE_DIR", "RECIPES", "resolve_path", "shipped"]

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


def resolve_path(path: str, *, first: tuple[str, ...] = (), suffixes: tuple[str, ...] = ("",)) -> str:
    """A relative recipe path as users write it: the first of ``first``, ``<working directory>/<path>`` and
    ``<package>/<path>`` that exists (with one of ``suffixes`` appended), so the documented
    ``recipes/nemotron3_super_mtp/config`` means the shipped folder from a checkout and from an installed wheel.
    Absolute paths and URLs are returned as given; when none exists, the first candidate."""
    if os.path.isabs(path) or "://" in path:
        return path
    candidates = [*first, os.path.abspath(path), os.path.join(PACKAGE_DIR, path)]
    for c in candidates:
        if any(os.path.exists(c + s) for s in suffixes):
            return os.path.normpath(c)
    return os.path.normpath(candidates[0])
