"""The trainer side and the engines of ``speculation.py speedup``: the trainer and its synthetic language,
pretraining, policy snapshots, and the rollout engines of the production update path.

* **Language** ("noisy progressions"): ``<bos>`` + 4 digits of an arithmetic progression mod 20 + a continuation
  whose every token is the next digit (p = 0.9) or one of 8 fillers; entropy ~0.5 nats/token, so a trained MTP
  head is sharp. The RL reward is the filler rate, which moves the policy off what the MTP head learned.
* **Trainer**: a Nemotron-3-shaped megatron-core ``HybridModel`` (``MODEL_PRESETS``), pretrained with megatron's
  MTP loss; whole-model snapshots in HF names (``export_mtp_weights(include_backbone=True)``).
* **Engines**: ``verl_mtp_cpu.vllm_engine.build_engine`` with the plugin's worker extension (engine core in its
  own process on CUDA); every policy version goes in through ``RolloutEngine.sync`` (the worker RPC
  ``update_weights_from_ipc`` fed by verl's ``BucketedWeightSender``).

Without verl on the path (the GPU machine) the RL step needs verl's pure-Python dependencies: make their tarball
here with ``python benchmarks/rollout_lib.py --make-deps-bundle PATH`` and unpack it there; ray is replaced by a
placeholder holding only the annotation verl.protocol needs (:func:`import_verl_algorithms`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import platform
import sys
import tempfile
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, os.path.join(ROOT, "cpu_runtime"), HERE):  # cpu_runtime: verl_mtp_cpu
    if p not in sys.path:
        sys.path.insert(0, p)

CUDA = torch.cuda.is_available()
T0 = time.time()
PRETRAIN_MTP_FACTOR = 0.3


def setup_env() -> None:
    """vLLM reads these when first imported: in-process engine core on a CPU, functions over collective_rpc, and
    no flashinfer sampler (not on the GPU machine). Call before anything imports vLLM."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if CUDA:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    else:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- verl


def import_verl_algorithms():
    """``(compute_grpo_outcome_advantage, get_policy_loss_fn, ActorConfig)`` from verl. verl imports ``ray`` on
    this path only for an annotation (``verl.protocol``): where ray is not installed (the GPU machine) a placeholder
    ``ray`` holding only ``ObjectRef`` is registered first."""
    if "ray" not in sys.modules and importlib.util.find_spec("ray") is None:
        ray = types.ModuleType("ray")
        ray.__doc__ = "placeholder: ray is not installed here; only the ObjectRef annotation verl.protocol needs"

        class ObjectRef:  # noqa: D401 - annotation target only
            """Placeholder for ray.ObjectRef (annotations only)."""

        ray.ObjectRef = ObjectRef
        sys.modules["ray"] = ray
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_policy_loss_fn
    from verl.workers.config import ActorConfig

    return compute_grpo_outcome_advantage, get_policy_loss_fn, ActorConfig


#: Pure-Python packages the verl import path needs that the GPU image lacks (torch, numpy, transformers,
#: pyyaml, cloudpickle, pynvml, ... are there).
DEPS_BUNDLE_PACKAGES = ("verl", "tensordict", "omegaconf", "antlr4", "dill", "pyvers", "orjson", "codetiming",
                        "jmespath")


def make_deps_bundle(path: str) -> None:
    """Tar the installed packages of :data:`DEPS_BUNDLE_PACKAGES` (with their dist-info) into ``path``."""
    import glob
    import tarfile

    import verl

    site = os.path.dirname(os.path.dirname(os.path.abspath(verl.__file__)))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name in DEPS_BUNDLE_PACKAGES:
            paths = [os.path.join(site, name)] + glob.glob(os.path.join(site, f"{name}-*.dist-info"))
            paths += glob.glob(os.path.join(site, f"{name.replace('antlr4', 'antlr4_python3_runtime')}-*.dist-info"))
            found = [p for p in paths if os.path.exists(p)]
            if not found or not os.path.exists(paths[0]):
                raise SystemExit(f"--make-deps-bundle: package {name!r} not found in {site}")
            for p in sorted(set(found)):
                tar.add(p, arcname=os.path.basename(p),
                        filter=lambda ti: None if "__pycache__" in ti.name else ti)
    print(f"wrote {path} ({os.path.getsize(path) / 2**20:.1f} MiB): {', '.join(DEPS_BUNDLE_PACKAGES)}")


# --------------------------------------------------------------------------- the synthetic language


@dataclasses.dataclass
class Language:
    """Noisy progressions (module docstring). Token ids: 0 pad, 1 bos, ``2 .. 2+D-1`` digits, then ``F`` fillers;
    the hidden progression advances under fillers too."""

    num_digits: int = 20
    num_fillers: int = 8
    max_step: int = 4
    noise: float = 0.1
    prompt_digits: int = 4
    response_len: int = 24
    vocab_size: int = 32

    def __post_init__(self):
        if 2 + self.num_digits + self.num_fillers > self.vocab_size:
            raise ValueError("vocab_size too small for num_digits + num_fillers + 2")

    @property
    def prompt_len(self) -> int:
        return 1 + self.prompt_digits

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def filler_lo(self) -> int:
        return 2 + self.num_digits

    def _start(self, n: int, gen: torch.Generator):
        v0 = torch.randint(0, self.num_digits, (n, 1), generator=gen)
        step = torch.randint(1, self.max_step + 1, (n, 1), generator=gen)
        return v0, step

    def _digits(self, v0, step, t: torch.Tensor) -> torch.Tensor:
        return (v0 + step * t[None, :]) % self.num_digits + 2

    def prompts(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """``[n, prompt_len]`` prompts (CPU)."""
        v0, step = self._start(n, gen)
        d = self._digits(v0, step, torch.arange(self.prompt_digits))
        return torch.cat([torch.ones(n, 1, dtype=torch.long), d], dim=1)

    def sample(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """``[n, seq_len]`` pretraining sequences (CPU)."""
        v0, step = self._start(n, gen)
        t = torch.arange(self.prompt_digits + self.response_len)
        d = self._digits(v0, step, t)
        noisy = torch.rand(n, self.response_len, generator=gen) < self.noise
        fill = torch.randint(0, self.num_fillers, (n, self.response_len), generator=gen) + self.filler_lo
        resp = torch.where(noisy, fill, d[:, self.prompt_digits:])
        return torch.cat([torch.ones(n, 1, dtype=torch.long), d[:, : self.prompt_digits], resp], dim=1)

    def is_filler(self, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens >= self.filler_lo) & (tokens < self.filler_lo + self.num_fillers)

    def reward(self, responses: torch.Tensor) -> torch.Tensor:
        """``[n]`` fraction of response tokens that are fillers."""
        return self.is_filler(responses).float().mean(dim=1)


# --------------------------------------------------------------------------- model


def use_torch_mamba_reference() -> None:
    """GPU without mamba_ssm's Triton kernels: megatron's ``MambaMixer`` runs the plugin's plain-torch
    Mamba-2 reference (:mod:`verl_mtp_cpu._mamba_ref`, the substitution the CPU tests use; the
    same math, a sequential scan). Chosen with ``--mamba-impl torch``: on the H200 the Triton kernels'
    compile + autotune took ~100 s per process, more than a short device call can pay. Call before
    building a model, in a process where mamba_ssm was not made importable."""
    import megatron.core.ssm.mamba_mixer as mm

    from verl_mtp_cpu._mamba_ref import (
        GatedRMSNormRef,
        mamba_chunk_scan_combined_ref,
        mamba_split_conv1d_scan_combined_ref,
    )

    if mm.HAVE_MAMBA_SSM and getattr(mm.mamba_chunk_scan_combined, "__module__", "").startswith("mamba_ssm."):
        raise SystemExit("--mamba-impl torch: mamba_ssm's Triton ops are already active in this process")
    if not mm.HAVE_MAMBA_SSM:
        mm.HAVE_MAMBA_SSM = True
        mm.ExtendedRMSNorm = type("ExtendedRMSNorm", (GatedRMSNormRef,), {})
    mm.mamba_split_conv1d_scan_combined = mamba_split_conv1d_scan_combined_ref
    mm.mamba_chunk_scan_combined = mamba_chunk_scan_combined_ref
    if hasattr(mm, "MAMBA_HAS_STATE_DTYPE"):
        mm.MAMBA_HAS_STATE_DTYPE = False


MAMBA_IMPL = "triton"


def build_model(spec, device: torch.device):
    if device.type == "cuda" and MAMBA_IMPL == "torch":
        from verl_mtp_plugin.testing import build_tiny_hybrid

        return build_tiny_hybrid(spec, device=device)  # use_mamba_mem_eff_path=False on CUDA
    if device.type == "cuda":
        from verl_mtp_plugin.testing.gpu import build_gpu_hybrid

        return build_gpu_hybrid(spec)
    from verl_mtp_plugin.testing import build_tiny_hybrid

    return build_tiny_hybrid(spec, device=device)


class Fwd:
    """Positions / mask cache and the token log-prob helpers for one device."""

    def __init__(self, device: torch.device):
        self.device = device
        self._masks: dict[int, torch.Tensor | None] = {}

    def mask(self, s: int):
        if s not in self._masks:
            from verl_mtp_plugin.testing import causal_mask

            # GPU: megatron's causal default (what the GPU benchmarks use); CPU: explicit (its default is built on CUDA)
            self._masks[s] = None if self.device.type == "cuda" else causal_mask(s, self.device)
        return self._masks[s]

    def pos(self, b: int, s: int) -> torch.Tensor:
        return torch.arange(s, device=self.device).unsqueeze(0).expand(b, s)

    def __call__(self, model, ids, *, run_mtp: bool, **kw):
        from verl_mtp_plugin.control import hybrid_forward

        b, s = ids.shape
        return hybrid_forward(model, ids, self.pos(b, s), self.mask(s), run_mtp_forward=run_mtp, **kw)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[b, s-1]``: log p(token t+1 | ..t) at position t."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


# --------------------------------------------------------------------------- sampling


@torch.no_grad()
def sample(model, mode: str, fwd: Fwd, prompts: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Autoregressive sampling at temperature 1 by inverse CDF (full recompute per token): token ``j`` of row ``i``
    is the first whose cumulative probability reaches ``uniforms[i, j]`` (``[n, L]`` U(0,1) on the model's
    device). Returns ``[n, p + L]``."""
    from verl_mtp_plugin.policy import Phase, run_mtp_forward

    run = run_mtp_forward(mode, Phase.ROLLOUT)
    was = model.training
    model.eval()
    seq = prompts
    for j in range(uniforms.shape[1]):
        logits = fwd(model, seq, run_mtp=run)
        cdf = torch.softmax(logits[:, -1].float(), dim=-1).cumsum(-1)
        u = uniforms[:, j : j + 1] * cdf[:, -1:]
        nxt = torch.searchsorted(cdf, u).clamp_(max=cdf.shape[-1] - 1)
        seq = torch.cat([seq, nxt], dim=1)
    model.train(was)
    return seq


# --------------------------------------------------------------------------- verl's import path without ray

#: Import hook written as ``sitecustomize.py`` where ray is missing (the GPU machine): a placeholder ``ray`` and
#: verl's two rollout packages imported bare (their ``__init__`` imports ray; the modules under them do not).
SITE_HOOK = '''
"""verl's rollout modules without ray (written by benchmarks/rollout_lib.py; GPU machine only)."""
import importlib.abc
import importlib.machinery
import sys


class _VerlRolloutWithoutRay(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    BARE = ("verl.workers.rollout", "verl.workers.rollout.vllm_rollout")

    def find_spec(self, name, path=None, target=None):
        if name == "ray":
            return importlib.machinery.ModuleSpec("ray", self)
        if name not in self.BARE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            real = finder.find_spec(name, path, target)
            if real is not None:
                bare = importlib.machinery.ModuleSpec(name, self, is_package=True)
                bare.submodule_search_locations = list(real.submodule_search_locations)
                return bare
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ == "ray":
            module.__doc__ = "placeholder: ray is not installed here; only the ObjectRef annotation"

            class ObjectRef:
                """Placeholder for ray.ObjectRef (annotations only)."""

            module.ObjectRef = ObjectRef
        # the two verl packages: bare (their __init__, which imports ray, is not run)


if not any(type(f).__name__ == "_VerlRolloutWithoutRay" for f in sys.meta_path):
    sys.meta_path.insert(0, _VerlRolloutWithoutRay())
'''


def install_verl_import_path_without_ray(workdir: str) -> str | None:
    """Where ray is missing: write :data:`SITE_HOOK` as ``sitecustomize.py`` into ``workdir/site_hook``,
    put it first on ``PYTHONPATH`` (child processes) and run it here. Returns the folder, or None where
    ray is installed (nothing changed)."""
    if "ray" in sys.modules or importlib.util.find_spec("ray") is not None:
        return None
    folder = os.path.join(workdir, "site_hook")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(SITE_HOOK)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH", "")) if p)
    exec(compile(SITE_HOOK, os.path.join(folder, "sitecustomize.py"), "exec"), {"__name__": "sitecustomize"})
    return folder


# --------------------------------------------------------------------------- shapes


#: Trainer shapes (``TinyHybridSpec`` fields). ``200m``: 7 Mamba, 7 MoE (8 experts top-2 + shared), 2 attention;
#: ``2b``: 2.2 B parameters (0.7 B active), 11 Mamba, 11 MoE (32 experts top-4 + shared), 3 attention, Mamba 64
#: heads x 64 with state 128 and 8 groups (Nano's); both with the MTP block ``*E``. ``cpu``: the dense variant.
MODEL_PRESETS = {
    "200m": dict(pattern="MEMEM*EMEMEM*EME/*E", hidden_size=1024, ffn_hidden_size=2048, num_attention_heads=8,
                 num_query_groups=2, num_experts=8, moe_topk=2, moe_ffn_hidden_size=512,
                 moe_shared_expert_intermediate_size=512, moe_latent_size=None, mamba_state_dim=64,
                 mamba_head_dim=64, mamba_num_groups=2),
    "2b": dict(pattern="MEMEM*EMEMEM*EMEMEM*EMEME/*E", hidden_size=2048, ffn_hidden_size=4096, num_attention_heads=16,
               num_query_groups=2, num_experts=32, moe_topk=4, moe_ffn_hidden_size=1024,
               moe_shared_expert_intermediate_size=2048, moe_latent_size=None, mamba_state_dim=128,
               mamba_head_dim=64, mamba_num_groups=8),
    "cpu": dict(pattern="M-M*-/*", hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, num_query_groups=2,
                mamba_state_dim=16, mamba_head_dim=32, mamba_num_groups=1),
}


def model_spec(args):
    """GPU: Nemotron-3-like alternation (7 Mamba, 7 MoE, 2 attention) + MTP ``*E``, bf16. CPU: the dense
    variant vLLM-cpu generates with (Mamba, attention, MLP; MTP ``*``), fp32 trainer."""
    from verl_mtp_plugin.testing import TinyHybridSpec

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.trainer_dtype]
    preset = "cpu" if args.device != "cuda" else args.size
    spec = TinyHybridSpec(vocab_size=args.vocab, max_sequence_length=256, params_dtype=dtype,
                          mtp_loss_scaling_factor=PRETRAIN_MTP_FACTOR, **MODEL_PRESETS[preset])
    if args.pattern:
        spec = dataclasses.replace(spec, pattern=args.pattern)
    if args.mtp_depths > 1:  # Nemotron 3 Super: one physical MTP block trained over 2 depths (vLLM reuses it per draft)
        main, mtp = spec.pattern.split("/")[0], spec.pattern.split("/")[1]
        spec = dataclasses.replace(spec, pattern="/".join([main] + [mtp] * args.mtp_depths), mtp_use_repeated_layer=True)
    return spec


# --------------------------------------------------------------------------- trainer


class Trainer:
    """The model and its optimizer: megatron's (DDP + Adam with fp32 main params, as in
    ``testing.gpu.megatron_ddp_and_optimizer``) for a bf16 model, torch AdamW for an fp32 one."""

    def __init__(self, model, lr: float):
        self.model = model
        self.megatron = next(model.parameters()).dtype == torch.bfloat16
        if self.megatron:
            from verl_mtp_plugin.testing.gpu import megatron_ddp_and_optimizer

            self.module, self.opt = megatron_ddp_and_optimizer(
                model, lr=lr, overlap_grad_reduce=False, use_distributed_optimizer=False, clip_grad=1.0)
        else:
            self.module = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def zero_grad(self) -> None:
        if self.megatron:
            self.module.zero_grad_buffer()
            self.opt.zero_grad()
        else:
            self.opt.zero_grad(set_to_none=True)

    def step(self) -> float:
        if self.megatron:
            self.module.finish_grad_sync()
            _, grad_norm, _ = self.opt.step()
            return float(grad_norm or 0.0)
        gn = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
        self.opt.step()
        return gn


def pretrain(trainer: Trainer, lang, fwd, args, rows: list) -> dict:
    """Joint pretraining: next-token loss + megatron's MTP loss (factor 0.3), cosine schedule."""
    from verl_mtp_plugin.control import configure_transformer_config
    from verl_mtp_plugin.metrics import collect_mtp_metrics, reset_mtp_metrics

    configure_transformer_config(trainer.model.config, "joint", mtp_loss_scaling_factor=PRETRAIN_MTP_FACTOR)
    gen = torch.Generator().manual_seed(args.seed + 1)
    steps, warm = args.pretrain_steps, max(1, args.pretrain_steps // 20)
    deadline = time.time() + args.pretrain_seconds
    trainer.model.train()
    reset_mtp_metrics()
    t0, done, last = time.time(), 0, {}
    for i in range(steps):
        if time.time() > deadline:
            log(f"pretrain: time cap reached after {i} of {steps} steps")
            break
        frac = (i - warm) / max(1, steps - warm)
        lr = args.pretrain_lr * ((i + 1) / warm if i < warm else 0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))
        trainer.set_lr(lr)
        ids = lang.sample(args.pretrain_batch, gen).to(fwd.device)
        tok_mask = torch.zeros(ids.shape, device=fwd.device)
        tok_mask[:, 2:] = 1.0
        trainer.zero_grad()
        logits = fwd(trainer.module, ids, run_mtp=True, loss_mask=tok_mask)
        lp = token_logprobs(logits, ids)
        loss = -(lp * tok_mask[:, 1:]).sum() / tok_mask[:, 1:].sum()
        loss.backward()
        trainer.step()
        done = i + 1
        if done % args.log_every == 0 or done == steps:
            m = collect_mtp_metrics(num_microbatches=1)
            last = {"step": done, "loss": float(loss.detach()), "mtp_loss": m.get("mtp_losses/mtp_1_loss", math.nan),
                    "mtp_top1": m.get("mtp_accuracy/mtp_1_top1", math.nan), "seconds": time.time() - t0}
            rows.append(last)
            log(f"pretrain {done}/{steps} loss {last['loss']:.4f} mtp_loss {last['mtp_loss']:.4f} "
                f"mtp_top1 {last['mtp_top1']:.3f}")
        else:
            reset_mtp_metrics()
    return {"steps_done": done, "seconds": time.time() - t0, "final": last}


def export_snapshot(model, vocab_size: int, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The whole model in HF names (``export_mtp_weights(include_backbone=True)``), copied, floating
    tensors in the rollout dtype except fp32 router biases (kept fp32 as in Nemotron 3 checkpoints)."""
    from verl_mtp_plugin.export import export_mtp_weights

    out = []
    for name, t in export_mtp_weights(model, vocab_size=vocab_size, include_backbone=True):
        t = t.detach()
        if t.is_floating_point() and not name.endswith("e_score_correction_bias"):
            t = t.to(dtype)
        out.append((name, t.clone()))
    return out


def spec_counts(llm):
    """Cumulative spec-decode counters of this engine (plugin's ``spec_metrics`` over ``LLM.get_metrics()``)."""
    from verl_mtp_plugin.rollout.monitor.spec_metrics import counts_from_vllm_metrics, total_counts

    return total_counts(counts_from_vllm_metrics(llm.get_metrics()).values())


# --------------------------------------------------------------------------- run setup


def environment(args) -> dict:
    from importlib.metadata import version

    env = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node(),
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name() if CUDA else "cpu", "cpu_count": os.cpu_count()}
    import vllm

    env["vllm"] = vllm.__version__
    for pkg in ("megatron-core", "verl", "mamba_ssm", "triton", "transformers"):
        try:
            env[pkg] = version(pkg)
        except Exception:
            env[pkg] = None
    if CUDA:
        from verl_mtp_cpu.mamba_triton import mamba_kernels_active

        env["trainer_mamba_triton_kernels"] = mamba_kernels_active()
        env["driver"] = torch.cuda.get_device_properties(0).name
    else:
        env["cpu_note"] = ("vllm-cpu 0.31: drafts at temperature > 0 are all rejected; Mamba decode state is not "
                           "rolled back after rejected drafts (speculative output can differ from no speculation)")
    return env


def add_args(ap: argparse.ArgumentParser) -> None:
    """The options of ``speculation.py speedup``."""
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default=None, help="file tag (default: h200/gpu on CUDA, cpu otherwise)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (stops adding engines)")
    ap.add_argument("--ks", default="1,2,3", help="speculative token counts, in the order the engines are built")
    ap.add_argument("--graph-modes", default=None,
                    help="'graphs' or 'eager' (default: graphs on CUDA, eager on CPU); the engines use the first")
    ap.add_argument("--greedy-row", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--mamba-impl", default="triton", choices=("triton", "torch"),
                    help="CUDA trainer: mamba_ssm's Triton kernels or the plugin's plain-torch reference")
    ap.add_argument("--trainer-dtype", default=None, choices=("bf16", "fp32"),
                    help="default bf16 on CUDA (megatron optimizer, fp32 main params), fp32 on CPU")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.12)
    ap.add_argument("--pattern", default=None, help="override the model's hybrid pattern (main/mtp)")
    ap.add_argument("--mtp-depths", type=int, default=2,
                    help="MTP depths trained over one repeated block (Nemotron 3 Super: 2); 1 = a single depth")
    ap.add_argument("--vocab", type=int, default=None, help="vocab size (language uses 30 ids; default 32768 GPU, 64 CPU)")
    ap.add_argument("--response-len", type=int, default=None, help="default 128 GPU, 32 CPU")
    ap.add_argument("--pretrain-steps", type=int, default=None)
    ap.add_argument("--pretrain-seconds", type=float, default=1e9)
    ap.add_argument("--pretrain-batch", type=int, default=None)
    ap.add_argument("--pretrain-lr", type=float, default=1e-3)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--rl-steps", type=int, default=4)
    ap.add_argument("--rl-prompts", type=int, default=16)
    ap.add_argument("--rl-group", type=int, default=8)
    ap.add_argument("--rl-lr", type=float, default=5e-5)
    ap.add_argument("--prompts", type=int, default=None, help="measured prompts per generate call (64 GPU, 16 CPU)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (= response length)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--size", default="200m", choices=("200m", "2b"), help="CUDA trainer preset (CPU: tiny dense)")
    ap.add_argument("--runner", default="v2", choices=("v1", "v2"), help="vLLM GPU model runner (CUDA)")
    ap.add_argument("--batches", default=None,
                    help="sequences per measured generate call (default 64,256 GPU, 8,16 CPU); every version is "
                         "measured at the first, the last version at all")
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="vLLM cache (KV + Mamba state)")
    ap.add_argument("--bucket-mb", type=int, default=512, help="verl's update bucket (>= largest tensor)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="build the no-speculation engine first (--no-baseline: measured in another call)")
    ap.add_argument("--state", default=None,
                    help="save the trainer's policy versions and estimates here; if the file exists, load them and "
                         "run the engines only (a later device call)")
    ap.add_argument("--draft-sample-method", default="greedy", choices=("greedy", "probabilistic"),
                    help="vLLM's speculative_config.draft_sample_method (greedy = vLLM's default: a draft is "
                         "accepted with p[argmax q]; probabilistic: with the overlap sum min(p, q))")
    ap.add_argument("--capture", default="full", choices=("full", "lean"),
                    help="CUDA-graph sizes: full (every size up to N x (k+1)) or lean (1..8 and N, N x (k+1) of "
                         "--batches: the sizes these fixed-batch calls run; shorter engine builds)")
    ap.add_argument("--trainer-only", action="store_true",
                    help="train, save the policy versions to --state, build no engine (the engines run in a "
                         "later call)")


def finish_args(args):
    """Device-dependent defaults and checks of :func:`add_args`'s options."""
    args.device = "cuda" if CUDA else "cpu"
    gpu = args.device == "cuda"
    args.tag = args.tag or ("gpu" if gpu else "cpu")
    args.trainer_dtype = args.trainer_dtype or ("bf16" if gpu else "fp32")
    args.graph_modes = [m for m in (args.graph_modes or ("graphs" if gpu else "eager")).split(",") if m]
    if not gpu and "graphs" in args.graph_modes:
        raise SystemExit("--graph-modes graphs needs CUDA")
    args.vocab = args.vocab or (32768 if gpu else 64)
    args.response_len = args.response_len or (128 if gpu else 32)
    args.max_tokens = args.max_tokens or args.response_len
    args.prompts = args.prompts or (64 if gpu else 16)
    args.batches = [int(x) for x in (args.batches or ("64,256" if gpu else "8,16")).split(",") if x]
    args.kv_cache_gib = args.kv_cache_gib or (40.0 if gpu else 0.25)
    args.pretrain_steps = args.pretrain_steps or (300 if gpu else 200)
    args.pretrain_batch = args.pretrain_batch or (64 if gpu else 32)
    args.ks = [int(k) for k in args.ks.split(",") if k.strip()]
    if any(k < 1 for k in args.ks):
        raise SystemExit("--ks: speculative token counts must be >= 1")
    if args.trainer_only and not args.state:
        raise SystemExit("--trainer-only needs --state (where the policy versions go)")
    return args


def prepare(args) -> types.SimpleNamespace:
    """Environment, the verl import path, megatron, the language and the model spec; the trainer's model (or, when
    ``--state`` exists, the saved run: ``ctx.state``, no model); the result dict and its writer
    (``<out>/rollout_speedup_<tag>.json``)."""
    global MAMBA_IMPL
    setup_env()
    deadline = T0 + args.budget if args.budget else float("inf")
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="rollout_speedup_")
    os.environ.setdefault("VERL_RAY_JOB_ID", f"speedup-{os.getpid()}")
    if CUDA:
        # the engine core runs in its own process, spawned (CUDA is initialised here by the trainer)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    # verl's rollout modules without ray where ray is not installed (the GPU machine), before any verl import
    hook = install_verl_import_path_without_ray(args.workdir)
    log(f"update path: ipc (runner {args.runner if CUDA else 'v1 (CPU)'}); verl import hook: {hook}")
    device = torch.device("cuda", 0) if CUDA else torch.device("cpu")
    if CUDA and args.trainer_dtype == "fp32":  # an fp32 trainer on the GPU: TF32 matmuls (as Megatron's default)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if CUDA and args.mamba_impl == "triton":
        from verl_mtp_cpu.mamba_triton import install_mamba_ssm_triton

        install_mamba_ssm_triton()
    from verl_mtp_plugin.testing import init_megatron, reset_mtp_globals

    init_megatron(seed=args.seed)
    if CUDA and args.mamba_impl == "torch":
        use_torch_mamba_reference()
    MAMBA_IMPL = args.mamba_impl
    algos = import_verl_algorithms()
    lang = Language(response_len=args.response_len, vocab_size=args.vocab)
    args.max_model_len = lang.seq_len + max(args.ks) + 8
    spec = model_spec(args)
    reset_mtp_globals(args.mtp_depths)
    state = None
    if args.state and os.path.exists(args.state):  # a trainer run saved by an earlier call: engines only
        state = torch.load(args.state, map_location="cpu", weights_only=False)
        if state["spec_pattern"] != spec.pattern or state["hidden_size"] != spec.hidden_size:
            raise SystemExit(f"--state {args.state} holds {state['spec_pattern']} hidden {state['hidden_size']}, "
                             f"not this run's {spec.pattern} hidden {spec.hidden_size}")
        model, fwd = None, None
        n_params, n_mtp = state["params"]["total"], state["params"]["mtp"]
    else:
        model = build_model(spec, device)
        fwd = Fwd(device)
        n_params = sum(p.numel() for p in model.parameters())
        n_mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, f"rollout_speedup_{args.tag}.json")
    result = {
        "config": {k: v for k, v in vars(args).items()}, "spec": {**dataclasses.asdict(spec),
                                                                 "params_dtype": str(spec.params_dtype)},
        "params": {"total": n_params, "mtp": n_mtp}, "language": dataclasses.asdict(lang),
        "environment": environment(args), "rollout_dtype": "bfloat16",
        "gpu_memory_utilization": args.gpu_memory_utilization if CUDA else None,
        "draft_sample_method": args.draft_sample_method,
    }

    def write():
        result["elapsed_s"] = time.time() - T0
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1, default=str)

    log(f"model {spec.pattern} hidden {spec.hidden_size} vocab {spec.vocab_size} {spec.params_dtype}: "
        f"{n_params / 1e6:.1f} M params ({n_mtp / 1e6:.1f} M MTP); trainer {args.trainer_dtype}, "
        f"Mamba {args.mamba_impl if CUDA else 'torch reference (CPU)'}")
    return types.SimpleNamespace(device=device, algos=algos, lang=lang, spec=spec, state=state, model=model, fwd=fwd,
                                 n_params=n_params, n_mtp=n_mtp, result=result, write=write, out_path=out_path,
                                 deadline=deadline)


# --------------------------------------------------------------------------- the production update path


def capture_sizes(max_tokens: int) -> list[int]:
    """CUDA-graph sizes up to ``max_tokens`` (= max_num_seqs x (k+1), what ``verl-mtp check`` asks for)."""
    base = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024]
    return sorted({x for x in base if x <= max_tokens} | {max_tokens})


class EngineStartError(RuntimeError):
    """An engine failed to start (the following ones would fail alike)."""


def engine_memory_utilization(free_bytes: int, total_bytes: int, margin: float = 0.03) -> float:
    """The ``gpu_memory_utilization`` an engine next to a trainer may ask for: what is free now, less a
    margin for the engine process's own CUDA context."""
    return max(0.05, round(free_bytes / total_bytes - margin, 3))


def start_ipc_engine(spec, args, result: dict, name: str, k: int, method: str):
    """One engine of the production update path (``cpu.vllm_engine.build_engine``: the plugin's worker
    extension, engine core in its own process on CUDA), ``k`` speculative tokens drafted with ``method``,
    CUDA graphs for the sizes of ``--capture``; its build time goes to ``result["engine_build_s"][name]``."""
    from verl_mtp_cpu.vllm_engine import build_engine as build_rollout_engine

    mode = args.graph_modes[0]
    top = max(args.batches) * (k + 1)
    extra = {"max_num_batched_tokens": max(8192, top)}
    if k and method != "greedy":
        extra["speculative_config"] = {"draft_sample_method": method}
    if mode == "graphs":
        if args.capture == "lean":
            sizes = sorted({1, 2, 4, 8} | {n for n in args.batches} | {n * (k + 1) for n in args.batches})
        else:
            sizes = capture_sizes(top)
        extra.update(enforce_eager=False, compilation_config={"cudagraph_capture_sizes": sizes,
                                                              "max_cudagraph_capture_size": max(sizes)})
    if CUDA:
        # vLLM refuses to start unless the device's free memory is at least gpu_memory_utilization x total
        # (``v1/worker/utils.py: request_memory``), even with an explicit cache size; the colocated trainer
        # holds the rest, so ask for what is free now (the cache size is kv_cache_memory_bytes)
        free, total = torch.cuda.mem_get_info()
        extra["gpu_memory_utilization"] = engine_memory_utilization(free, total)
        result.setdefault("gpu_memory_at_engine_start", {})[name] = {
            "free_gib": free / 2**30, "total_gib": total / 2**30,
            "gpu_memory_utilization": extra["gpu_memory_utilization"]}
    t0 = time.time()
    try:
        eng = build_rollout_engine(
            spec, os.path.join(args.workdir, name), num_speculative_tokens=k, max_model_len=args.max_model_len,
            max_num_seqs=max(args.batches), kv_cache_mib=int(args.kv_cache_gib * 1024), in_process=not CUDA,
            drafter_sync="online", extra_engine_args=extra)
    except Exception as e:
        raise EngineStartError(f"engine {name} did not start: {type(e).__name__}: {e}") from e
    eng.bucket_mb = args.bucket_mb
    result.setdefault("engine_build_s", {})[name] = time.time() - t0
    log(f"engine {name} ({mode}, {method if k else 'no speculation'}) built in {time.time() - t0:.1f}s")
    return eng


def run_engine_plan(plan: list[tuple], one_engine, result: dict, deadline: float) -> None:
    """``one_engine(*entry)`` for each entry of ``plan`` in order, skipping an engine that the last one's wall time
    says would pass ``deadline``; a start failure stops the plan (the next engines would fail alike), another
    failure is recorded and the plan goes on (what was measured is kept)."""
    est_engine = None
    for entry in plan:
        what = "k=" + " ".join(str(x) for x in entry if x is not None)
        if est_engine is not None and time.time() + est_engine > deadline:
            log(f"budget: skipping engine {what}")
            result.setdefault("skipped", []).append(what)
            continue
        t0 = time.time()
        try:
            one_engine(*entry)
        except EngineStartError as e:  # the next engines would fail the same way: stop here, say why
            result.setdefault("errors", []).append(str(e))
            log(f"STOP: {e} (engine-core log above has the root cause)")
            break
        except Exception as e:  # noqa: BLE001 - keep what was measured, say what failed, go on
            result.setdefault("errors", []).append(f"{what}: {type(e).__name__}: {e}")
            log(f"engine {what} FAILED: {type(e).__name__}: {e}")
        est_engine = time.time() - t0


#: Step cost c_k of one speculative step over a plain decode step at the 30B-A3B shape (H200, vLLM 0.26, V2 runner,
#: CUDA graphs; median of 6 calls in two mirrored rounds): ``benchmarks/results/step_cost_h200_nano_rounds.json``,


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="verl's pure-Python dependencies for a GPU machine without verl")
    ap.add_argument("--make-deps-bundle", metavar="PATH", required=True, help="tarball to write")
    make_deps_bundle(ap.parse_args().make_deps_bundle)
