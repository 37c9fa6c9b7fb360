"""``VERL_USE_EXTERNAL_MODULES=verl_cpu_platform``: the harness's CPU platform, registered before anything
imports ``verl_mtp_plugin`` (the harness puts this folder on ``PYTHONPATH``; CPU-only).

verl imports its external modules inside ``verl/__init__.py`` (lines 49-52). Importing any module of
the ``verl_mtp_plugin`` package there runs the package's ``__init__``, which registers the plugin's
engines with verl (``verl_mtp_plugin/__init__.py``: ``"verl" in sys.modules``), and that import chain
asks verl for its platform (``verl/workers/engine/fsdp/transformer_impl.py:89``,
``device_name = get_device_name()``) before the CPU platform could be registered. This module loads
:mod:`verl_mtp_cpu.platform` from its file, under its own name, without importing
the package; the rest of the package is imported later, normally.
"""

import importlib.util
import pathlib
import sys

_NAME = "verl_mtp_cpu.platform"
if _NAME not in sys.modules:
    _spec = importlib.util.spec_from_file_location(_NAME, pathlib.Path(__file__).resolve().parents[1] / "platform.py")
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _mod
    _spec.loader.exec_module(_mod)
