"""Stand-ins inside verl's Ray trainer workers on CPU (actor, reference, critic), CPU-only.

Installed once per worker process by :func:`install_trainer_worker_standins`, which the CPU platform
(:mod:`verl_mtp_cpu.platform`) calls from verl's ``initialize_global_process_group_ray``
(first thing in ``TrainingWorker.__init__``, ``verl/workers/engine_workers.py:89``), before any model
is built. Each stand-in is named in :data:`STANDINS` with the library line that forces it; each is
as narrow as the forcing line allows:

* ``cpu_current_device``, ``te_import_placeholder``, ``mamba_reference``: the CPU runtime's own
  (:func:`verl_mtp_cpu.tiny._install_cpu_current_device`,
  :func:`verl_mtp_cpu.bridge.install_te_import_placeholder`,
  :func:`verl_mtp_cpu.tiny._install_mamba_reference_on_cpu`), as in every CPU build test.
* ``te_free_default_hybrid_spec``: Megatron-Bridge's default hybrid spec is TE's; verl passes
  ``override_transformer_config`` through OmegaConf, which cannot carry the callable
  ``hybrid_stack_spec``, so the TE branch of the default resolves to the CPU runtime's TE-layout
  local spec (:func:`verl_mtp_cpu.bridge.te_layout_hybrid_stack_spec`).
* ``latent_moe_projection``: megatron builds the latent-MoE projections (Nemotron 3 Super's
  ``moe_latent_size``) only through TE's ``TELinear``; ``megatron.core.transformer.moe.moe_layer`` (its only
  users of ``HAVE_TE`` / ``TELinear`` are the latent projections, and ``te_checkpoint`` only under fp8/fp4) sees
  the CPU runtime's replicated torch linear :class:`verl_mtp_cpu.tiny.LatentLinearRef`, as every CPU
  build of the tiny MoE model does.
* ``inference_rng_tracker``: megatron's CPU-safe RNG tracker, created before verl seeds the CUDA one;
  its (CUDA) states, which verl checkpoints and requires non-empty on resume, are the host generator's.
* ``cuda_by_name``: megatron-core 0.19.2 allocates a few scalars on ``"cuda"`` by name and checks
  ``param.type()`` against ``torch.cuda.*Tensor``. Only the modules holding those lines see a
  ``torch`` whose factories place ``device="cuda"`` on the host; the type checks read the CUDA names
  only when called from those modules. No other torch call in the process changes.
* ``host_streams``: the CUDA stream / synchronise calls on the build, gradient-sync and checkpoint
  paths, again only in the modules that make them.
* ``bshd_valid_token_mask_as_causal``: verl's stock Megatron forward in BSHD (the PPO recipes'
  critic) passes a ``[b, s]`` valid-token mask that TE's causal attention does not apply; megatron's
  local attention (the only one here) receives, in its place, the causal mask TE applies (right-padded
  rows: padding never reaches a real token under causal attention, as in the plugin engine's own
  ``_bshd_attention_mask``). Masks of any other shape are passed on unchanged.
* ``torch_adam_state_before_load``: without Apex/TE megatron's distributed optimizer is torch's
  Adam, whose state exists only after a step; loading a checkpoint (resume) first lays the state out
  with megatron's own ``_init_optimizer_states_with_dummy_values`` (a zero-gradient step, which
  megatron itself runs before loading Megatron-FSDP checkpoints); the checkpoint then replaces it.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import torch

__all__ = ["STANDINS", "install_trainer_worker_standins", "installed"]

#: name -> the library line(s) that force it (megatron-core 0.19.2, Megatron-Bridge 0.6.2, verl 0.9.1).
STANDINS: dict[str, str] = {
    "cpu_current_device": "megatron-core allocates on torch.cuda.current_device() (e.g. optimizer/distrib_optimizer.py:998)",
    "te_import_placeholder": "megatron/bridge/peft/lora_layers.py:20 imports transformer_engine unconditionally",
    "mamba_reference": (
        "megatron/core/ssm/mamba_mixer.py needs mamba_ssm / causal_conv1d CUDA kernels (packed batches: "
        "mamba_mixer.py:746-750 checks their versions)"
    ),
    "te_free_default_hybrid_spec": (
        "megatron/bridge/models/hybrid/hybrid_provider.py:104 returns the TE hybrid spec (packed attention: "
        "megatron/core/transformer/dot_product_attention.py:153 refuses THD without TE)"
    ),
    "latent_moe_projection": (
        "megatron/core/transformer/moe/moe_layer.py:265-272 asserts HAVE_TE and builds the latent projections "
        "(moe_latent_size) only as TE's TELinear"
    ),
    "inference_rng_tracker": (
        "verl/workers/engine/megatron/utils.py:35-38 seeds megatron's CUDA RNG tracker; "
        "verl/utils/checkpoint/megatron_checkpoint_manager.py:843-844 refuses to resume from empty tracker states"
    ),
    "cuda_by_name": (
        "megatron/core/optimizer/optimizer.py:315,690,698,702,1249 + clip_grads.py:96,108,112,180,231 + "
        "core/utils.py:1332 + pipeline_parallel/schedules.py:749 allocate device='cuda'; optimizer.py:1009,1028, "
        "distrib_optimizer.py:401,466,758, clip_grads.py:174 compare param.type() with 'torch.cuda.*Tensor'"
    ),
    "host_streams": (
        "megatron/training/models/dist_utils.py:303-306 (Bridge _ddp_wrap: torch.cuda.Stream), "
        "megatron/core/distributed/param_and_grad_buffer.py:632,686,691,814 (grad sync: torch.cuda.current_stream) "
        "and megatron/core/dist_checkpointing/strategies/filesystem_async.py:248 (torch.cuda.synchronize)"
    ),
    "bshd_valid_token_mask_as_causal": (
        "verl/models/mcore/util.py:708-716 (preprocess_bshd_engine, verl's stock value-model forward) passes a "
        "[b, s] valid-token mask that TE's causal attention ignores; megatron's local DotProductAttention "
        "(transformer/dot_product_attention.py:210 -> transformer/utils.py:54) applies it as a [b, 1, s, s] "
        "True = masked mask"
    ),
    "thd_local_attention": (
        "megatron/bridge/models/hybrid/hybrid_provider.py:266-272 puts megatron's DotProductAttention into the "
        "hybrid spec for attention_backend=local, and megatron/core/transformer/dot_product_attention.py:153 "
        "refuses packed (THD) input: packed input goes through cpu/attention.py's packed_attention"
    ),
    "torch_adam_state_before_load": (
        "megatron/core/optimizer/distrib_optimizer.py:837-839 (state_dict without Apex/TE: one 'step' per "
        "torch Adam state, asserted) called from sharded_state_dict:1532 when verl loads a checkpoint "
        "(verl/utils/checkpoint/megatron_checkpoint_manager.py:408) into a torch Adam that has not stepped"
    ),
}

_INSTALLED: list[str] = []


def installed() -> list[str]:
    """Names of the stand-ins installed in this process."""
    return list(_INSTALLED)


def _log(msg: str) -> None:
    print(f"[verl_cpu pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- module-local torch views


class _ModuleView(types.ModuleType):
    """A module as one library module sees it: the given attributes replaced, the rest delegated."""

    def __init__(self, real: types.ModuleType, overrides: dict):
        super().__init__(real.__name__)
        self.__dict__["_real"] = real
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self.__dict__["_real"], name)


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _on_host(factory):
    def host_factory(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    host_factory.__wrapped__ = factory
    return host_factory


def _set_module_torch(module_name: str, view: types.ModuleType) -> None:
    mod = importlib.import_module(module_name)
    if not isinstance(mod.torch, _ModuleView):
        mod.torch = view


#: modules that allocate on "cuda" by name (see STANDINS["cuda_by_name"])
_CUDA_ALLOCATING_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.schedules",
)
#: modules whose param.type() checks expect CUDA tensor type names
_CUDA_TYPE_CHECK_MODULES = frozenset(
    {
        "megatron.core.optimizer.optimizer",
        "megatron.core.optimizer.distrib_optimizer",
        "megatron.core.optimizer.clip_grads",
    }
)


def _install_cuda_by_name() -> None:
    host_torch = _ModuleView(torch, {n: _on_host(getattr(torch, n)) for n in ("tensor", "zeros", "ones", "empty", "full")})
    for name in _CUDA_ALLOCATING_MODULES:
        _set_module_torch(name, host_torch)

    real_type = torch.Tensor.type

    def type(self, *args, **kwargs):  # noqa: A001 - torch.Tensor.type
        out = real_type(self, *args, **kwargs)
        if args or kwargs or self.is_cuda or not out.startswith("torch."):
            return out
        if sys._getframe(1).f_globals.get("__name__") in _CUDA_TYPE_CHECK_MODULES:
            return "torch.cuda." + out[len("torch.") :]
        return out

    type.__wrapped__ = real_type
    torch.Tensor.type = type


def _install_host_streams() -> None:
    from verl.utils.device import get_torch_device

    host = get_torch_device()  # the CPU platform's device module: host streams, no-op synchronize
    host_cuda = _ModuleView(
        torch.cuda,
        {"Stream": host.Stream, "current_stream": host.current_stream, "stream": host.stream,
         "synchronize": host.synchronize},
    )
    view = _ModuleView(torch, {"cuda": host_cuda})
    _set_module_torch("megatron.training.models.dist_utils", view)
    _set_module_torch("megatron.core.distributed.param_and_grad_buffer", view)
    _set_module_torch("megatron.core.dist_checkpointing.strategies.filesystem_async", view)


# ---------------------------------------------------------------------------- the rest


def _install_te_free_default_hybrid_spec() -> None:
    import megatron.bridge.models.hybrid.hybrid_provider as hp

    from verl_mtp_cpu.bridge import te_layout_hybrid_stack_spec

    real = hp.get_default_hybrid_stack_spec
    if getattr(real, "_verl_cpu", False):
        return

    def get_default_hybrid_stack_spec(config):
        if getattr(config, "transformer_impl", None) == "inference_optimized" or getattr(
            config, "restore_modelopt_state", False
        ):
            return real(config)
        return te_layout_hybrid_stack_spec(config)  # in place of transformer_engine_hybrid_stack_spec()

    get_default_hybrid_stack_spec._verl_cpu = True
    get_default_hybrid_stack_spec.__wrapped__ = real
    hp.get_default_hybrid_stack_spec = get_default_hybrid_stack_spec


def _install_bshd_valid_token_mask_as_causal() -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    real = DotProductAttention.forward
    if getattr(real, "_verl_cpu", False):
        return

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.dtype == torch.bool:
            sq, sk = query.shape[0], key.shape[0]  # [s, b, heads, dim]
            attention_mask = torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=query.device), 1)[None, None]
        return real(self, query, key, value, attention_mask, *args, **kwargs)

    forward._verl_cpu = True
    forward.__wrapped__ = real
    DotProductAttention.forward = forward


def _install_thd_local_attention() -> None:
    from functools import partial

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from verl_mtp_cpu.attention import packed_attention

    real = DotProductAttention.forward
    if getattr(real, "_verl_cpu_thd", False):
        return

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if attention_bias is not None:
                raise NotImplementedError("THD reference attention: no attention bias")
            return packed_attention(partial(real, self), query, key, value, attn_mask_type, packed_seq_params)
        return real(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                    attention_bias=attention_bias, packed_seq_params=packed_seq_params)

    forward._verl_cpu = forward._verl_cpu_thd = True
    forward.__wrapped__ = real
    DotProductAttention.forward = forward


def _install_torch_adam_state_before_load() -> None:
    from megatron.core.optimizer import distrib_optimizer as do

    real = do.DistributedOptimizer.sharded_state_dict
    if getattr(real, "_verl_cpu", False):
        return

    def sharded_state_dict(self, model_sharded_state_dict={}, is_loading=False, *args, **kwargs):  # noqa: B006
        if is_loading and not do.HAVE_APEX_OR_TE and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return real(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    sharded_state_dict._verl_cpu = True
    sharded_state_dict.__wrapped__ = real
    do.DistributedOptimizer.sharded_state_dict = sharded_state_dict


def _install_latent_moe_projection() -> None:
    """``latent_moe_projection`` (see the module docstring): the names megatron's MoE layer reads at build."""
    from megatron.core.transformer.moe import moe_layer

    from verl_mtp_cpu.tiny import LatentLinearRef

    if not moe_layer.HAVE_TE:
        moe_layer.HAVE_TE, moe_layer.TELinear = True, LatentLinearRef


def install_trainer_worker_standins() -> list[str]:
    """Install every stand-in of :data:`STANDINS` in this (trainer worker) process (idempotent).

    Returns:
        list[str]: the names installed.
    """
    if torch.cuda.is_available():
        raise RuntimeError("verl_cpu stand-ins are for machines without CUDA")
    if _INSTALLED:
        return installed()
    from verl_mtp_cpu.tiny import _install_cpu_current_device, _install_mamba_reference_on_cpu
    from verl_mtp_cpu.bridge import install_te_import_placeholder, register_bridge_module_types
    from verl_mtp_cpu.events import event

    event("trainer_worker")  # harness event: a trainer worker starts, before its model is built (the demo's phases)
    _install_cpu_current_device()
    _INSTALLED.append("cpu_current_device")
    install_te_import_placeholder()
    register_bridge_module_types()
    _INSTALLED.append("te_import_placeholder")
    _install_mamba_reference_on_cpu()
    _INSTALLED.append("mamba_reference")
    _install_te_free_default_hybrid_spec()
    _INSTALLED.append("te_free_default_hybrid_spec")
    _install_latent_moe_projection()
    _INSTALLED.append("latent_moe_projection")
    # megatron's own CPU-safe choice: the "inference" tracker (add/fork are no-ops); verl's later
    # model_parallel_cuda_manual_seed finds the tracker initialised and keeps it.
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True)
    # the inference tracker holds no CUDA states (set_states is a no-op); what verl saves must not be
    # empty, or verl's resume raises: save the host generator's state in their place
    get_cuda_rng_tracker().get_states = lambda: {"host_rng_state": torch.get_rng_state()}
    _INSTALLED.append("inference_rng_tracker")
    _install_cuda_by_name()
    _INSTALLED.append("cuda_by_name")
    _install_host_streams()
    _INSTALLED.append("host_streams")
    _install_bshd_valid_token_mask_as_causal()
    _INSTALLED.append("bshd_valid_token_mask_as_causal")
    _install_thd_local_attention()
    _INSTALLED.append("thd_local_attention")
    _install_torch_adam_state_before_load()
    _INSTALLED.append("torch_adam_state_before_load")
    _log(f"trainer worker stand-ins: {', '.join(_INSTALLED)}")
    return installed()
