"""``VERL_USE_EXTERNAL_MODULES=verl_h200_standins``: what verl's real trainer needs on the lent H200 image
(torch 2.11 + CUDA, no Transformer Engine, no ``causal_conv1d``, ``mamba_ssm`` as a pure-Python wheel).
Benchmark support (``benchmarks/h200_main_ppo``), loaded by verl in every process that imports it
(``verl/__init__.py`` reads ``VERL_USE_EXTERNAL_MODULES``), before anything imports megatron.

Stand-ins, each with the library line that forces it (megatron-core 0.19.2, Megatron-Bridge 0.6.2,
verl 0.9.1); everything else runs as shipped, on CUDA:

* ``mamba_ssm_triton`` (at import, every process): ``mamba_ssm/__init__.py`` imports its CUDA extension
  ``selective_scan_cuda``, absent from a ``MAMBA_SKIP_CUDA_BUILD`` wheel; megatron's
  ``megatron/core/ssm/mamba_mixer.py`` decides ``HAVE_MAMBA_SSM`` when first imported. A bare
  ``mamba_ssm`` package (its directory only) makes the real Triton SSD kernels importable
  (:mod:`verl_mtp_cpu.mamba_triton`, as in every GPU benchmark of this repository).
* ``te_import_placeholder`` (trainer workers): ``megatron/bridge/peft/lora_layers.py:20`` imports
  ``transformer_engine`` unconditionally (:func:`verl_mtp_cpu.bridge.install_te_import_placeholder`).
* ``te_free_default_hybrid_spec`` (trainer workers): ``megatron/bridge/models/hybrid/hybrid_provider.py:104``
  returns the TE hybrid spec and verl's ``override_transformer_config`` (OmegaConf) cannot carry the
  callable ``hybrid_stack_spec``; the default resolves to the testing package's TE-layout local spec
  (production parameter names; the CPU harness's stand-in of the same name).

Installed in trainer workers from verl's ``initialize_global_process_group_ray`` (first call of
``TrainingWorker.__init__``, ``verl/workers/engine_workers.py:89``), as the CPU harness does. The
Hydra overrides that the missing TE / apex / causal_conv1d force (``attention_backend=local``, fusions off,
``use_mamba_mem_eff_path=false``, ``use_remove_padding=false``) are in ``benchmarks/h200_main_ppo/run.py``.
"""

from __future__ import annotations

import os
import sys

STANDINS = {
    "mamba_ssm_triton": "megatron/core/ssm/mamba_mixer.py imports mamba_ssm, whose __init__ imports the absent "
    "CUDA extension selective_scan_cuda",
    "te_import_placeholder": "megatron/bridge/peft/lora_layers.py:20 imports transformer_engine unconditionally",
    "te_free_default_hybrid_spec": "megatron/bridge/models/hybrid/hybrid_provider.py:104 returns the TE hybrid spec",
}
_INSTALLED: list[str] = []


def _log(msg: str) -> None:
    print(f"[h200 standins pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


def _bare_mamba_ssm() -> None:
    from verl_mtp_cpu.mamba_triton import bare_mamba_ssm

    if bare_mamba_ssm():  # nothing on a full mamba_ssm build (its CUDA extension present)
        _INSTALLED.append("mamba_ssm_triton")


def install_trainer_worker_standins() -> list[str]:
    if "te_import_placeholder" in _INSTALLED:
        return list(_INSTALLED)
    _bare_mamba_ssm()
    import megatron.core.ssm.mamba_mixer as mm

    if not mm.HAVE_MAMBA_SSM:
        raise RuntimeError("megatron's MambaMixer sees no mamba_ssm: carry mamba_ssm (pure-Python wheel)")
    if os.environ.get("VERL_H200_STACK") == "te":
        # Transformer Engine and causal_conv1d are installed (../shared/tools/h200-te): megatron's own TE hybrid
        # spec, fused attention and the fused Mamba path run as shipped; only the bare mamba_ssm package remains
        import causal_conv1d  # noqa: F401  (fail here, not deep in the first packed forward)
        import transformer_engine.pytorch  # noqa: F401

        _INSTALLED.append("te_import_placeholder")  # the marker that this function ran (nothing installed)
        _log(f"trainer worker: Transformer Engine stack; stand-ins: {', '.join(s for s in _INSTALLED if s != 'te_import_placeholder')}"
             f" (mamba_mixer HAVE_MAMBA_SSM={mm.HAVE_MAMBA_SSM})")
        return [s for s in _INSTALLED if s != "te_import_placeholder"]
    from verl_mtp_cpu.bridge import install_te_import_placeholder, register_bridge_module_types

    install_te_import_placeholder()
    register_bridge_module_types()
    _INSTALLED.append("te_import_placeholder")

    import megatron.bridge.models.hybrid.hybrid_provider as hp

    from verl_mtp_cpu.bridge import te_layout_hybrid_stack_spec

    real = hp.get_default_hybrid_stack_spec
    if not getattr(real, "_verl_h200", False):

        def get_default_hybrid_stack_spec(config):
            if getattr(config, "transformer_impl", None) == "inference_optimized" or getattr(
                config, "restore_modelopt_state", False
            ):
                return real(config)
            return te_layout_hybrid_stack_spec(config)

        get_default_hybrid_stack_spec._verl_h200 = True
        get_default_hybrid_stack_spec.__wrapped__ = real
        hp.get_default_hybrid_stack_spec = get_default_hybrid_stack_spec
    _INSTALLED.append("te_free_default_hybrid_spec")
    _log(f"trainer worker stand-ins: {', '.join(_INSTALLED)} (mamba_mixer HAVE_MAMBA_SSM={mm.HAVE_MAMBA_SSM})")
    return list(_INSTALLED)


def _wrap_worker_entry() -> None:
    import verl.utils.distributed as vd

    real = vd.initialize_global_process_group_ray
    if getattr(real, "_verl_h200", False):
        return

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        if backend is None:  # a trainer worker (verl's checkpoint engine passes its own backend)
            install_trainer_worker_standins()
        return real(timeout_second=timeout_second, backend=backend)

    initialize_global_process_group_ray._verl_h200 = True
    initialize_global_process_group_ray.__wrapped__ = real
    vd.initialize_global_process_group_ray = initialize_global_process_group_ray


_bare_mamba_ssm()
_wrap_worker_entry()
