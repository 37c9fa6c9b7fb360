"""Megatron-Bridge 0.6.2 on a machine without Transformer Engine (CPU tests only).

verl 0.9.1 builds a Nemotron-H model through Megatron-Bridge (``AutoBridge.from_hf_pretrained`` ->
``NemotronHBridge`` -> ``HybridModelProvider`` -> megatron-core ``HybridModel``) and exports the
trained weights through the Bridge (``export_hf_weights``). The CPU suite runs that path for real;
two things stand in its way without a GPU, and both substitutes live here, named:

* :func:`install_te_import_placeholder`: ``import megatron.bridge`` imports Transformer Engine
  unconditionally (``megatron/bridge/peft/lora_layers.py``: ``import transformer_engine.pytorch as
  te``; a few model bridges subclass TE classes at import). TE cannot be installed on these
  machines (``transformer-engine-torch`` is a CUDA sdist). A placeholder ``transformer_engine``
  package is put into ``sys.modules`` *after* megatron-core is imported (megatron-core's own
  ``HAVE_TE`` flags then stay False and it builds its local modules); every attribute of the
  placeholder is a placeholder class, so module-level subclassing succeeds. Nothing from it is ever
  instantiated on the paths the tests run: Nemotron-H uses no LoRA and no TE module here.
* :func:`local_hybrid_stack_spec`: the Bridge's default hybrid stack spec is megatron's TE spec.
  The provider's ``hybrid_stack_spec`` field (a public Megatron-Bridge setting) is pointed at the
  package's TE-free spec (:func:`verl_mtp_plugin.testing._local_hybrid_stack_spec`: megatron's own
  local modules, ``WrappedTorchNorm`` for the TE-only final norm), and the latent-MoE projections
  (TE-only in megatron) use :class:`verl_mtp_plugin.testing.LatentLinearRef` while the model is
  built (:func:`local_build_context`).

Everything else is the real library: the Bridge's config translation, ``finalize``, its pre-wrap
hook machinery (``register_pre_wrap_hook`` / ``provide_distributed_model``), its mapping registry and
``export_hf_weights``.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from typing import Any

__all__ = [
    "TE_PLACEHOLDER_VERSION",
    "bridge_available",
    "install_te_import_placeholder",
    "local_build_context",
    "local_hybrid_stack_spec",
    "te_placeholder_installed",
]

#: ``transformer_engine.__version__`` the placeholder reports (megatron-bridge reads it at import).
TE_PLACEHOLDER_VERSION = "2.9.0"

_MARK = "_verl_mtp_te_placeholder"


class _Placeholder:
    """A class every placeholder attribute resolves to (subclassable, never meant to run)."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            f"{type(self).__qualname__}: Transformer Engine placeholder (verl_mtp_plugin.testing.bridge) "
            "was instantiated; this code path needs the real Transformer Engine"
        )


class _PlaceholderModule(types.ModuleType):
    """``transformer_engine[.x.y]``: unknown attributes are placeholder classes / submodules."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if name[:1].islower():  # a submodule (te.pytorch.ops, te.common.recipe, ...)
            mod = _new_module(full)
            setattr(self, name, mod)
            return mod
        cls = type(name, (_Placeholder,), {"__module__": self.__name__})
        setattr(self, name, cls)
        return cls


def _new_module(name: str) -> _PlaceholderModule:
    mod = _PlaceholderModule(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    mod.__path__ = []  # a package: ``import transformer_engine.pytorch.x`` resolves through sys.modules
    mod.__version__ = TE_PLACEHOLDER_VERSION
    setattr(mod, _MARK, True)
    sys.modules[name] = mod
    return mod


class _PlaceholderFinder:
    """Meta-path finder for ``transformer_engine.*`` submodules not created yet."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname == "transformer_engine" or fullname.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(fullname, _PlaceholderLoader(), is_package=True)
        return None


class _PlaceholderLoader:
    @staticmethod
    def create_module(spec):
        return sys.modules.get(spec.name) or _new_module(spec.name)

    @staticmethod
    def exec_module(module):
        return None


def te_placeholder_installed() -> bool:
    """True when ``transformer_engine`` in this process is the placeholder."""
    return bool(getattr(sys.modules.get("transformer_engine"), _MARK, False))


def install_te_import_placeholder() -> None:
    """Make ``import megatron.bridge`` work without Transformer Engine (idempotent).

    Imports megatron-core's modules first (their ``HAVE_TE`` flags are decided then, and must stay
    False), then registers the placeholder package and imports ``megatron.bridge``.

    Raises:
        RuntimeError: a real Transformer Engine is importable (nothing to do here: use it), or
            megatron-core was imported after a placeholder in a way that flipped its TE flags.
    """
    if te_placeholder_installed():
        return
    if "transformer_engine" in sys.modules:
        raise RuntimeError("a real transformer_engine is imported; the placeholder is for machines without it")
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        raise RuntimeError("transformer_engine is installed; the placeholder is for machines without it")
    # megatron-core first: its TE detection runs at import and must see no TE.
    import megatron.core.extensions  # noqa: F401
    import megatron.core.models.hybrid.hybrid_model  # noqa: F401
    import megatron.core.transformer.moe.moe_layer as moe_layer

    was_te = bool(getattr(moe_layer, "HAVE_TE", False))
    _new_module("transformer_engine")
    sys.meta_path.append(_PlaceholderFinder())
    import megatron.bridge  # noqa: F401

    if bool(getattr(moe_layer, "HAVE_TE", False)) != was_te:
        raise RuntimeError("megatron-core's Transformer Engine detection changed after the placeholder")


def bridge_available() -> bool:
    """True when Megatron-Bridge is installed (it is part of the test environment, see README)."""
    import importlib.util

    return importlib.util.find_spec("megatron.bridge") is not None


def local_hybrid_stack_spec(provider: Any = None):
    """The TE-free hybrid stack spec for a ``HybridModelProvider`` (``provider.hybrid_stack_spec``).

    Args:
        provider: the provider (called by ``HybridModelProvider._resolve_hybrid_stack_spec``); its
            ``num_moe_experts`` sizes the local MoE spec.
    """
    from verl_mtp_plugin.testing import _local_hybrid_stack_spec

    return _local_hybrid_stack_spec(getattr(provider, "num_moe_experts", None))


@contextlib.contextmanager
def local_build_context(provider: Any = None):
    """While a tiny model is built on CPU: the latent-MoE projection stand-in (TE-only in megatron),
    the plain-torch Mamba scan and ``torch.cuda.current_device`` answering ``"cpu"`` (see
    :mod:`verl_mtp_plugin.testing`)."""
    from verl_mtp_plugin.testing import (
        _install_cpu_current_device,
        _install_mamba_reference_on_cpu,
        _latent_moe_projection_ref,
    )

    _install_cpu_current_device()
    _install_mamba_reference_on_cpu()
    latent = provider is None or bool(getattr(provider, "moe_latent_size", None))
    with _latent_moe_projection_ref() if latent else contextlib.nullcontext():
        yield
