"""Hand Megatron's MTP loss an output layer of the plugin's own for the MTP depths, for the duration of a block.

``HybridModel.forward`` (megatron-core 0.19.x) calls the module-level ``process_mtp_loss(..., output_layer=
self.output_layer, ...)`` of ``megatron.core.models.hybrid.hybrid_model``, which computes each depth's logits with
``output_layer(hidden, weight=..., runtime_gather_output=...)`` and hands them to ``compute_language_model_loss``. The
main head's logits are computed afterwards by ``self.output_layer`` itself, not through ``process_mtp_loss``, so a
replacement passed as that argument sees the MTP depths' calls and nothing else. :func:`replace_mtp_output_layer`
rebinds the module's ``process_mtp_loss`` to a wrapper that passes ``wrap(output_layer)`` instead, and restores it on
exit, exception or not. Used by :func:`verl_mtp_plugin.objective.mtp_objective_scope` (the MTP loss read from the
MTP hidden states chunk by chunk). The probed names are in :data:`verl_mtp_plugin.compat.probes.JOINTS`.

Joint mode (the output weight trains with the MTP loss): the chunked loss computes the weight's gradient itself and
must hand it to megatron as megatron's own output layer does (``LinearWithGradAccumulationAndAsyncCommunication.
backward`` in ``megatron.core.tensor_parallel.layers``). With ``gradient_accumulation_fusion`` the layer adds its
weight gradient into ``weight.main_grad`` and sets ``weight.grad_added_to_main_grad``, after which megatron DDP's
backward hook ignores ``param.grad``: a gradient returned through autograd would be dropped there.
:func:`weight_grad_buffer` names that buffer (the chunks are added into it, and the flag set, as megatron does);
without the fusion the gradient goes through autograd. :func:`weight_grad_unsupported` names the layer settings
whose weight gradient megatron delivers otherwise (deferred embedding wgrad, GTP, Megatron-FSDP), where the MTP
logits stay whole.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch

__all__ = ["MODULE", "accumulate_weight_grad", "mark_weight_grad_added", "replace_mtp_output_layer",
           "weight_grad_buffer", "weight_grad_unsupported"]

#: The module whose ``process_mtp_loss`` global HybridModel's forward calls.
MODULE = "megatron.core.models.hybrid.hybrid_model"


@contextlib.contextmanager
def replace_mtp_output_layer(wrap: Callable[[Any], Any]):
    """Within the block, every ``process_mtp_loss`` call HybridModel makes gets ``output_layer=wrap(output_layer)``
    (a call that passes it positionally is left as it is: it then computes the whole logits, as without the block)."""
    import importlib

    module = importlib.import_module(MODULE)
    original = module.process_mtp_loss

    @functools.wraps(original)
    def process_mtp_loss(*args, **kwargs):
        if "output_layer" in kwargs:
            kwargs["output_layer"] = wrap(kwargs["output_layer"])
        return original(*args, **kwargs)

    module.process_mtp_loss = process_mtp_loss
    try:
        yield original
    finally:
        module.process_mtp_loss = original


def weight_grad_unsupported(layer, weight) -> str | None:
    """Why the output weight's gradient of an MTP depth cannot be delivered by the chunked loss (None: it can)."""
    config = getattr(layer, "config", None)
    if getattr(config, "defer_embedding_wgrad_compute", False):
        return "the output layer defers its weight gradient (defer_embedding_wgrad_compute)"
    if getattr(layer, "gtp_remat_size", 1) > 1:
        return "the output layer's weight is sharded for recompute (GTP)"
    if hasattr(weight, "__fsdp_param__"):
        return "Megatron-FSDP holds the output weight's gradient"
    if getattr(layer, "gradient_accumulation_fusion", False) and getattr(weight, "main_grad", None) is None:
        return "gradient-accumulation fusion without a main_grad buffer on the output weight"
    return None


def weight_grad_buffer(layer, weight):
    """``weight.main_grad`` where megatron's output layer adds its weight gradient there itself
    (``gradient_accumulation_fusion``), else None (the gradient goes through autograd as ``param.grad``)."""
    if getattr(layer, "gradient_accumulation_fusion", False):
        return weight.main_grad
    return None


def mark_weight_grad_added(weight):
    """What megatron's fused wgrad does after adding into ``main_grad``: set ``grad_added_to_main_grad`` (DDP's hook
    then skips ``param.grad``) and return the placeholder gradient megatron returns for the weight (zeros where
    ``zero_out_wgrad``, whose ``param.grad`` DDP adds anyway; else uninitialised), so that ``param.grad`` is defined
    and DDP's hook runs as for megatron's own layer; None where the weight has no such flag (no DDP)."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight)
    return torch.empty_like(weight)


@functools.cache  # looked up once: accumulate_weight_grad runs for every chunk of every depth
def _fused_wgrad():
    """megatron's fused weight-gradient GEMM into a float32 / half buffer (apex's ``fused_weight_gradient_mlp_cuda``,
    what ``gradient_accumulation_fusion`` runs), or None where it is not installed."""
    try:
        import fused_weight_gradient_mlp_cuda
    except ImportError:
        return None
    return fused_weight_gradient_mlp_cuda


def accumulate_weight_grad(buf, h, dz) -> None:
    """``buf += dz^T @ h`` (``h`` [rows, in], ``dz`` [rows, out], both in the weight's dtype): on CUDA with half
    inputs and a float32 / half ``buf``, megatron's fused GEMM (half inputs, accumulated in ``buf``'s precision, as
    the output layer's own weight gradient); else a matmul in the inputs' dtype added into ``buf``."""
    fused = _fused_wgrad() if buf.is_cuda and h.dtype in (torch.bfloat16, torch.float16) else None
    if fused is not None and buf.dtype == torch.float32:
        fused.wgrad_gemm_accum_fp32(h, dz, buf)
    elif fused is not None and buf.dtype == h.dtype:
        fused.wgrad_gemm_accum_fp16(h, dz, buf)
    elif buf.dtype == h.dtype:
        buf.addmm_(dz.t(), h)
    else:
        buf.add_(dz.t() @ h)
