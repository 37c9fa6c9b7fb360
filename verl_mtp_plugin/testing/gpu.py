"""GPU-only setup for the tiny / benchmark ``HybridModel`` on a CUDA machine without Transformer Engine.

:func:`verl_mtp_cpu.tiny.build_tiny_hybrid` builds megatron's real modules from the local
(non-TE) spec. On a CPU it swaps Mamba's Triton kernels for a plain-torch reference; on a GPU it
expects megatron to find ``mamba_ssm``. A typical GPU image here has ``mamba_ssm`` installed as a
pure-Python wheel (built with ``MAMBA_SKIP_CUDA_BUILD=TRUE``) and no ``causal_conv1d``:

* ``mamba_ssm/__init__.py`` imports the CUDA extension ``selective_scan_cuda`` and fails, so
  megatron would see ``HAVE_MAMBA_SSM=False``.
  :func:`~verl_mtp_cpu.mamba_triton.install_mamba_ssm_triton` registers
  ``sys.modules["mamba_ssm"]`` as a bare package whose ``__path__`` is the installed directory, so the
  Triton submodules megatron imports (``mamba_ssm.ops.triton.ssd_combined``,
  ``mamba_ssm.ops.triton.layernorm_gated``) load without running ``__init__``. The Mamba-2 SSD and
  gated-RMSNorm kernels that run are mamba_ssm's real Triton kernels; nothing is replaced.
* megatron's fused training path (``use_mamba_mem_eff_path=True``) calls ``causal_conv1d``'s CUDA
  kernel; without it :func:`gpu_config_overrides` selects the unfused path
  (``use_mamba_mem_eff_path=False``: ``F.conv1d`` + ``mamba_chunk_scan_combined``).
* ``use_cpu_initialization=False``: parameters are created and initialised on the GPU.

Everything here is test/benchmark support; package code never imports it.
"""

from __future__ import annotations

import torch

from verl_mtp_cpu.mamba_triton import has_causal_conv1d_cuda, install_mamba_ssm_triton, mamba_kernels_active

__all__ = [
    "build_gpu_hybrid",
    "gpu_config_overrides",
    "megatron_ddp_and_optimizer",
    "optimizer_model_params",
]

def gpu_config_overrides() -> dict:
    """``TransformerConfig`` overrides for a CUDA build without Transformer Engine.

    Returns:
        dict: ``use_mamba_mem_eff_path`` (True only when causal_conv1d's CUDA kernel exists) and
        ``use_cpu_initialization=False``.
    """
    return {"use_mamba_mem_eff_path": has_causal_conv1d_cuda(), "use_cpu_initialization": False}


def build_gpu_hybrid(spec=None, *, config_overrides: dict | None = None, **fields):
    """:func:`verl_mtp_cpu.tiny.build_tiny_hybrid` on CUDA with the real Mamba Triton kernels.

    Args:
        spec (TinyHybridSpec | None): the shape; ``fields`` override single fields.
        config_overrides (dict | None): extra ``TransformerConfig`` fields, applied after
            :func:`gpu_config_overrides`.

    Returns:
        the ``HybridModel`` on the current CUDA device, in train mode.

    Raises:
        RuntimeError: no CUDA device, or the pattern has Mamba layers and mamba_ssm is not importable.
    """
    from verl_mtp_plugin.testing import TinyHybridSpec, build_tiny_hybrid

    if not torch.cuda.is_available():
        raise RuntimeError("build_gpu_hybrid needs a CUDA device; use testing.build_tiny_hybrid on CPU")
    pattern = fields.get("pattern") or (spec or TinyHybridSpec()).pattern
    if "M" in pattern:
        if not install_mamba_ssm_triton() or not mamba_kernels_active():
            raise RuntimeError(
                f"pattern {pattern!r} has Mamba layers but megatron cannot import mamba_ssm's Triton ops; "
                "install mamba-ssm (a pure-Python wheel built with MAMBA_SKIP_CUDA_BUILD=TRUE is enough)"
            )
    overrides = {**gpu_config_overrides(), **(config_overrides or {})}
    return build_tiny_hybrid(spec, device=torch.device("cuda", torch.cuda.current_device()),
                             config_overrides=overrides, **fields)


def megatron_ddp_and_optimizer(
    model,
    *,
    lr: float = 1e-4,
    overlap_grad_reduce: bool = True,
    use_distributed_optimizer: bool = True,
    clip_grad: float = 1.0,
):
    """Wrap ``model`` the way Megatron training does: megatron ``DistributedDataParallel`` (fp32 grad
    buffers) and ``get_megatron_optimizer`` (Adam, bf16 model params with fp32 main params).

    Call :func:`verl_mtp_plugin.freeze_mtp` before this for the frozen mode: parameters with
    ``requires_grad=False`` then get no grad buffer and no optimizer state.

    Args:
        model: the unwrapped ``HybridModel``.
        lr (float): Adam learning rate.
        overlap_grad_reduce (bool): megatron DDP's backward-hook driven bucket reduction.
        use_distributed_optimizer (bool): megatron's sharded ``DistributedOptimizer``.
        clip_grad (float): gradient-norm clip.

    Returns:
        tuple: ``(ddp_model, optimizer)``.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = model.config
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    ddp = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=model)
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=0.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
        clip_grad=clip_grad,
    )
    optimizer = get_megatron_optimizer(opt_cfg, [ddp])
    return ddp, optimizer


def optimizer_model_params(optimizer) -> list:
    """The model parameters a megatron optimizer (plain, distributed or chained) updates and keeps
    state for."""
    opts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    params = []
    for o in opts:
        groups = []
        for attr in ("model_float16_groups", "model_fp32_groups", "float16_groups", "fp32_from_fp32_groups"):
            groups += list(getattr(o, attr, None) or [])
        if not groups and hasattr(o, "optimizer"):
            groups = [g["params"] for g in o.optimizer.param_groups]
        for g in groups:
            params += list(g)
    return params
