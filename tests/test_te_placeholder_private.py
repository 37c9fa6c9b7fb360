"""The Transformer Engine placeholder hides TE's private module-level objects (found on the H200: verl's
optimizer offload does ``from transformer_engine.pytorch.module.base import _dummy_wgrads; _dummy_wgrads.clear()``
under ``except ImportError`` and got a placeholder class instead of the ImportError it expects without TE)."""

import pytest


def test_private_lowercase_name_is_absent_class_names_stay():
    from verl_mtp_cpu.bridge import _new_module

    import sys

    mod = _new_module("transformer_engine_placeholder_probe.pytorch.module.base")
    try:
        with pytest.raises(AttributeError):
            mod._dummy_wgrads  # noqa: B018
        assert isinstance(mod._SplitAlongDim, type)  # megatron imports this private class name
        assert isinstance(mod.LayerNormLinear, type)
    finally:
        sys.modules.pop("transformer_engine_placeholder_probe.pytorch.module.base", None)


def test_from_import_of_private_name_raises_import_error():
    """What verl runs (``verl/utils/megatron_utils.py:964-970``) with the placeholder's finder installed: ``from
    ... import _dummy_wgrads`` must raise ImportError, not resolve to a placeholder submodule (seen on the H200:
    ``_dummy_wgrads.clear()`` -> "'_PlaceholderModule' object is not callable"). In a child process: the
    finder is process-wide."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys
        from verl_mtp_cpu.bridge import _PlaceholderFinder, _new_module
        if "transformer_engine" not in sys.modules:
            _new_module("transformer_engine")
            sys.meta_path.append(_PlaceholderFinder())
        try:
            from transformer_engine.pytorch.module.base import _dummy_wgrads
        except ImportError:
            pass
        else:
            raise SystemExit(f"no ImportError: got {_dummy_wgrads!r}")
        from transformer_engine.pytorch.module.base import LayerNormLinear  # class names still resolve
        assert isinstance(LayerNormLinear, type)
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
