"""GPU-only tests: collected only where CUDA is available.

The CPU CI runs ``pytest -q`` over ``tests/``; without CUDA nothing in this folder is collected
(``collect_ignore_glob``), so the CPU suite neither runs nor skips these. On a GPU this conftest makes
mamba_ssm's Triton kernels importable before megatron's ``MambaMixer`` is imported
(:func:`verl_mtp_cpu.mamba_triton.install_mamba_ssm_triton`).

``VERL_MTP_GPU_TESTS_ON_CPU=1`` collects them on a CPU anyway (plumbing check of the test code only:
CPU Mamba reference, tiny shapes, the DDP/optimizer test skips because megatron's optimizers need CUDA).
"""

import os

import torch

_FORCE_CPU = os.environ.get("VERL_MTP_GPU_TESTS_ON_CPU") == "1"

if not torch.cuda.is_available() and not _FORCE_CPU:
    collect_ignore_glob = ["test_*.py", "*_test.py", "probe_*.py"]
elif torch.cuda.is_available():
    from verl_mtp_cpu.mamba_triton import install_mamba_ssm_triton

    if not install_mamba_ssm_triton():
        raise RuntimeError("GPU tests need mamba_ssm (pure-Python wheel is enough); see verl_mtp_plugin/testing/gpu.py")
