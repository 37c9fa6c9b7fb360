"""Tiny Nemotron-3-shaped megatron-core ``HybridModel`` builders for CPU tests, the demo and benchmarks.

Everything here is real megatron-core (``HybridModel``, ``HybridStack``, ``TransformerLayer``,
``MoETransformerLayer`` with router, expert bias, shared experts and local experts,
``MambaLayer``/``MambaMixer``, ``MultiTokenPredictionBlock``) built from megatron's own local
(non-Transformer-Engine) modules. The only substitutions, all named here:

* ``LocalHybridStack``: ``HybridStack`` hard-codes a Transformer-Engine final norm; the subclass
  builds megatron's own ``WrappedTorchNorm`` instead (same RMSNorm math, same parameter name).
* :class:`LatentLinearRef`: megatron builds the latent-MoE projections (``fc1_latent_proj``,
  ``fc2_latent_proj``, Nemotron 3 Super's ``moe_latent_size``) only through TE's ``TELinear``; a
  plain ``y = x W^T`` module stands in, swapped in only while the model is constructed.
* On machines without CUDA, Mamba's Triton kernels (fused training scan, chunked scan, gated RMSNorm) are replaced by the
  plain-torch reference in :mod:`verl_mtp_cpu._mamba_ref` (packed sequences through ``seq_idx`` included), and
  megatron's version gate for packed Mamba training (``ssm/mamba_mixer.py:746-750``
  ``_check_mamba_sequence_packing_support`` imports ``causal_conv1d`` / ``mamba_ssm`` for their versions) answers
  for that reference; on a GPU the real kernels run.
* :class:`~verl_mtp_cpu.attention.ThdDotProductAttentionRef` as core attention: megatron's own
  ``DotProductAttention`` that also takes packed (THD) sequences, which megatron otherwise takes only through
  Transformer Engine's ``TEDotProductAttention`` (``transformer/dot_product_attention.py:153`` asserts
  ``packed_seq_params is None``).
* On machines without CUDA, ``torch.cuda.current_device`` answers ``"cpu"`` (megatron asks it for
  buffer placement in a few places); installed by :func:`init_megatron`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from functools import partial

import torch

__all__ = [
    "LatentLinearRef",
    "TinyHybridSpec",
    "build_tiny_hybrid",
    "causal_mask",
    "rendezvous",
    "init_megatron",
]


@dataclasses.dataclass
class TinyHybridSpec:
    """Shape of a tiny Nemotron-3-like model. ``pattern`` is megatron's unified ``main/mtp/...`` form."""

    pattern: str = "M*-E/*E"
    vocab_size: int = 128
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2
    num_experts: int = 4
    moe_topk: int = 2
    moe_ffn_hidden_size: int = 32
    moe_shared_expert_intermediate_size: int = 32
    moe_latent_size: int | None = 32
    mamba_state_dim: int = 16
    mamba_head_dim: int = 16
    mamba_num_groups: int = 1
    max_sequence_length: int = 256
    mtp_use_repeated_layer: bool = False
    mtp_detach_heads: bool = False
    mtp_loss_scaling_factor: float = 0.1
    params_dtype: torch.dtype = torch.float32
    make_vocab_size_divisible_by: int | None = None  # pad the vocab like Megatron does


#: an ``init_method`` for torch.distributed that test processes of one group share (see :func:`rendezvous`)
ENV_INIT_METHOD = "VERL_MTP_TEST_INIT_METHOD"


def rendezvous() -> str:
    """A fresh ``file://`` rendezvous for one torch.distributed group (gloo's FileStore): the ranks meet in
    a file, so no port is picked now and bound later (a race with anything else on the machine)."""
    return "file://" + os.path.join(tempfile.mkdtemp(prefix="verl_mtp_dist_"), "store")


def _install_cpu_current_device():
    if not torch.cuda.is_available() and not getattr(torch.cuda.current_device, "_verl_mtp_cpu", False):
        def _cpu_device():
            return "cpu"

        _cpu_device._verl_mtp_cpu = True
        torch.cuda.current_device = _cpu_device


def init_megatron(seed: int = 1234, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    """Single-process (or torchrun) init: gloo on CPU, NCCL on GPU; megatron parallel state; RNG."""
    from megatron.core import parallel_state, tensor_parallel

    _install_cpu_current_device()
    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if os.environ.get(ENV_INIT_METHOD):  # test processes started together (rendezvous())
            init_method = os.environ[ENV_INIT_METHOD]
        elif "MASTER_PORT" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
            init_method = "env://"
        else:  # one process: a rendezvous of its own, not exported (child processes make theirs)
            init_method = rendezvous()
        torch.distributed.init_process_group(backend=backend, rank=rank, world_size=world, init_method=init_method)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
        )
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        # The CUDA RNG tracker needs a driver; the "inference" tracker's add/fork are no-ops.
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    torch.manual_seed(seed)


class LatentLinearRef(torch.nn.Module):
    """Plain ``y = x W^T (+ b)`` with ``TELinear``'s constructor and ``(out, bias)`` return.

    Stand-in for the Transformer-Engine-only latent-MoE projections (parameter name ``weight``). The
    weight is duplicated on every tensor-parallel rank (megatron builds it ``parallel_mode="duplicated"``), and its
    parameters carry the attributes TE's ``TELinear`` gives a duplicated weight
    (``megatron/core/extensions/transformer_engine.py:1054-1062``): with sequence parallelism each rank sees other
    tokens, so megatron all-reduces their gradients over the TP group (``sequence_parallel``).
    """

    def __init__(self, input_size, output_size, *, config, init_method, bias, skip_bias_add=False, **_):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        init_method(self.weight)
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype)) if bias else None
        self.skip_bias_add = skip_bias_add
        for p in self.parameters():
            p.allreduce = True
            p.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
            p.tensor_model_parallel = False

    def forward(self, x):
        out = torch.nn.functional.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        return out, (self.bias if self.skip_bias_add else None)


@contextlib.contextmanager
def _latent_moe_projection_ref():
    """While building: let megatron's MoELayer create latent projections without TE."""
    from megatron.core.transformer.moe import moe_layer

    saved = moe_layer.HAVE_TE, moe_layer.TELinear
    moe_layer.HAVE_TE, moe_layer.TELinear = True, LatentLinearRef
    try:
        yield
    finally:
        moe_layer.HAVE_TE, moe_layer.TELinear = saved


_MAMBA_REF_INSTALLED = False


def _install_mamba_reference_on_cpu() -> None:
    """No CUDA: run megatron's MambaMixer with the plain-torch scan and gated norm."""
    global _MAMBA_REF_INSTALLED
    if torch.cuda.is_available() or _MAMBA_REF_INSTALLED:
        return
    import megatron.core.ssm.mamba_mixer as mm

    from verl_mtp_cpu._mamba_ref import (
        GatedRMSNormRef,
        mamba_chunk_scan_combined_ref,
        mamba_split_conv1d_scan_combined_ref,
    )

    if not mm.HAVE_MAMBA_SSM:
        mm.HAVE_MAMBA_SSM = True
        mm.ExtendedRMSNorm = type("ExtendedRMSNorm", (GatedRMSNormRef,), {})
    else:  # mamba_ssm importable but its Triton norm cannot run on CPU tensors
        mm.ExtendedRMSNorm.forward = GatedRMSNormRef.forward
    mm.mamba_split_conv1d_scan_combined = mamba_split_conv1d_scan_combined_ref
    mm.mamba_chunk_scan_combined = mamba_chunk_scan_combined_ref
    real_check = mm._check_mamba_sequence_packing_support

    def _check_mamba_sequence_packing_support(for_inference_not_training: bool = True):
        # the version gate names causal_conv1d / mamba_ssm releases whose kernels honour seq_idx; for training the
        # reference above does (inference packing goes through other kernels: the library's own check)
        if for_inference_not_training:
            return real_check(for_inference_not_training)
        return True, None

    mm._check_mamba_sequence_packing_support = _check_mamba_sequence_packing_support
    if hasattr(mm, "MAMBA_HAS_STATE_DTYPE"):
        mm.MAMBA_HAS_STATE_DTYPE = False
    _MAMBA_REF_INSTALLED = True


class _WithoutSequenceParallel:
    """A megatron config as :class:`SequenceParallelTorchNorm` shows it to ``WrappedTorchNorm``."""

    sequence_parallel = False

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        return getattr(self._config, name)


class SequenceParallelTorchNorm:
    """megatron's ``WrappedTorchNorm`` (a torch ``RMSNorm`` / ``LayerNorm``) that also builds under sequence
    parallelism, as TE's norm does.

    megatron-core 0.19.2 ``transformer/torch_norm.py:50`` asserts ``not config.sequence_parallel``: its torch
    norm does not mark its weight, and under sequence parallelism each tensor-parallel rank sees only its part of
    the sequence, so the norm's weight gradient must be summed over the TP group. TE's norms mark their
    parameters ``sequence_parallel=True`` and megatron's ``finalize_model_grads`` then all-reduces them over the
    TP group (``distributed/finalize_model_grads.py``, ``_allreduce_non_tensor_model_parallel_grads``). This
    builds the same torch module ``WrappedTorchNorm`` builds (same math as without sequence parallelism) and
    marks its parameters the way TE does. Without sequence parallelism it is ``WrappedTorchNorm`` itself.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        if not getattr(config, "sequence_parallel", False):
            return WrappedTorchNorm(config, hidden_size, eps, **kwargs)
        norm = WrappedTorchNorm(_WithoutSequenceParallel(config), hidden_size, eps, **kwargs)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", True)
        return norm


def _local_hybrid_stack_spec(num_experts: int | None, fused_norm_linear: type | None = None):
    """megatron's hybrid stack spec with megatron's own local modules in place of TE ones.

    Args:
        num_experts: routed experts of the MoE layers (``None``: no MoE).
        fused_norm_linear: ``None`` builds the pre-norms as separate modules (megatron's local
            parameter names: ``input_layernorm.weight``, ``pre_mlp_layernorm.weight``, ``norm.weight``);
            a fused norm + column-parallel linear class (``cpu.bridge.LayerNormColumnParallelLinearRef``)
            folds them into Mamba's ``in_proj``, attention's ``linear_qkv`` and the MLP's ``linear_fc1``
            as TE's spec does (``...layer_norm_weight``), so parameter names equal the production ones.
    """
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    WrappedTorchNorm = SequenceParallelTorchNorm  # noqa: N806 - megatron's torch norm, also under SP (see there)
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    from verl_mtp_cpu.attention import ThdDotProductAttentionRef

    class LocalHybridStack(HybridStack):
        """HybridStack whose final norm is megatron's WrappedTorchNorm instead of TENorm."""

        def __init__(self, *args, post_layer_norm: bool = True, **kwargs):
            super().__init__(*args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and self.post_layer_norm:
                self.final_norm = WrappedTorchNorm(
                    config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon
                )

    fused = fused_norm_linear is not None
    pre_norm = IdentityOp if fused else WrappedTorchNorm  # fused: the norm lives in the next linear
    col_in = fused_norm_linear if fused else ColumnParallelLinear
    attention = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=pre_norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=col_in,
                    core_attention=ThdDotProductAttentionRef,
                    linear_proj=RowParallelLinear,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
        ),
    )
    mlp = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=pre_norm,
            mlp=partial(
                MLP.as_mlp_submodule,
                submodules=MLPSubmodules(linear_fc1=col_in, linear_fc2=RowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    moe = ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=get_moe_module_spec(use_te=False, num_experts=num_experts or 1, moe_grouped_gemm=False),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    mamba = ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=pre_norm,
            mixer=ModuleSpec(
                module=MambaMixer,
                submodules=MambaMixerSubmodules(in_proj=col_in, out_proj=RowParallelLinear),
            ),
            mamba_bda=get_bias_dropout_add,
        ),
    )
    mtp_block = ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(
            layer_specs=[
                ModuleSpec(
                    module=MultiTokenPredictionLayer,
                    submodules=MultiTokenPredictionLayerSubmodules(
                        enorm=WrappedTorchNorm,
                        hnorm=WrappedTorchNorm,
                        eh_proj=ColumnParallelLinear,
                        mtp_model_layer=None,  # built by megatron from the MTP pattern
                        layer_norm=WrappedTorchNorm,
                    ),
                )
            ]
        ),
    )
    return ModuleSpec(
        module=LocalHybridStack,
        submodules=HybridStackSubmodules(
            mamba_layer=mamba, attention_layer=attention, mlp_layer=mlp, moe_layer=moe, mtp_block_spec=mtp_block
        ),
    )


def make_config(spec: TinyHybridSpec, **overrides):
    """The megatron ``TransformerConfig`` for ``spec`` (Nemotron-3-like MoE: sigmoid router with
    expert bias, squared-ReLU experts, shared expert, optional latent projections)."""
    from megatron.core.activations import squared_relu
    from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern
    from megatron.core.transformer.transformer_config import TransformerConfig

    parsed = parse_hybrid_pattern(spec.pattern)
    has_moe = "E" in spec.pattern
    kw = dict(
        num_layers=len(parsed.main_pattern.replace("|", "")),
        mtp_num_layers=parsed.mtp_num_depths or None,
        mtp_use_repeated_layer=spec.mtp_use_repeated_layer,
        mtp_detach_heads=spec.mtp_detach_heads,
        mtp_loss_scaling_factor=spec.mtp_loss_scaling_factor,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        use_cpu_initialization=True,
        params_dtype=spec.params_dtype,
        bf16=spec.params_dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        is_hybrid_model=True,
        normalization="RMSNorm",
        add_bias_linear=False,
        gated_linear_unit=False,
        activation_func=squared_relu,
        mamba_state_dim=spec.mamba_state_dim,
        mamba_head_dim=spec.mamba_head_dim,
        mamba_num_groups=spec.mamba_num_groups,
        # CPU: the torch reference replaces the fused path; GPU: the fused path needs causal_conv1d's
        # CUDA kernel (testing.gpu.gpu_config_overrides picks it there).
        use_mamba_mem_eff_path=not torch.cuda.is_available(),
    )
    if has_moe:
        kw.update(
            num_moe_experts=spec.num_experts,
            moe_router_topk=spec.moe_topk,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_load_balancing_type="none",
            moe_router_dtype="fp32",
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
            moe_latent_size=spec.moe_latent_size,
        )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_tiny_hybrid(
    spec: TinyHybridSpec | None = None, *, device=None, config_overrides=None, pre_process=True, post_process=True,
    **fields,
):
    """Build a real megatron-core ``HybridModel`` with MTP for ``spec`` (fields may be overridden).

    Call :func:`init_megatron` first. Returns the model in train mode on ``device``
    (default: CUDA when available, else CPU).
    """
    spec = dataclasses.replace(spec or TinyHybridSpec(), **fields)
    if "M" in spec.pattern and torch.cuda.is_available():
        # before megatron's MambaMixer is imported: mamba_ssm's Triton kernels without its CUDA extension
        from verl_mtp_cpu.mamba_triton import install_mamba_ssm_triton

        install_mamba_ssm_triton()
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    _install_cpu_current_device()
    if "M" in spec.pattern:
        _install_mamba_reference_on_cpu()
    config = make_config(spec, **(config_overrides or {}))
    vocab = spec.vocab_size
    if spec.make_vocab_size_divisible_by:
        m = spec.make_vocab_size_divisible_by
        vocab = (vocab + m - 1) // m * m
    with _latent_moe_projection_ref() if (spec.moe_latent_size and "E" in spec.pattern) else contextlib.nullcontext():
        model = HybridModel(
            config=config,
            hybrid_stack_spec=_local_hybrid_stack_spec(spec.num_experts if "E" in spec.pattern else None),
            vocab_size=vocab,
            max_sequence_length=spec.max_sequence_length,
            hybrid_layer_pattern=spec.pattern,
            position_embedding_type="none",
            share_embeddings_and_output_weights=False,
            pre_process=pre_process,
            post_process=post_process,
        )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device)
    if spec.params_dtype != torch.float32:
        model = model.to(spec.params_dtype)
        # Router expert bias stays fp32 (as in Nemotron 3 checkpoints).
        for m in model.modules():
            if getattr(m, "expert_bias", None) is not None:
                m.expert_bias.data = m.expert_bias.data.float()
    model.train()
    return model


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """``[1, 1, s, s]`` bool, True = masked (megatron's default mask would be built on CUDA)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]
