"""The Transformer Engine placeholder hides TE's private module-level objects (found on the H200: verl's
optimizer offload does ``from transformer_engine.pytorch.module.base import _dummy_wgrads; _dummy_wgrads.clear()``
under ``except ImportError`` and got a placeholder class instead of the ImportError it expects without TE)."""

import pytest


def test_private_lowercase_name_is_absent_class_names_stay():
    from verl_mtp_plugin.testing.bridge import _new_module

    import sys

    mod = _new_module("transformer_engine_placeholder_probe.pytorch.module.base")
    try:
        with pytest.raises(AttributeError):
            mod._dummy_wgrads  # noqa: B018
        assert isinstance(mod._SplitAlongDim, type)  # megatron imports this private class name
        assert isinstance(mod.LayerNormLinear, type)
    finally:
        sys.modules.pop("transformer_engine_placeholder_probe.pytorch.module.base", None)
