"""Acceptance under policy drift: online isolated MTP vs frozen MTP (and joint) under GRPO.

What it shows: how the speculative-decoding acceptance of the MTP drafter evolves while RL moves the
policy, for the plugin's modes, from one pretrained checkpoint, with identical seeds.

1. **Pretrain** a small Nemotron-3-shaped megatron-core ``HybridModel`` (Mamba ``M``, attention ``*``,
   MoE ``E`` main layers; MTP depth 1 ``*E``) on a synthetic language, MTP trained jointly (megatron's
   MTP loss, factor 0.3), and save the checkpoint (``--ckpt``). The language ("noisy progressions"):
   ``<bos> d0 d1 d2 d3`` (a clean arithmetic progression modulo ``num_digits`` with step 1..``max_step``)
   followed by a continuation in which each token is the next progression digit with probability
   ``1 - noise`` and one of ``num_fillers`` filler tokens (uniformly) otherwise; the progression keeps
   advancing under fillers, so both the policy and the MTP head need the context (step, position),
   not only the last token. Policy entropy ~0.5 nats per token: the MTP head can be accurate, so the
   pretrained expected acceptance is far above chance.
2. **RL**, arms from the same checkpoint with identical seeds, grouped by learning rate (``--groups
   "lr:arm,arm;lr:arm"``); the arms of a group step in lock-step in one process (a deadline stops them
   after the same step; several groups run as concurrent processes). GRPO with verl's
   ``compute_grpo_outcome_advantage`` and verl's registered ``vanilla`` policy loss
   (``get_policy_loss_fn("vanilla")`` with a ``verl.workers.config.ActorConfig``), one on-policy update
   per step, rollouts by plain batched autoregressive sampling (temperature 1) from the current policy.
   Reward: the fraction of response tokens that are fillers (a token class the pretrained policy emits
   ~10% of the time), so the policy drifts measurably away from the pretrained one.

   * ``frozen``: ``configure_transformer_config(cfg, "frozen")``, ``freeze_mtp`` before the optimizer;
     ``run_mtp_forward("frozen", phase)`` is False in every phase, so the MTP head stays at the checkpoint.
   * ``online``: ``configure_transformer_config(cfg, "online", mtp_loss_scaling_factor=0.3)``
     (``mtp_detach_heads=True``); the train forward runs MTP (``run_mtp_forward("online", "train")``)
     with ``labels=None`` and ``loss_mask`` = the token-coordinate response mask, so megatron's MTP
     loss is computed on the sampled response tokens and reaches the MTP parameters only.
   * ``joint``: ``configure_transformer_config(cfg, "joint", mtp_loss_scaling_factor=0.1)`` (the
     factor of ``recipes/nemotron3_super_mtp/config/grpo_joint.yaml``): the MTP loss also trains the trunk.
   * diagnostics (same policy trajectory as ``online``): ``online*K`` gives the MTP parameters K times the
     policy's learning rate; ``online+refit`` adds a capacity probe every ``--refit-every`` steps (a copy
     of the MTP head refit to the current policy, :meth:`Arm.refit_probe`), to tell a tracking lag from
     a ceiling of the head itself.

   Gradient clipping is applied separately to the base (non-MTP) and the MTP parameters, so in the
   online arm the MTP gradient cannot change the base update through a shared clip norm: frozen and
   online then follow the same policy trajectory (up to GPU nondeterminism), and the frozen arm is the
   online arm's counterfactual drafter.
3. **Measured per step, the same way for every arm**: on a fixed held-out prompt batch, fresh samples
   from the CURRENT policy (drawn in the same batched sampling call as the rollout, never trained on;
   inverse-CDF sampling with the same uniforms for the held-out rows at every step, i.e. common random
   numbers, so step-to-step changes reflect the policy and not the draw);
   one forward of the current model with the MTP block run (``hybrid_forward(..., run_mtp_forward=True)``,
   eval, no grad) with an :class:`~verl_mtp_plugin.acceptance.AcceptanceProbe` attached, estimating over
   every counted response position: expected acceptance rate (speculative-sampling overlap
   ``sum_v min(p_main, q_mtp)``, temperature 1), greedy agreement, argmax-draft acceptance; the implied
   mean accepted length ``E_k`` and speedup ``E_k / (1 + k c)`` for ``k = 1, 2, 3`` (``--draft-cost c``);
   KL(current || start policy) and entropy per response token (exact, over the vocabulary, at the
   held-out sampled positions); held-out reward (filler rate); "on-language" rate (fraction of response
   tokens that are the right progression digit or a filler); the acceptance a uniform drafter would get
   (chance level). Also logged: the rollout reward, the
   policy loss, megatron's MTP loss / top-1 (online, joint) and the probe's in-trainer estimate on the
   train forward (online, joint), what the verl engine logs as ``actor/mtp_expected_accept_rate``.

Outputs (``--out``): ``acceptance_drift_<tag>.jsonl`` (one row per pretrain log point / arm and step),
``acceptance_drift_<tag>_meta.json`` (configuration, environment, summary vs the goal) and, with
``--plot`` (or ``--plot-only``, from an existing JSONL, which also writes ``_summary.json``),
``acceptance_drift_<tag>.png``. Without ``--reuse-ckpt`` the checkpoint is always regenerated.

Commands::

    # CPU check (tiny sizes, a few steps; megatron's CPU Mamba reference, no GPU):
    .venv/bin/python benchmarks/acceptance_drift.py --device cpu --tiny --out /tmp/drift --plot
    # H200 (exact commands with the environment set-up: benchmarks/RESULTS.md, "Acceptance under policy
    # drift"):
    python3 benchmarks/acceptance_drift.py --device cuda --mamba-impl torch --out $OUT --tag h200 \
        --budget 95 --pretrain-share 0.4 --pretrain-steps 200 --pretrain-log-every 50 \
        --groups "2e-4:frozen,online,joint,online+refit" --refit-every 5 --refit-steps 30 \
        --refit-batch 256 --ckpt /tmp/ckpt.pt
    # plot + summary from the returned JSONL:
    .venv/bin/python benchmarks/acceptance_drift.py --plot-only --out benchmarks/results --tag h200 \
        --groups "2e-4:frozen,online,joint,online+refit"

On a GPU machine without ray (its wheel is larger than what a device call may carry) the verl
import path registers a placeholder ``ray`` module; see :func:`import_verl_algorithms`.
``--make-deps-bundle PATH`` writes the tarball of the pure-Python verl dependencies that the GPU
command unpacks (built from this machine's ``.venv``).
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
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, os.path.join(ROOT, "cpu_runtime")):  # the product and its CPU runtime (verl_mtp_cpu)
    if _p not in sys.path:
        sys.path.insert(0, _p)

T0 = time.time()
ARMS = ("frozen", "online", "joint")
#: ``online*K``: online with the MTP parameters' learning rate K times the policy's (a separate optimizer
#: param group); used to tell a tracking lag from a capacity limit.


#: ``online+refit``: online, plus every ``--refit-every`` steps a capacity probe on a copy of the MTP
#: weights (see :meth:`Arm.refit_probe`); the arm's own training is unchanged.


def _parse_label(label: str) -> tuple[str, float, bool]:
    base, plus, extra = label.partition("+")
    mode, _, mult = base.partition("*")
    ok = mode in ARMS and (not mult or (mode == "online" and mult.replace(".", "", 1).isdigit()))
    ok = ok and (not plus or (mode == "online" and extra == "refit"))
    if not ok:
        raise SystemExit(f"bad arm {label!r}: use one of {', '.join(ARMS)}, online*K (K a number) or online+refit")
    return mode, float(mult or 1), bool(plus)


def arm_mode(label: str) -> str:
    """``"online*3"`` / ``"online+refit"`` -> ``"online"``; validates the label."""
    return _parse_label(label)[0]


def arm_order(label: str) -> tuple:
    mode, mult, refit = _parse_label(label)
    return (ARMS.index(mode), mult, refit)

#: mtp_loss_scaling_factor per trained mode: online as recipes/nemotron3_super_mtp/config/super_mtp_common.yaml,
#: joint as recipes/nemotron3_super_mtp/config/grpo_joint.yaml.
MTP_FACTOR = {"online": 0.3, "joint": 0.1}
PRETRAIN_MTP_FACTOR = 0.3
KS = (1, 2, 3)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {PREFIX}{msg}", flush=True)


# --------------------------------------------------------------------------- environment


def import_verl_algorithms():
    """verl's GRPO advantage, policy-loss registry and ``ActorConfig``.

    verl 0.9.1 imports ``ray`` at module level on this import path (``verl.protocol`` annotates
    ``futures: list[ray.ObjectRef]``), but none of the functions used here touch ray. Where ray is not
    installed (the GPU machine: its wheel alone exceeds what a device call may carry), a placeholder
    module named ``ray`` holding only ``ObjectRef`` is registered first; any other use of it fails
    with AttributeError. Where ray is installed nothing is registered.

    Returns:
        tuple: ``(compute_grpo_outcome_advantage, get_policy_loss_fn, ActorConfig)``.
    """
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
    """Noisy progressions. Token ids: 0 pad, 1 bos, ``2 .. 2+D-1`` digits, then ``F`` filler tokens.

    A sequence is ``<bos>`` + ``prompt_digits`` clean progression digits ``v_0, v_0+s, ...`` (mod D,
    step ``s`` in 1..``max_step``) + ``response_len`` continuation tokens: token ``t`` is the digit
    ``v_t`` with probability ``1 - noise`` and a uniformly chosen filler otherwise (the hidden
    progression advances either way).
    """

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

    def on_language(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """``[n]`` fraction of response tokens that are the right progression digit or a filler."""
        a, b = prompts[:, 1] - 2, prompts[:, 2] - 2
        step = (b - a) % self.num_digits
        t = torch.arange(self.prompt_digits, self.prompt_digits + self.response_len, device=prompts.device)
        right = (a[:, None] + step[:, None] * t[None, :]) % self.num_digits + 2
        return ((responses == right) | self.is_filler(responses)).float().mean(dim=1)


# --------------------------------------------------------------------------- model


def model_spec(tiny: bool):
    from verl_mtp_plugin.testing import TinyHybridSpec

    if tiny:
        return TinyHybridSpec(
            pattern="ME*E/*E", vocab_size=32, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
            num_query_groups=2, num_experts=4, moe_topk=2, moe_ffn_hidden_size=64,
            moe_shared_expert_intermediate_size=64, moe_latent_size=None, mamba_state_dim=16, mamba_head_dim=16,
            mamba_num_groups=1, max_sequence_length=64, params_dtype=torch.float32,
            mtp_loss_scaling_factor=PRETRAIN_MTP_FACTOR,
        )
    # Nemotron-3-like alternation: 3 Mamba, 4 MoE, 1 attention main layers; MTP depth 1 = attention + MoE.
    return TinyHybridSpec(
        pattern="MEME*EME/*E", vocab_size=32, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
        num_query_groups=2, num_experts=8, moe_topk=2, moe_ffn_hidden_size=256,
        moe_shared_expert_intermediate_size=256, moe_latent_size=None, mamba_state_dim=32, mamba_head_dim=32,
        mamba_num_groups=2, max_sequence_length=64, params_dtype=torch.float32,
        mtp_loss_scaling_factor=PRETRAIN_MTP_FACTOR,
    )


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


# --------------------------------------------------------------------------- pretraining


def pretrain(model, lang: Language, fwd: Fwd, args, deadline: float, rows: list) -> dict:
    """Joint pretraining (main next-token loss + megatron's MTP loss, factor 0.3, MTP trains the trunk)."""
    from verl_mtp_plugin.control import configure_transformer_config
    from verl_mtp_plugin.metrics import collect_mtp_metrics, reset_mtp_metrics

    configure_transformer_config(model.config, "joint", mtp_loss_scaling_factor=PRETRAIN_MTP_FACTOR)
    gen = torch.Generator().manual_seed(args.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, betas=(0.9, 0.95), weight_decay=0.01)
    steps, warm = args.pretrain_steps, max(1, args.pretrain_steps // 20)

    def lr_at(i):
        if i < warm:
            return args.pretrain_lr * (i + 1) / warm
        frac = (i - warm) / max(1, steps - warm)
        return args.pretrain_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    model.train()
    reset_mtp_metrics()
    done, t_start, last = 0, time.time(), {}
    for i in range(steps):
        if time.time() > deadline:
            log(f"pretrain: deadline reached after {i} of {steps} steps")
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(i)
        ids = lang.sample(args.pretrain_batch, gen).to(fwd.device)
        tok_mask = torch.zeros(ids.shape, device=fwd.device)
        tok_mask[:, 2:] = 1.0  # targets: every token after the first digit (token coordinates)
        opt.zero_grad(set_to_none=True)
        logits = fwd(model, ids, run_mtp=True, loss_mask=tok_mask)
        lp = token_logprobs(logits, ids)
        loss = -(lp * tok_mask[:, 1:]).sum() / tok_mask[:, 1:].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done = i + 1
        if done % args.pretrain_log_every == 0 or done == steps:
            m = collect_mtp_metrics(num_microbatches=1)
            last = {"type": "pretrain", "step": done, "loss": float(loss.detach()),
                    "mtp_loss": m.get("mtp_losses/mtp_1_loss", math.nan),
                    "mtp_top1": m.get("mtp_accuracy/mtp_1_top1", math.nan), "lr": lr_at(i),
                    "elapsed_s": time.time() - t_start}
            rows.append(last)
            log(f"pretrain {done}/{steps} loss {last['loss']:.4f} mtp_loss {last['mtp_loss']:.4f} "
                f"mtp_top1 {last['mtp_top1']:.3f}")
        else:
            reset_mtp_metrics()
    # entropy floor of the language on the response positions (what a perfect policy reaches)
    h = -(1 - lang.noise) * math.log(1 - lang.noise) - lang.noise * math.log(lang.noise / lang.num_fillers)
    return {"pretrain_steps_done": done, "pretrain_seconds": time.time() - t_start, "final": last,
            "language_entropy_nats": h}


# --------------------------------------------------------------------------- RL arms


@torch.no_grad()
def sample(model, mode: str, fwd: Fwd, prompts: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Plain autoregressive sampling at temperature 1 by inverse CDF (full recompute per token).

    Args:
        prompts (Tensor): ``[n, p]`` prompt ids on the model's device.
        uniforms (Tensor): ``[n, L]`` U(0,1) numbers on the same device; row ``i``'s token ``j`` is the
            first token whose cumulative probability reaches ``uniforms[i, j]``, an exact sample from the
            current policy. Reusing the same numbers for the held-out rows at every step (common random
            numbers) makes step-to-step differences reflect the policy, not the draw.

    Returns:
        Tensor: ``[n, p + L]``.
    """
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


class Arm:
    """One RL arm (mode) from the checkpoint: model, optimizer, its own (identically seeded) generators."""

    def __init__(self, label, spec, state, lang, fwd, args, algos):
        from verl_mtp_plugin.acceptance import AcceptanceProbe
        from verl_mtp_plugin.control import configure_transformer_config, freeze_mtp, validate_model_for_mode
        from verl_mtp_plugin.policy import MTPMode

        mode = arm_mode(label)
        self.label, self.mode, self.lang, self.fwd, self.args = label, mode, lang, fwd, args
        _, self.mtp_lr_mult, self.refit = _parse_label(label)
        self.grpo, get_policy_loss_fn, ActorConfig = algos
        self.model = build_model(spec, fwd.device)
        self.model.load_state_dict(state, strict=True)
        configure_transformer_config(self.model.config, mode, mtp_loss_scaling_factor=MTP_FACTOR.get(mode))
        self.frozen_names = freeze_mtp(self.model) if mode == "frozen" else []
        validate_model_for_mode(self.model, MTPMode.parse(mode))
        self.mtp_params = [p for n, p in self.model.named_parameters() if n.startswith("mtp.") and p.requires_grad]
        self.base_params = [p for n, p in self.model.named_parameters() if not n.startswith("mtp.")]
        groups = [{"params": self.base_params, "lr": args.rl_lr}]
        if self.mtp_params:
            groups.append({"params": self.mtp_params, "lr": args.rl_lr * self.mtp_lr_mult})
        self.opt = torch.optim.AdamW(groups, lr=args.rl_lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.actor_cfg = ActorConfig(strategy="megatron", ppo_mini_batch_size=args.prompts_per_step,
                                     ppo_micro_batch_size_per_gpu=args.prompts_per_step, rollout_n=args.group_size,
                                     clip_ratio=0.2)
        self.policy_loss = get_policy_loss_fn("vanilla")
        self.probe = AcceptanceProbe(self.model, temperature=1.0)
        self.sample_gen = torch.Generator().manual_seed(args.seed + 100)
        self.prompt_gen = torch.Generator().manual_seed(args.seed + 200)
        self.mtp_snapshot = {n: p.detach().clone() for n, p in self.model.named_parameters() if n.startswith("mtp.")}

    def mtp_drift(self) -> float:
        """Relative L2 change of the MTP parameters since the checkpoint."""
        num = den = 0.0
        for n, p in self.model.named_parameters():
            if n in self.mtp_snapshot:
                num += float((p.detach() - self.mtp_snapshot[n]).float().pow(2).sum())
                den += float(self.mtp_snapshot[n].float().pow(2).sum())
        return math.sqrt(num / max(den, 1e-30))

    @torch.no_grad()
    def evaluate(self, seq_eval: torch.Tensor, ref_model) -> dict:
        """Metrics of the current policy/drafter on fresh held-out samples ``seq_eval`` ``[n, seq_len]``."""
        from verl_mtp_plugin.acceptance import expected_accept_length, expected_speedup
        from verl_mtp_plugin.metrics import reset_mtp_metrics

        lang, fwd = self.lang, self.fwd
        P, L = lang.prompt_len, lang.response_len
        self.model.eval()
        logits = fwd(self.model, seq_eval, run_mtp=True)  # MTP block run for the probe (measurement only)
        tok_resp = torch.zeros(seq_eval.shape, device=fwd.device)
        tok_resp[:, P:] = 1.0
        acc = self.probe.estimate(logits, tok_resp, max_positions=10**7)
        reset_mtp_metrics()
        ref_logits = fwd(ref_model, seq_eval, run_mtp=False)
        self.model.train()
        sl = slice(P - 1, P - 1 + L)  # positions predicting the response tokens
        lp = torch.log_softmax(logits[:, sl].float(), dim=-1)
        lq = torch.log_softmax(ref_logits[:, sl].float(), dim=-1)
        p = lp.exp()
        kl = (p * (lp - lq)).sum(-1).mean()
        # chance level: a drafter proposing from the uniform distribution over the language's tokens
        n_tok = 2 + lang.num_digits + lang.num_fillers
        chance = p[..., :n_tok].clamp(max=1.0 / n_tok).sum(-1)[:, 1:].mean()
        ent = -(p * lp).sum(-1).mean()
        resp, prompts = seq_eval[:, P:], seq_eval[:, :P]
        alpha = acc["mtp_expected_accept_rate"]
        row = {
            "expected_accept_rate": alpha,
            "greedy_accept_rate": acc["mtp_greedy_accept_rate"],
            "argmax_draft_accept_rate": acc["mtp_argmax_draft_accept_rate"],
            "accept_positions": acc["mtp_accept_num_positions"],
            "accept_uniform_drafter": float(chance),
            "kl_to_start": float(kl),
            "entropy": float(ent),
            "heldout_reward": float(lang.reward(resp).mean()),
            "heldout_on_language": float(lang.on_language(prompts, resp).mean()),
        }
        for k in KS:
            row[f"accept_length_k{k}"] = expected_accept_length(alpha, k)
            row[f"speedup_k{k}"] = expected_speedup(alpha, k, self.args.draft_cost)
        return row

    def refit_probe(self, seq_eval: torch.Tensor, step: int) -> dict:
        """Capacity probe: how much acceptance could the MTP head reach for the CURRENT policy and trunk?

        Samples ``--refit-batch`` sequences from the current policy (fresh prompts), trains a copy of the
        MTP weights alone on them (megatron's MTP loss, online isolation, its own Adam at ``--refit-lr``,
        ``--refit-steps`` steps of ``--refit-minibatch`` sequences), measures the expected acceptance on
        the held-out sequences ``seq_eval``, then restores the MTP weights. The arm's optimizer, trunk
        and sampling generators are untouched. A refit value well above the arm's own value means the
        online head lags the policy; a value close to it means the head (or the trunk features it reads)
        cannot represent the drifted policy's next-next-token distribution better.
        """
        from verl_mtp_plugin.metrics import collect_mtp_metrics, reset_mtp_metrics

        args, lang, fwd = self.args, self.lang, self.fwd
        t0 = time.time()
        P = lang.prompt_len
        g = torch.Generator().manual_seed(args.seed + 500 + step)
        prompts = lang.prompts(args.refit_batch, g).to(fwd.device)
        u = torch.rand(args.refit_batch, lang.response_len, generator=g).to(fwd.device)
        data = sample(self.model, self.mode, fwd, prompts, u)
        named = [(n, p) for n, p in self.model.named_parameters() if n.startswith("mtp.")]
        saved = {n: p.detach().clone() for n, p in named}
        opt = torch.optim.AdamW([p for _, p in named], lr=args.refit_lr, betas=(0.9, 0.99), weight_decay=0.0)
        tok_resp = torch.zeros(args.refit_minibatch, data.shape[1], device=fwd.device)
        tok_resp[:, P:] = 1.0
        self.model.train()
        loss = math.nan
        for i in range(args.refit_steps):
            idx = torch.randint(0, data.shape[0], (args.refit_minibatch,), generator=g).to(fwd.device)
            reset_mtp_metrics()
            logits = fwd(self.model, data[idx], run_mtp=True, loss_mask=tok_resp)
            (logits.float().sum() * 0.0).backward()  # only megatron's MTP loss carries gradient
            opt.step()
            self.model.zero_grad(set_to_none=True)
            loss = collect_mtp_metrics(num_microbatches=1).get("mtp_losses/mtp_1_loss", math.nan)
        self.model.eval()
        with torch.no_grad():
            tok_eval = torch.zeros(seq_eval.shape, device=fwd.device)
            tok_eval[:, P:] = 1.0
            logits = fwd(self.model, seq_eval, run_mtp=True)
            acc = self.probe.estimate(logits, tok_eval, max_positions=10**7)
            reset_mtp_metrics()
            for n, p in named:
                p.copy_(saved[n])
        self.model.train()
        return {"refit_expected_accept_rate": acc["mtp_expected_accept_rate"],
                "refit_greedy_accept_rate": acc["mtp_greedy_accept_rate"], "refit_mtp_loss": loss,
                "refit_seconds": time.time() - t0}

    def update(self, seq: torch.Tensor) -> dict:
        """One GRPO step on the rollout batch ``seq`` ``[n_prompts * G, seq_len]``."""
        from verl_mtp_plugin.metrics import collect_mtp_metrics, reset_mtp_metrics
        from verl_mtp_plugin.policy import Phase, run_mtp_forward

        lang, fwd, args = self.lang, self.fwd, self.args
        P, L = lang.prompt_len, lang.response_len
        b = seq.shape[0]
        sl = slice(P - 1, P - 1 + L)
        reward = lang.reward(seq[:, P:])
        tok_resp = torch.zeros(seq.shape, device=fwd.device)
        tok_resp[:, P:] = 1.0  # token coordinates: 1 on the sampled response tokens
        resp_mask = torch.ones(b, L, device=fwd.device)
        with torch.no_grad():  # logprob phase
            self.model.eval()
            old = fwd(self.model, seq, run_mtp=run_mtp_forward(self.mode, Phase.LOGPROB), loss_mask=tok_resp)
            old_lp = token_logprobs(old, seq)[:, sl]
            self.model.train()
        token_rewards = torch.zeros(b, L)
        token_rewards[:, -1] = reward.cpu()
        index = torch.arange(args.prompts_per_step).repeat_interleave(args.group_size).numpy()
        adv, _ = self.grpo(token_rewards, resp_mask.cpu(), index)
        adv = adv.to(fwd.device)
        run_mtp = run_mtp_forward(self.mode, Phase.TRAIN)
        reset_mtp_metrics()
        self.opt.zero_grad(set_to_none=True)
        logits = fwd(self.model, seq, run_mtp=run_mtp, loss_mask=tok_resp)  # labels=None: logits + MTP loss
        train_acc = self.probe.estimate(logits.detach(), tok_resp, max_positions=10**7) if run_mtp else {}
        lp = token_logprobs(logits, seq)[:, sl]
        pg_loss = self.policy_loss(old_lp, lp, adv, resp_mask, "token-mean", config=self.actor_cfg)[0]
        pg_loss.backward()
        gn_base = float(torch.nn.utils.clip_grad_norm_(self.base_params, args.clip_grad))
        gn_mtp = float(torch.nn.utils.clip_grad_norm_(self.mtp_params, args.clip_grad)) if self.mtp_params else 0.0
        m = collect_mtp_metrics(num_microbatches=1)
        if bool(m) is not run_mtp:
            raise RuntimeError(f"{self.mode}: MTP loss {'missing' if run_mtp else 'present'} in the train phase")
        self.opt.step()
        return {
            "reward": float(reward.mean()),
            "policy_loss": float(pg_loss.detach()),
            "grad_norm_base": gn_base,
            "grad_norm_mtp": gn_mtp,
            "mtp_loss": m.get("mtp_losses/mtp_1_loss", math.nan),
            "mtp_top1": m.get("mtp_accuracy/mtp_1_top1", math.nan),
            "train_expected_accept_rate": train_acc.get("mtp_expected_accept_rate", math.nan),
        }


def heldout_batch(args, lang: Language, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed held-out prompts ``[n, prompt_len]`` and their sampling uniforms ``[n, L]``."""
    prompts = lang.prompts(args.heldout_size, torch.Generator().manual_seed(args.seed + 300)).to(device)
    u = torch.rand(args.heldout_size, lang.response_len, generator=torch.Generator().manual_seed(args.seed + 400))
    return prompts, u.to(device)


def run_rl(arms: list[Arm], ref_model, lang: Language, fwd: Fwd, args, deadline: float, lr: float, out_path: str):
    """All arms in lock-step: at step ``k`` each arm samples its rollout batch and the held-out batch
    from its current policy (one batched call), is evaluated on the held-out part, then updated on the
    rollout part. A last evaluation-only round measures the final policy."""
    heldout, heldout_u = heldout_batch(args, lang, fwd.device)
    n_train = args.prompts_per_step * args.group_size

    def one(arm: Arm, step: int, update: bool) -> dict:
        prompts = lang.prompts(args.prompts_per_step, arm.prompt_gen).repeat_interleave(args.group_size, dim=0)
        u = torch.rand(n_train, lang.response_len, generator=arm.sample_gen).to(fwd.device)
        seq = sample(arm.model, arm.mode, fwd, torch.cat([prompts.to(fwd.device), heldout]), torch.cat([u, heldout_u]))
        row = {"type": "rl", "arm": arm.label, "mode": arm.mode, "lr": lr, "step": step}
        row.update(arm.evaluate(seq[n_train:], ref_model))
        if arm.refit and step % args.refit_every == 0:
            row.update(arm.refit_probe(seq[n_train:], step))
        if update:
            row.update(arm.update(seq[:n_train]))
        row["mtp_param_rel_change"] = arm.mtp_drift()
        with open(out_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        return row

    t_step: list[float] = []
    updates = 0
    for step in range(args.rl_steps + 1):
        t0 = time.time()
        final = step == args.rl_steps or (bool(t_step) and time.time() + 1.5 * max(t_step[-3:]) > deadline)
        cur = [one(arm, step, update=not final) for arm in arms]
        t_step.append(time.time() - t0)
        log(f"rl step {step:3d} ({t_step[-1]:.1f}s) " + " | ".join(
            f"{r['arm']}: acc {r['expected_accept_rate']:.3f} greedy {r['greedy_accept_rate']:.3f} "
            f"KL {r['kl_to_start']:.3f} R {r['heldout_reward']:.3f} H {r['entropy']:.2f}" for r in cur))
        if final:
            if step < args.rl_steps:
                log(f"rl: deadline: stopped after {step} of {args.rl_steps} updates (all arms)")
            break
        updates = step + 1
    return {"rl_updates_done": updates, "rl_seconds_per_step_median": sorted(t_step)[len(t_step) // 2]}


# --------------------------------------------------------------------------- summary and plot


def _series(rows: list) -> dict:
    """``{(lr, arm): [rows sorted by step]}`` of the RL rows."""
    out: dict = {}
    for r in rows:
        if r.get("type") == "rl":
            out.setdefault((r["lr"], r["arm"]), []).append(r)
    for v in out.values():
        v.sort(key=lambda r: r["step"])
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0], arm_order(kv[0][1]))))


def summarize(rows: list, tail_n: int) -> dict:
    """Per ``(lr, arm)``: start / end (mean of the last ``tail_n`` evaluations) / worst values, and the
    goal checks per learning-rate group."""
    out: dict = {}
    for (lr, arm), rs in _series(rows).items():
        tail = rs[-min(tail_n, len(rs)):]

        def end(key):
            return sum(r[key] for r in tail) / len(tail)

        a0 = rs[0]["expected_accept_rate"]
        worst = min(rs, key=lambda r: r["expected_accept_rate"])
        s = {
            "steps": rs[-1]["step"],
            "accept_start": a0,
            "accept_end": end("expected_accept_rate"),
            "accept_rel_change_end": end("expected_accept_rate") / a0 - 1,
            "accept_final": rs[-1]["expected_accept_rate"],
            "accept_rel_change_final": rs[-1]["expected_accept_rate"] / a0 - 1,
            "accept_min": worst["expected_accept_rate"],
            "accept_min_step": worst["step"],
            "accept_rel_change_min": worst["expected_accept_rate"] / a0 - 1,
            "greedy_start": rs[0]["greedy_accept_rate"],
            "greedy_end": end("greedy_accept_rate"),
            "kl_end": rs[-1]["kl_to_start"],
            "kl_at_accept_min": worst["kl_to_start"],
            "heldout_reward_start": rs[0]["heldout_reward"],
            "heldout_reward_end": rs[-1]["heldout_reward"],
            "entropy_start": rs[0]["entropy"],
            "entropy_end": rs[-1]["entropy"],
            "on_language_end": rs[-1]["heldout_on_language"],
        }
        for k in KS:
            s[f"accept_length_k{k}_start"] = rs[0][f"accept_length_k{k}"]
            s[f"accept_length_k{k}_end"] = end(f"accept_length_k{k}")
            s[f"speedup_k{k}_start"] = rs[0][f"speedup_k{k}"]
            s[f"speedup_k{k}_end"] = end(f"speedup_k{k}")
            s[f"accept_length_k{k}_final"] = rs[-1][f"accept_length_k{k}"]
            s[f"speedup_k{k}_final"] = rs[-1][f"speedup_k{k}"]
        refit = [r for r in rs if "refit_expected_accept_rate" in r]
        if refit:
            s["refit_probe"] = {r["step"]: {"refit": r["refit_expected_accept_rate"], "arm": r["expected_accept_rate"]}
                                for r in refit}
        out[f"lr={lr:g}/{arm}"] = s
    goal = {}
    for lr in sorted({k[0] for k in _series(rows)}):
        on, fr = out.get(f"lr={lr:g}/online"), out.get(f"lr={lr:g}/frozen")
        g = {}
        if on:
            g["online_end_within_5pct"] = abs(on["accept_rel_change_end"]) <= 0.05
            g["online_every_step_within_5pct"] = on["accept_rel_change_min"] >= -0.05
        if fr:
            g["frozen_decays_over_5pct"] = fr["accept_rel_change_end"] < -0.05 or fr["accept_rel_change_min"] < -0.05
        goal[f"lr={lr:g}"] = g
    out["goal"] = goal
    out["summary_tail_evaluations"] = tail_n
    return out


COLORS = {"frozen": "tab:red", "online": "tab:blue", "joint": "tab:green"}


def _color(label: str) -> str:
    if "+refit" in label:
        return "tab:cyan"
    return "tab:purple" if "*" in label else COLORS[label]


def plot(rows: list, path: str, draft_cost: float, main_lr: float | None = None) -> str | None:
    """Curves: the main learning-rate group in detail, all groups for acceptance vs step and vs KL."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return None
    series = _series(rows)
    lrs = sorted({k[0] for k in series})
    if main_lr is None or main_lr not in lrs:
        main_lr = lrs[len(lrs) // 2]
    styles = dict(zip(sorted(lrs, key=lambda x: (x != main_lr, x)), ("-", "--", ":", "-.")))
    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5))
    main_panels = [
        (axes[0, 0], "expected_accept_rate", f"expected acceptance (overlap), lr={main_lr:g}"),
        (axes[0, 1], "greedy_accept_rate", f"greedy agreement, lr={main_lr:g}"),
        (axes[0, 2], "heldout_reward", f"reward = filler rate (held-out), lr={main_lr:g}"),
        (axes[1, 0], "entropy", f"policy entropy per token (nats), lr={main_lr:g}"),
    ]
    for ax, key, title in main_panels:
        for (lr, arm), rs in series.items():
            if lr == main_lr:
                ax.plot([r["step"] for r in rs], [r[key] for r in rs], color=_color(arm), label=arm)
                refit = [r for r in rs if key == "expected_accept_rate" and "refit_expected_accept_rate" in r]
                if refit:
                    ax.plot([r["step"] for r in refit], [r["refit_expected_accept_rate"] for r in refit], "x",
                            color=_color(arm), ms=8, label="MTP refit to current policy (capacity probe)")
        if key == "expected_accept_rate":
            for (lr, arm), rs in series.items():
                if lr == main_lr and arm == "online":
                    a0 = rs[0][key]
                    ax.axhspan(0.95 * a0, 1.05 * a0, color="tab:blue", alpha=0.1, label="online start ±5%")
        ax.set_title(title, fontsize=10)
    ax = axes[1, 1]
    for (lr, arm), rs in series.items():
        if lr == main_lr and arm in ARMS:
            for k, ls in zip(KS, ("-", "--", ":")):
                ax.plot([r["step"] for r in rs], [r[f"speedup_k{k}"] for r in rs], ls, color=_color(arm),
                        label=f"{arm} k={k}")
    ax.set_title(f"expected speedup E_k/(1+k c), c={draft_cost}, lr={main_lr:g}", fontsize=10)
    for ax, xkey, title in ((axes[0, 3], "step", "expected acceptance, all lr groups"),
                            (axes[1, 3], "kl_to_start", "expected acceptance vs KL to start, all lr groups")):
        for (lr, arm), rs in series.items():
            ax.plot([r[xkey] for r in rs], [r["expected_accept_rate"] for r in rs], styles[lr], color=_color(arm),
                    label=f"{arm} lr={lr:g}")
        ax.set_title(title, fontsize=10)
        if xkey == "kl_to_start":
            ax.set_xscale("symlog", linthresh=0.01)
            ax.set_xlabel("KL(current || start) per response token (nats)")
    ax = axes[1, 2]
    for (lr, arm), rs in series.items():
        ax.plot([r["step"] for r in rs], [r["kl_to_start"] for r in rs], styles[lr], color=_color(arm),
                label=f"{arm} lr={lr:g}")
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_title("KL(current || start policy) per response token, all lr groups", fontsize=10)
    for ax in axes.flat:
        if not ax.get_xlabel():
            ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("MTP drafter acceptance under policy drift (GRPO toward filler tokens): frozen vs online vs joint MTP")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- main


def environment(device: torch.device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node(),
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    from importlib.metadata import version

    for pkg in ("megatron-core", "verl", "mamba_ssm", "triton", "tensordict", "transformers"):
        try:
            env[pkg] = version(pkg)
        except Exception:
            env[pkg] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        from verl_mtp_cpu.mamba_triton import mamba_kernels_active

        env["mamba_triton_kernels"] = mamba_kernels_active()
        env["mamba_impl"] = MAMBA_IMPL
    return env


def parse_groups(text: str) -> list[tuple[float, list[str]]]:
    """``"1e-4:frozen,online,joint;3e-4:frozen,online"`` -> ``[(1e-4, [...]), (3e-4, [...])]``."""
    groups = []
    for part in text.split(";"):
        if not part.strip():
            continue
        lr, _, arms = part.partition(":")
        names = [a.strip() for a in arms.split(",") if a.strip()]
        if not names:
            raise SystemExit(f"--groups: no arms in {part!r}")
        for a in names:
            arm_mode(a)
        groups.append((float(lr), names))
    if not groups:
        raise SystemExit("--groups: no group given")
    return groups


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model and run (for checking the script)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default=None, help="file tag (default: tiny / gpu)")
    ap.add_argument("--groups", default=None,
                    help="RL learning-rate groups 'lr:arm,arm;lr:arm' (arms of a group run in lock-step in one "
                         "process; the first group is the main one)")
    ap.add_argument("--parallel", action=argparse.BooleanOptionalAction, default=None,
                    help="run the groups as concurrent processes (default: on CUDA)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--mamba-impl", default="triton", choices=("triton", "torch"),
                    help="CUDA: mamba_ssm's Triton kernels, or the plugin's plain-torch reference (no compile)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole script; pretraining and RL stop early "
                         "(a group's arms at the same step)")
    ap.add_argument("--pretrain-share", type=float, default=0.45, help="share of --budget pretraining may use")
    ap.add_argument("--ckpt", default=None, help="checkpoint path (default: <out>/acceptance_drift_<tag>_ckpt.pt)")
    ap.add_argument("--reuse-ckpt", action="store_true", help="load --ckpt if it exists instead of pretraining")
    ap.add_argument("--pretrain-steps", type=int, default=None)
    ap.add_argument("--pretrain-batch", type=int, default=None)
    ap.add_argument("--pretrain-lr", type=float, default=None)
    ap.add_argument("--pretrain-log-every", type=int, default=None)
    ap.add_argument("--rl-steps", type=int, default=None, help="most RL updates per arm")
    ap.add_argument("--prompts-per-step", type=int, default=None)
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--heldout-size", type=int, default=None)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--refit-every", type=int, default=10, help="online+refit arms: probe every N steps")
    ap.add_argument("--refit-steps", type=int, default=80)
    ap.add_argument("--refit-batch", type=int, default=1024)
    ap.add_argument("--refit-minibatch", type=int, default=128)
    ap.add_argument("--refit-lr", type=float, default=3e-4)
    ap.add_argument("--draft-cost", type=float, default=0.05,
                    help="cost c of one MTP draft step relative to one target forward, for E_k/(1+k c)")
    ap.add_argument("--summary-tail", type=int, default=5, help="end value = mean of the last N evaluations")
    ap.add_argument("--plot", action="store_true", help="also write the PNG (needs matplotlib)")
    ap.add_argument("--plot-only", action="store_true", help="only plot <out>/acceptance_drift_<tag>.jsonl")
    ap.add_argument("--make-deps-bundle", default=None, metavar="PATH",
                    help="write the tarball of verl's pure-Python dependencies for the GPU machine and exit")
    # internal: one RL group in a child process
    ap.add_argument("--phase", default="all", choices=("all", "rl"), help=argparse.SUPPRESS)
    ap.add_argument("--group-spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline-at", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    big = dict(pretrain_steps=2000, pretrain_batch=128, pretrain_lr=1e-3, pretrain_log_every=100, rl_steps=150,
               prompts_per_step=16, group_size=8, heldout_size=256,
               groups="1e-4:frozen,online,joint;1e-4:online*3,online+refit;3e-5:frozen,online;3e-4:frozen,online")
    tiny = dict(pretrain_steps=300, pretrain_batch=32, pretrain_lr=3e-3, pretrain_log_every=50, rl_steps=8,
                prompts_per_step=4, group_size=4, heldout_size=16, groups="3e-4:frozen,online,joint")
    for k, v in (tiny if args.tiny else big).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.tag is None:
        args.tag = "tiny" if args.tiny else "gpu"
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    if args.parallel is None:
        args.parallel = args.device == "cuda"
    parse_groups(args.groups)
    return args


PREFIX = ""


def _setup(args):
    """Mamba kernels (GPU), verl (fail fast), megatron parallel state; the language, spec and forward helper."""
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    global MAMBA_IMPL
    MAMBA_IMPL = args.mamba_impl
    if device.type == "cuda" and args.mamba_impl == "torch":
        use_torch_mamba_reference()
    elif device.type == "cuda":
        from verl_mtp_cpu.mamba_triton import install_mamba_ssm_triton

        if not install_mamba_ssm_triton():
            raise SystemExit("mamba_ssm is not importable: install the pure-Python mamba_ssm wheel (.whl)")
    # Import the plugin before verl: imported after verl, verl_mtp_plugin registers its engine with verl,
    # which needs verl's whole Megatron engine stack (datasets, ...), absent on the GPU machine.
    import verl_mtp_plugin  # noqa: F401

    algos = import_verl_algorithms()
    from verl_mtp_plugin.testing import init_megatron, reset_mtp_globals

    init_megatron(seed=args.seed)
    reset_mtp_globals(1)
    lang = Language(response_len=12) if args.tiny else Language()
    return device, algos, lang, model_spec(args.tiny), Fwd(device)


def _ref_model(spec, state, device):
    ref = build_model(spec, device)
    ref.load_state_dict(state, strict=True)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def rl_group(args) -> int:
    """Child process: one learning-rate group, its arms in lock-step, rows appended to the JSONL."""
    lr, arms_wanted = parse_groups(args.group_spec)[0]
    args.rl_lr = lr
    device, algos, lang, spec, fwd = _setup(args)
    state = torch.load(args.ckpt, map_location=device)
    ref = _ref_model(spec, state, device)
    arms = [Arm(m, spec, state, lang, fwd, args, algos) for m in arms_wanted]
    log(f"arms {', '.join(arms_wanted)}; lr {lr:g}; {args.prompts_per_step} prompts x {args.group_size} samples "
        f"per step; held-out {args.heldout_size} prompts")
    jsonl = os.path.join(args.out, f"acceptance_drift_{args.tag}.jsonl")
    info = run_rl(arms, ref, lang, fwd, args, args.deadline_at or float("inf"), lr, jsonl)
    log(f"done: {info}")
    return 0


def main(argv=None) -> int:
    global PREFIX
    args = parse_args(argv)
    if args.make_deps_bundle:
        make_deps_bundle(args.make_deps_bundle)
        return 0
    os.makedirs(args.out, exist_ok=True)
    jsonl = os.path.join(args.out, f"acceptance_drift_{args.tag}.jsonl")
    meta_path = os.path.join(args.out, f"acceptance_drift_{args.tag}_meta.json")
    png = os.path.join(args.out, f"acceptance_drift_{args.tag}.png")
    groups = parse_groups(args.groups)
    if args.plot_only:
        with open(jsonl) as f:
            rows = [json.loads(x) for x in f if x.strip()]
        log(f"wrote {plot(rows, png, args.draft_cost, groups[0][0])}")
        summary_path = os.path.join(args.out, f"acceptance_drift_{args.tag}_summary.json")
        with open(summary_path, "w") as f:
            json.dump(summarize(rows, args.summary_tail), f, indent=1)
        log(f"wrote {summary_path} (recomputed from the JSONL, end = mean of the last {args.summary_tail})")
        return 0
    if args.phase == "rl":
        PREFIX = f"[lr={parse_groups(args.group_spec)[0][0]:g}] "
        return rl_group(args)

    budget_end = T0 + args.budget if args.budget else float("inf")
    args.rl_lr = groups[0][0]  # the warm-up arm's
    device, algos, lang, spec, fwd = _setup(args)
    env = environment(device)
    log(f"device {device} {env.get('gpu', '')} | pattern {spec.pattern!r} hidden {spec.hidden_size} | "
        f"language {dataclasses.asdict(lang)}")
    open(jsonl, "w").close()
    rows: list = []
    ckpt = args.ckpt or os.path.join(args.out, f"acceptance_drift_{args.tag}_ckpt.pt")
    torch.manual_seed(args.seed)
    model = build_model(spec, device)
    n_params = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    log(f"model: {n_params:,} parameters ({n_mtp:,} MTP)")
    if args.reuse_ckpt and os.path.exists(ckpt):
        model.load_state_dict(torch.load(ckpt, map_location=device), strict=True)
        pre = {"loaded": ckpt}
        log(f"loaded checkpoint {ckpt}")
    else:
        pre_deadline = T0 + args.pretrain_share * args.budget if args.budget else float("inf")
        pre = pretrain(model, lang, fwd, args, pre_deadline, rows)
        torch.save(model.state_dict(), ckpt)
        pre["ckpt"] = ckpt
        pre["ckpt_bytes"] = os.path.getsize(ckpt)
        log(f"saved checkpoint {ckpt} ({pre['ckpt_bytes'] / 2**20:.1f} MiB)")
    with open(jsonl, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    state = {k: v for k, v in model.state_dict().items()}
    # Warm-up on a throwaway online arm: compiles every kernel shape the groups use (Triton caches them on
    # disk for the child processes) and measures the checkpoint once.
    t_w = time.time()
    warm = Arm("online", spec, state, lang, fwd, args, algos)
    heldout, heldout_u = heldout_batch(args, lang, device)
    n_train = args.prompts_per_step * args.group_size
    u = torch.rand(n_train, lang.response_len, generator=torch.Generator().manual_seed(0)).to(device)
    prompts = lang.prompts(args.prompts_per_step, torch.Generator().manual_seed(1))
    prompts = prompts.repeat_interleave(args.group_size, 0)
    seq = sample(warm.model, "online", fwd, torch.cat([prompts.to(device), heldout]), torch.cat([u, heldout_u]))
    ck = warm.evaluate(seq[n_train:], _ref_model(spec, state, device))
    warm.update(seq[:n_train])
    ck.update(type="checkpoint", warmup_seconds=time.time() - t_w)
    rows.append(ck)
    with open(jsonl, "a") as f:
        f.write(json.dumps(ck) + "\n")
    log(f"checkpoint: expected acceptance {ck['expected_accept_rate']:.3f}, greedy {ck['greedy_accept_rate']:.3f}, "
        f"entropy {ck['entropy']:.3f}, filler rate {ck['heldout_reward']:.3f}, on-language "
        f"{ck['heldout_on_language']:.3f} (warm-up {ck['warmup_seconds']:.1f}s)")
    del warm, model

    import subprocess

    deadline = budget_end - 12.0
    t_rl = time.time()
    if len(groups) == 1:  # one group: run it in this process (no second start-up)
        lr, arms_wanted = groups[0]
        args.rl_lr = lr
        arms = [Arm(m, spec, state, lang, fwd, args, algos) for m in arms_wanted]
        log(f"arms {', '.join(arms_wanted)}; lr {lr:g}; {args.prompts_per_step} prompts x {args.group_size} "
            f"samples per step; held-out {args.heldout_size} prompts (in-process)")
        log(f"done: {run_rl(arms, _ref_model(spec, state, device), lang, fwd, args, deadline, lr, jsonl)}")
        groups = []
    base = [sys.executable] + (["-S"] if sys.flags.no_site else []) + [os.path.abspath(__file__)]
    base += list(argv if argv is not None else sys.argv[1:])
    procs = []
    for lr, arms in groups:
        cmd = base + ["--phase", "rl", "--group-spec", f"{lr}:{','.join(arms)}", "--ckpt", ckpt,
                      "--deadline-at", str(deadline)]
        procs.append(subprocess.Popen(cmd))
        if not args.parallel:
            procs[-1].wait()
    codes = [p.wait() for p in procs]
    log(f"rl groups finished in {time.time() - t_rl:.1f}s, exit codes {codes}")
    with open(jsonl) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    summary = summarize(rows, args.summary_tail)
    meta = {"args": vars(args), "spec": {k: str(v) for k, v in dataclasses.asdict(spec).items()},
            "language": dataclasses.asdict(lang), "params": n_params, "mtp_params": n_mtp,
            "mtp_loss_scaling_factor": {"pretrain": PRETRAIN_MTP_FACTOR, **MTP_FACTOR},
            "environment": env, "pretrain": pre, "checkpoint_eval": ck, "rl_exit_codes": codes,
            "rl_seconds": time.time() - t_rl, "summary": summary, "wall_seconds": time.time() - T0}
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1, default=str)
    for key, s in summary.items():
        if "/" in key:
            log(f"{key:16s}: steps {s['steps']:3d} accept {s['accept_start']:.3f} -> {s['accept_end']:.3f} "
                f"({100 * s['accept_rel_change_end']:+.1f}%; worst {100 * s['accept_rel_change_min']:+.1f}% at step "
                f"{s['accept_min_step']}), greedy {s['greedy_start']:.3f} -> {s['greedy_end']:.3f}, "
                f"KL {s['kl_end']:.3f},"
                f" reward {s['heldout_reward_start']:.3f} -> {s['heldout_reward_end']:.3f}, entropy "
                f"{s['entropy_start']:.3f} -> {s['entropy_end']:.3f}")
    log(f"goal: {json.dumps(summary['goal'])}")
    if args.plot:
        log(f"wrote {plot(rows, png, args.draft_cost, parse_groups(args.groups)[0][0])}")
    log(f"wrote {jsonl}, {meta_path}")
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
