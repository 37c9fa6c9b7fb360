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
* :func:`te_layout_hybrid_stack_spec`: the Bridge's default hybrid stack spec is megatron's TE spec
  (``megatron.core.models.hybrid.hybrid_layer_specs.hybrid_stack_spec``). The provider's
  ``hybrid_stack_spec`` field (a public Megatron-Bridge setting, passed here through verl's
  ``override_transformer_config``) is pointed at the same layout built from megatron's local modules,
  so parameter names equal the production (TE) names the Bridge maps: the fused
  norm + column-parallel linear that megatron builds only through TE (``TELayerNormColumnParallelLinear``:
  Mamba ``mixer.in_proj``, attention ``linear_qkv``, MLP ``linear_fc1``, each with its
  ``layer_norm_weight``) is :class:`LayerNormColumnParallelLinearRef` (RMSNorm, then megatron's own
  ``ColumnParallelLinear``); the final norm is megatron's ``WrappedTorchNorm``
  (``verl_mtp_cpu.tiny``'s ``LocalHybridStack``); routed experts are megatron's local
  ``SequentialMLP`` (the Bridge maps its names and TE's grouped names to the same HF names); the
  latent-MoE projections (TE-only in megatron) use :class:`verl_mtp_cpu.tiny.LatentLinearRef`
  while the model is built (:func:`local_build_context`).
* :data:`CPU_PROVIDER_OVERRIDES`: provider fields whose defaults need TE or CUDA kernels (fusions,
  the all-to-all token dispatcher's CUDA stream) are switched off through verl's
  ``override_transformer_config`` exactly like a user override. They change kernels, not the model's
  structure or parameter names.

Everything else is the real library: the Bridge's config translation, ``finalize``, its pre-wrap
hook machinery (``register_pre_wrap_hook`` / ``provide_distributed_model``), its mapping registry and
``export_hf_weights``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.machinery
import sys
import types
from typing import Any

import torch

__all__ = [
    "CPU_PROVIDER_OVERRIDES",
    "BuiltRole",
    "build_role",
    "cpu_build_overrides",
    "role_engine",
    "verl_worker_configs",
    "write_tiny_checkpoint",
    "LayerNormColumnParallelLinearRef",  # noqa: F822 - built on first access (the module's __getattr__)
    "TE_PLACEHOLDER_VERSION",
    "bridge_available",
    "install_te_import_placeholder",
    "register_bridge_module_types",
    "local_build_context",
    "te_layout_hybrid_stack_spec",
    "te_placeholder_installed",
]

#: ``transformer_engine.__version__`` the placeholder reports (megatron-bridge reads it at import).
TE_PLACEHOLDER_VERSION = "2.9.0"

_MARK = "_verl_mtp_te_placeholder"


class _Placeholder:
    """A class every placeholder attribute resolves to (subclassable, never meant to run)."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            f"{type(self).__qualname__}: Transformer Engine placeholder (verl_mtp_cpu.bridge) "
            "was instantiated; this code path needs the real Transformer Engine"
        )


def _is_private_object(name: str) -> bool:
    """``_dummy_wgrads``-like names: a private module-level object, neither a class nor a submodule."""
    return name.startswith("_") and name.lstrip("_")[:1].islower()


class _PlaceholderModule(types.ModuleType):
    """``transformer_engine[.x.y]``: unknown attributes are placeholder classes / submodules."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if _is_private_object(name):
            # a private module-level object (verl's optimizer offload clears TE's ``_dummy_wgrads`` cache under
            # ``except ImportError``, verl/utils/megatron_utils.py:964-970): absent, as without TE
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
        if _is_private_object(fullname.rpartition(".")[2]):
            # ``from transformer_engine.x import _dummy_wgrads``: after the attribute lookup fails, Python tries
            # it as a submodule; finding none makes the statement raise ImportError, as it does without TE
            return None
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
    """True when Megatron-Bridge is installed (part of the test environment: docs/compatibility.md)."""
    import importlib.util

    return importlib.util.find_spec("megatron.bridge") is not None


@contextlib.contextmanager
def local_build_context(provider: Any = None):
    """While a tiny model is built on CPU: the latent-MoE projection stand-in (TE-only in megatron),
    the plain-torch Mamba scan and ``torch.cuda.current_device`` answering ``"cpu"`` (see
    :mod:`verl_mtp_cpu.tiny`)."""
    from verl_mtp_cpu.tiny import (
        _install_cpu_current_device,
        _install_mamba_reference_on_cpu,
        _latent_moe_projection_ref,
    )

    _install_cpu_current_device()
    _install_mamba_reference_on_cpu()
    latent = provider is None or bool(getattr(provider, "moe_latent_size", None))
    with _latent_moe_projection_ref() if latent else contextlib.nullcontext():
        yield


#: ``override_transformer_config`` entries for building a Megatron-Bridge Nemotron-H provider on CPU.
#: Each default needs Transformer Engine or a CUDA kernel: the fusions are TE/apex/CUDA kernels,
#: ``moe_shared_expert_overlap`` needs the all-to-all dispatcher, whose constructor creates a CUDA
#: stream (megatron ``MoEAlltoAllTokenDispatcher``) and which verl selects; megatron's all-gather
#: dispatcher needs ``variable_seq_lengths=False``. None of them changes a parameter name or shape.
CPU_PROVIDER_OVERRIDES: dict[str, Any] = {
    "apply_rope_fusion": False,
    "masked_softmax_fusion": False,
    "persist_layer_norm": False,
    "bias_dropout_fusion": False,
    "cross_entropy_loss_fusion": False,
    "gradient_accumulation_fusion": False,
    "moe_permute_fusion": False,
    "moe_grouped_gemm": False,
    "moe_shared_expert_overlap": False,
    "moe_token_dispatcher_type": "allgather",
    "variable_seq_lengths": False,
    "sequence_parallel": False,
}


def _layer_norm_column_parallel_linear_ref():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class LayerNormColumnParallelLinearRef(ColumnParallelLinear):
        """RMSNorm then megatron's ``ColumnParallelLinear``: the math and parameter names
        (``layer_norm_weight``, ``weight``) of TE's ``TELayerNormColumnParallelLinear`` (RMSNorm mode)."""

        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.layer_norm_weight = torch.nn.Parameter(
                torch.ones(input_size, dtype=config.params_dtype, device=self.weight.device)
            )
            setattr(self.layer_norm_weight, "sequence_parallel", bool(config.sequence_parallel))
            self.layernorm_epsilon = config.layernorm_epsilon

        def forward(self, input_, *args, **kwargs):
            x = input_.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.layernorm_epsilon)
            x = (x * self.layer_norm_weight.float()).to(input_.dtype)
            return super().forward(x, *args, **kwargs)

    return LayerNormColumnParallelLinearRef


_LNCOL = None


def __getattr__(name: str):
    global _LNCOL
    if name == "LayerNormColumnParallelLinearRef":  # built on first use: importing this module imports no megatron
        _LNCOL = _LNCOL or _layer_norm_column_parallel_linear_ref()
        return _LNCOL
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def te_layout_hybrid_stack_spec(provider: Any = None):
    """megatron's TE hybrid stack spec (``hybrid_layer_specs.hybrid_stack_spec``) with megatron's
    local modules and the named stand-ins above: production parameter names, no TE.

    Args:
        provider: the ``HybridModelProvider`` (``HybridModelProvider._resolve_hybrid_stack_spec``
            passes it); its ``num_moe_experts`` sizes the MoE spec.
    """
    from verl_mtp_cpu.tiny import _local_hybrid_stack_spec

    fused = __getattr__("LayerNormColumnParallelLinearRef")
    return _local_hybrid_stack_spec(getattr(provider, "num_moe_experts", None), fused_norm_linear=fused)


# ------------------------------------------------------------------------------------------------
# verl's model-build path for one role, as far as a CPU allows
# ------------------------------------------------------------------------------------------------


def cpu_build_overrides() -> dict[str, Any]:
    """What the CPU build adds to a role's ``override_transformer_config`` (verl passes every entry to
    the Bridge provider): :data:`CPU_PROVIDER_OVERRIDES`, the TE-free spec
    (:func:`te_layout_hybrid_stack_spec`) and ``init_model_with_meta_device=True``, whose only effect
    on this path is that Megatron-Bridge's ``get_model`` skips its ``module.cuda()`` move (megatron
    allocates on ``torch.cuda.current_device()``, which the CPU runtime answers ``"cpu"``)."""
    return {**CPU_PROVIDER_OVERRIDES, "hybrid_stack_spec": te_layout_hybrid_stack_spec, "init_model_with_meta_device": True}


class _RecordingWorker:
    """Takes the place of verl's ``TrainingWorker`` in ``ActorRolloutRefWorker.init_model`` (its
    ``actor_worker_cls`` / ``ref_worker_cls`` class attributes): records the ``TrainingWorkerConfig``
    verl builds for the role instead of starting a GPU worker."""

    def __init__(self, config):
        self.config = config

    def reset(self):
        return None

    def set_loss_fn(self, loss_fn):
        return None

    def get_dispatch_collect(self):
        return {}


def verl_worker_configs(cfg: Any, role: str):
    """verl's own ``TrainingWorkerConfig`` for ``role`` (``actor``, ``ref`` or ``critic``) of a composed
    trainer config.

    actor / ref: verl's ``ActorRolloutRefWorker.init_model`` runs for real (unbound, on a namespace
    holding what it reads) with :class:`_RecordingWorker` as the worker class: the reference model gets
    verl's ``MtpConfig(enable=False)`` and its own ``ref`` engine config exactly as in a run. critic:
    what verl's v1 trainer does (``trainer/ppo/v1/trainer_base.py``): ``omega_conf_to_dataclass(critic)``
    -> ``TrainingWorkerConfig(model_type="value_model", model_config=critic.model, engine_config=critic.engine)``.
    """
    import copy
    from types import SimpleNamespace

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig

    if role == "critic":
        critic = omega_conf_to_dataclass(cfg.critic)
        return TrainingWorkerConfig(
            model_type="value_model",
            model_config=critic.model,
            engine_config=critic.engine,
            optimizer_config=critic.optim,
            checkpoint_config=critic.checkpoint,
        )
    from verl.workers.engine_workers import ActorRolloutRefWorker

    recorded: dict[str, Any] = {}

    def dispatch(**kwargs):
        return None

    worker = SimpleNamespace(
        config=copy.deepcopy(cfg.actor_rollout_ref),
        role=role,
        distillation_config=None,
        distillation_enabled=False,
        _omega_profiler_config=None,
        actor_worker_cls=_RecordingWorker,
        ref_worker_cls=_RecordingWorker,
        set_dispatch_collect=dispatch,
    )
    if role == "actor":
        # stop after the actor's worker config: init_model then builds the checkpoint engine (GPU)
        class _Stop(Exception):
            pass

        def actor_cls(config):
            recorded["actor"] = config
            raise _Stop

        worker.actor_worker_cls = actor_cls
        try:
            ActorRolloutRefWorker.init_model(worker)
        except _Stop:
            pass
        return recorded["actor"]
    ActorRolloutRefWorker.init_model(worker)
    return worker.ref.config


def role_engine(worker_config):
    """The engine verl's ``TrainingWorker`` would build for ``worker_config`` (``EngineRegistry.new``
    with the worker config's model type and strategy, as in ``TrainingWorker.__init__``)."""
    from verl.workers.engine import EngineRegistry

    worker_config.model_config.model_type = worker_config.model_type
    return EngineRegistry.new(
        model_type=worker_config.model_type,
        backend=worker_config.engine_config.strategy,
        model_config=worker_config.model_config,
        engine_config=worker_config.engine_config,
        optimizer_config=worker_config.optimizer_config,
        checkpoint_config=worker_config.checkpoint_config,
    )


@dataclasses.dataclass
class BuiltRole:
    """One role's engine and the model chunks verl's path built for it."""

    engine: Any
    module: list

    @property
    def model(self):
        """The first chunk without its Float16Module wrapper."""
        from verl_mtp_plugin.control import unwrap_model

        return unwrap_model(self.module[0])


def build_role(engine) -> BuiltRole:
    """Build ``engine``'s model along verl's real path, as far as a CPU allows.

    Runs the engine's ``_build_tf_config`` (verl's ``check_mtp_config``, ``AutoBridge.from_hf_pretrained``
    -> ``NemotronHBridge`` -> ``HybridModelProvider``, verl's provider overrides, the plugin engine's
    MTP overrides and pre-wrap hook) and then verl's ``make_megatron_module`` with the arguments
    ``MegatronEngine._build_megatron_module`` passes (Megatron-Bridge's ``provide_distributed_model``:
    provider ``finalize``d model, verl's value-head and the plugin's pre-wrap hooks). Two differences,
    both CPU limits: no DDP wrap (Megatron-Bridge's ``_ddp_wrap`` creates a CUDA stream; the pre-wrap
    hooks run before it either way) and no checkpoint load (``bridge.load_hf_weights``: the tiny
    checkpoint has no weights). Add :func:`cpu_build_overrides` to the engine's
    ``override_transformer_config`` first.
    """
    import os

    from verl.utils.megatron_utils import McoreModuleWrapperConfig, make_megatron_module

    # Each verl role builds in its own worker process; megatron records the attention backend in
    # process-wide NVTE_* variables (and asserts they agree), so one role's choice must not leak into
    # the next role built in this process.
    saved = {k: os.environ.pop(k, None) for k in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")}
    try:
        return _build_role(engine, McoreModuleWrapperConfig, make_megatron_module)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def register_bridge_module_types() -> None:
    """Tell Megatron-Bridge's ``AutoMapping`` how the stand-ins are sharded, through its public
    registration API (as verl does for its ``LinearForLastLayer``): :class:`LayerNormColumnParallelLinearRef`
    like ``TELayerNormColumnParallelLinear`` (column), ``LatentLinearRef`` like the latent projections'
    ``TELinear(parallel_mode="duplicated")`` (replicated)."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    AutoMapping.register_module_type("LayerNormColumnParallelLinearRef", "column")
    AutoMapping.register_module_type("LatentLinearRef", "replicated")


def _build_role(engine, McoreModuleWrapperConfig, make_megatron_module) -> BuiltRole:
    register_bridge_module_types()
    engine._build_tf_config()
    wrap = McoreModuleWrapperConfig(
        is_value_model=engine.is_value_model,
        wrap_with_ddp=False,
        use_distributed_optimizer=engine.engine_config.use_distributed_optimizer,
        use_megatron_fsdp=engine.engine_config.use_megatron_fsdp,
    )
    with local_build_context(engine.provider):
        module, tf_config = make_megatron_module(
            wrap_config=wrap,
            tf_config=engine.tf_config,
            hf_config=engine.model_config.hf_config,
            bridge=engine.bridge,
            provider=engine.provider,
            override_model_config=engine.engine_config.override_mcore_model_config,
            override_ddp_config=engine._resolve_override_ddp_config(),
            peft_cls=engine.peft_cls,
            peft_config=engine.model_config.get("lora", None),
        )
    engine.tf_config = tf_config
    engine.module = module
    return BuiltRole(engine=engine, module=module)


def write_tiny_checkpoint(path, spec=None, *, seed: int = 0) -> str:
    """A tiny Nemotron-H checkpoint directory: ``config.json`` (:func:`~verl_mtp_cpu.vllm_drafter.hf_config_for_tiny`)
    and ``model.safetensors`` holding every HF tensor of a tiny megatron model of ``spec``
    (:func:`~verl_mtp_plugin.export.export_mtp_weights` with ``include_backbone=True``). Megatron-Bridge
    reads the checkpoint's tensors when it exports (``AutoBridge.export_hf_weights`` looks up expected
    keys in ``hf_pretrained.state``). Call :func:`verl_mtp_cpu.tiny.init_megatron` first."""
    import pathlib

    from safetensors.torch import save_file

    from verl_mtp_plugin.export import export_mtp_weights
    from verl_mtp_cpu.tiny import build_tiny_hybrid
    from verl_mtp_cpu.vllm_drafter import write_hf_config_dir

    path = pathlib.Path(write_hf_config_dir(path, spec))
    torch.manual_seed(seed)
    model = build_tiny_hybrid(spec, device="cpu")
    tensors = {n: t.detach().to("cpu").contiguous().clone() for n, t in export_mtp_weights(model, include_backbone=True)}
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)
