"""mamba_ssm's Triton kernels for megatron without mamba_ssm's CUDA extension (GPU machines).

A typical GPU image here has ``mamba_ssm`` installed as a pure-Python wheel (built with
``MAMBA_SKIP_CUDA_BUILD=TRUE``): ``mamba_ssm/__init__.py`` imports the CUDA extension and fails.
:func:`install_mamba_ssm_triton` registers ``sys.modules["mamba_ssm"]`` as a bare package so the Triton
submodules megatron imports load without running ``__init__`` (see :mod:`verl_mtp_plugin.testing.gpu`).
Test/benchmark support; package code never imports it.
"""

from __future__ import annotations

import importlib.util
import sys
import types

__all__ = ["bare_mamba_ssm", "has_causal_conv1d_cuda", "install_mamba_ssm_triton", "mamba_kernels_active"]

_MIXER = "megatron.core.ssm.mamba_mixer"


def has_causal_conv1d_cuda() -> bool:
    """True when ``causal_conv1d``'s CUDA extension is importable (megatron's fused Mamba path needs it)."""
    return importlib.util.find_spec("causal_conv1d_cuda") is not None


def bare_mamba_ssm() -> bool:
    """Register ``sys.modules["mamba_ssm"]`` as the package's directory only, where ``mamba_ssm`` is installed without
    its CUDA extension (``mamba_ssm/__init__.py`` imports ``selective_scan_cuda``) and not imported yet. Imports
    nothing else (the H200 drivers' stand-ins call it in every process at start-up).

    Returns:
        bool: True when it registered the bare package now.
    """
    if "mamba_ssm" in sys.modules:
        return False
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None or not spec.submodule_search_locations or importlib.util.find_spec("selective_scan_cuda"):
        return False
    pkg = types.ModuleType("mamba_ssm")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__file__ = None
    try:
        from importlib.metadata import version

        pkg.__version__ = version("mamba_ssm")
    except Exception:  # metadata absent: megatron compares __version__ with minimum versions
        # (megatron.core.ssm.mamba_mixer, packed sequences), so it must parse: the release these kernels were
        # proven with on the H200
        pkg.__version__ = "2.3.2.post1"
    sys.modules["mamba_ssm"] = pkg
    return True


def install_mamba_ssm_triton() -> bool:
    """Make ``mamba_ssm``'s Triton ops importable without its CUDA extensions.

    Call before anything imports ``megatron.core.ssm.mamba_mixer`` (building a model with ``M``
    layers does). Idempotent.

    Returns:
        bool: True when megatron's ``MambaMixer`` can use mamba_ssm (``HAVE_MAMBA_SSM``); False when
        ``mamba_ssm`` is not installed.

    Raises:
        RuntimeError: ``megatron.core.ssm.mamba_mixer`` was imported earlier without mamba_ssm; its
            ``HAVE_MAMBA_SSM`` is fixed at import, so the process must call this first.
    """
    mixer = sys.modules.get(_MIXER)
    if mixer is not None:
        if mixer.HAVE_MAMBA_SSM:
            return True
        if importlib.util.find_spec("mamba_ssm") is None:
            return False
        raise RuntimeError(
            f"{_MIXER} was imported before install_mamba_ssm_triton() and saw no mamba_ssm "
            "(HAVE_MAMBA_SSM=False); call install_mamba_ssm_triton() first in this process"
        )
    if "mamba_ssm" not in sys.modules:
        spec = importlib.util.find_spec("mamba_ssm")
        if spec is None or not spec.submodule_search_locations:
            return False
        bare_mamba_ssm()
    import megatron.core.ssm.mamba_mixer as mm

    return bool(mm.HAVE_MAMBA_SSM)


def mamba_kernels_active() -> bool:
    """True when megatron's ``MambaMixer`` will run mamba_ssm's Triton SSD kernel (not the CPU reference)."""
    mm = sys.modules.get(_MIXER)
    if mm is None or not mm.HAVE_MAMBA_SSM:
        return False
    fn = getattr(mm, "mamba_chunk_scan_combined", None)
    return fn is not None and getattr(fn, "__module__", "").startswith("mamba_ssm.")
