"""``verl-mtp demo``: every RL phase, end to end, on a tiny Nemotron-3-shaped HybridModel.

One plain script in the torchtune-recipe style: ``run_demo`` wires the plugin's own code paths and
verl's own algorithm functions, nothing in between.

Task: count on. A prompt is ``<bos> a b <sep>`` with two digits; the correct response continues the
progression ``a, b, 2b-a, ...`` modulo 8 (step 1 or 2); the verifiable reward is the fraction of right tokens. Before RL the model is warmed up for a few
supervised steps (policy and MTP head together) to stand in for a loaded checkpoint whose MTP head
was trained with the model, as Nemotron 3's is.

Each RL step walks the phases with the plugin's code:

1. load     mode applied (:func:`configure_transformer_config`, :func:`freeze_mtp` before the
            optimizer exists, :func:`validate_model_for_mode`); frozen: no optimizer state for MTP
2. rollout  autoregressive sampling from the current policy, G responses per prompt
            (``run_mtp_forward(mode, "rollout")`` is False: speculation is the rollout engine's)
3. logprob  old log-probs, MTP skipped; the tracker must stay untouched
4. adv/loss verl's ``compute_grpo_outcome_advantage`` and its registered ``vanilla`` policy loss
5. train    ``run_mtp_forward(mode, "train")``; online: MTP loss on the sampled response tokens,
            isolated from trunk/embedding/output (checked bit-for-bit on the first step); the
            returned logits must equal the logprob pass's (MTP never changes them)
6. sync     ``export_mtp_weights`` into vLLM's real ``NemotronHMTP`` drafter through the worker
            extension's load path, verified name-by-name and by checksum (without vLLM: an HF
            safetensors directory, said so in the output)
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field

import torch

from verl_mtp_plugin.policy import MTPMode, Phase, run_mtp_forward

__all__ = ["DemoInvariantError", "DemoTask", "run_demo"]


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
    length: int = 4  # response length
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
    from verl_mtp_plugin.testing import TinyHybridSpec, build_tiny_hybrid

    torch.manual_seed(seed)
    pattern = "M*-E" if mode is MTPMode.OFF else "M*-E/*E"
    spec = TinyHybridSpec(
        pattern=pattern, vocab_size=task.vocab_size, hidden_size=64, ffn_hidden_size=128, num_experts=4,
        moe_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, moe_latent_size=32,
        mtp_loss_scaling_factor=0.3,
    )
    return spec, build_tiny_hybrid(spec, device=device)


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
             progress: bool = True, warmup_steps: int = 40, task: DemoTask | None = None) -> list[dict]:
    """Run the demo; returns the per-step metrics (also written to ``out/metrics.jsonl``).

    Raises:
        DemoInvariantError: an invariant failed (the CLI exits non-zero with the message).
    """
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_policy_loss_fn
    from verl.workers.config import ActorConfig

    from verl_mtp_plugin.control import configure_transformer_config, freeze_mtp, hybrid_forward, validate_model_for_mode
    from verl_mtp_plugin.metrics import collect_mtp_metrics, reset_mtp_metrics
    from verl_mtp_plugin.testing import causal_mask, init_megatron

    mode = MTPMode.parse(mode, "--mode")
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
        sink = _make_sink(model, spec, mode, out, log)
        mtp_names = {n for n, _ in model.named_parameters() if n.startswith("mtp.")}
        mtp_snapshot = {n: p.detach().clone() for n, p in model.named_parameters() if n in mtp_names}
    n_total = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for n, p in model.named_parameters() if n in mtp_names)
    log.header(mode, device, spec, n_total, n_mtp, warmup_steps, warm_loss, sink.describe())

    history: list[dict] = []
    pos_all = None
    for step in range(1, steps + 1):
        timer.phases = {}
        # ------------------------------------------------------------ rollout
        with timer.time("rollout"):
            prompts = task.prompts(task.prompts_per_step, gen).repeat_interleave(task.group_size, dim=0)
            seq = _sample(model, mode, prompts, task.length, gen, device)
            responses = seq[:, task.prompt_len :]
            reward = task.reward(prompts.to(device), responses)
        b, s = seq.shape
        pos_all = _positions(b, s, device)
        mask = causal_mask(s, device)
        token_resp = torch.zeros(b, s, device=device)
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
            if probe is not None:
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

        # ------------------------------------------------------------ sync
        with timer.time("sync"):
            sync_metrics = sink.sync(step)

        row = {
            "step": step,
            "mode": str(mode),
            "reward": float(reward.mean()),
            "policy_loss": float(pg_loss.detach()),
            "mtp_loss": mtp_metrics.get("mtp_losses/mtp_1_loss", math.nan),
            "mtp_top1": mtp_metrics.get("mtp_accuracy/mtp_1_top1", math.nan),
            "expected_accept_rate": acc.get("mtp_expected_accept_rate", math.nan),
            "greedy_accept_rate": acc.get("mtp_greedy_accept_rate", math.nan),
            "expected_accept_length_k1": acc.get("mtp_expected_accept_length_k1", math.nan),
            "expected_accept_length_k3": acc.get("mtp_expected_accept_length_k3", math.nan),
            **sync_metrics,
            **{f"time/{k}": v for k, v in timer.phases.items()},
        }
        history.append(row)
        log.step(row, steps)

    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        for row in history:
            f.write(json.dumps(row) + "\n")
    plot = _plot(history, os.path.join(out, "demo.png"))
    log.table(history, out, plot)
    sink.close()
    return history


# --------------------------------------------------------------------------- acceptance and sync sinks


def _acceptance_probe(model):
    from verl_mtp_plugin.acceptance import AcceptanceProbe

    return AcceptanceProbe(model)


def _make_sink(model, spec, mode, out, log):
    """The sync target: vLLM's real drafter when vLLM is importable, else an HF safetensors dir."""
    if mode is MTPMode.OFF:
        return _NoSync()
    # The demo's drafter is a verification copy on the host: vLLM's CPU platform, chosen before import.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the demo's output readable
    try:
        import vllm  # noqa: F401
    except ImportError:
        return _SafetensorsSink(model, spec, out)
    return _VllmDrafterSink(model, spec, mode, out)


class _NoSync:
    def describe(self):
        return "mode off: no MTP weights to sync"

    def sync(self, step):
        return {}

    def close(self):
        pass


class _SafetensorsSink:
    """Without vLLM: write the exported HF-named MTP tensors to ``out/mtp_sync/step_N.safetensors``."""

    def __init__(self, model, spec, out):
        self.model, self.spec = model, spec
        self.dir = os.path.join(out, "mtp_sync")
        os.makedirs(self.dir, exist_ok=True)

    def describe(self):
        return f"vLLM not installed: MTP weights go to an HF safetensors directory ({self.dir})"

    def sync(self, step):
        from safetensors.torch import save_file

        from verl_mtp_plugin.export import export_mtp_weights

        t = time.perf_counter()
        tensors = {n: w.detach().contiguous().cpu() for n, w in export_mtp_weights(self.model, vocab_size=self.spec.vocab_size)}
        save_file(tensors, os.path.join(self.dir, f"step_{step}.safetensors"))
        return {"sync/bytes_drafter": sum(v.numel() * v.element_size() for v in tensors.values()),
                "sync/bytes_target": 0, "sync/drafter_seconds": time.perf_counter() - t}

    def close(self):
        pass


class _VllmDrafterSink:
    """Sync into vLLM's real ``NemotronHMTP`` drafter (CPU) through the worker extension's load path."""

    def __init__(self, model, spec, mode, out):
        from verl_mtp_plugin.testing import vllm_drafter

        self.model, self.spec, self.mode = model, spec, mode
        self.handle = vllm_drafter.build_drafter_for_spec(spec, workdir=os.path.join(out, "vllm_config"))
        self.syncer = vllm_drafter.make_syncer(self.handle, frozen=(mode is MTPMode.FROZEN), checksum=True)

    def describe(self):
        return "vLLM NemotronHMTP drafter (real vLLM, CPU), verified by name and checksum every sync"

    def sync(self, step):
        from verl_mtp_plugin.export import export_mtp_weights

        try:
            return self.syncer.sync(export_mtp_weights(self.model, vocab_size=self.spec.vocab_size))
        except Exception as e:  # verification failures are invariant failures
            raise DemoInvariantError(f"drafter sync failed verification: {e}") from e

    def close(self):
        pass


# --------------------------------------------------------------------------- output


class _Log:
    def __init__(self, progress: bool):
        self.progress = progress
        self.bar = None

    def header(self, mode, device, spec, n_total, n_mtp, warm, warm_loss, sink):
        print(f"verl-mtp demo | mode={mode} device={device} | HybridModel pattern {spec.pattern!r} "
              f"(Mamba M, attention *, MLP -, MoE E; MTP after '/') | {n_total:,} params ({n_mtp:,} MTP)")
        print(f"load: warm-up {warm} supervised steps (loss {warm_loss:.3f}) stands in for a checkpoint; sync -> {sink}")
        print("phases per step (Megatron MTP forward): " + " -> ".join(
            f"{p.value}[{'run' if run_mtp_forward(mode, p) else 'skip'}]" for p in
            (Phase.ROLLOUT, Phase.LOGPROB, Phase.TRAIN)) + " -> sync[export MTP -> drafter]")
        if self.progress:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=None, unit="step", dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def step(self, row, steps):
        msg = (f"step {row['step']}/{steps} reward {row['reward']:.3f} pg_loss {row['policy_loss']:+.2e} "
               f"mtp_loss {row['mtp_loss']:.3f} E[accept] {row['expected_accept_rate']:.3f}")
        if self.bar is not None:
            self.bar.total = steps
            self.bar.update(1)
            self.bar.set_postfix_str(msg)
        else:
            print(msg, flush=True)

    def table(self, history, out, plot):
        if self.bar is not None:
            self.bar.close()
        cols = [("step", "{:d}"), ("reward", "{:.3f}"), ("policy_loss", "{:+.2e}"), ("mtp_loss", "{:.3f}"),
                ("mtp_top1", "{:.3f}"), ("expected_accept_rate", "{:.3f}"), ("greedy_accept_rate", "{:.3f}"),
                ("expected_accept_length_k3", "{:.2f}"), ("sync/bytes_target", "{:,.0f}"), ("sync/bytes_drafter", "{:,.0f}"),
                ("time/rollout", "{:.2f}"), ("time/logprob", "{:.2f}"), ("time/train", "{:.2f}"), ("time/sync", "{:.2f}")]
        heads = ["step", "reward", "pg_loss", "mtp_loss", "mtp_top1", "E[acc]", "greedy", "E[len]k3", "B->target",
                 "B->drafter", "t_roll", "t_lp", "t_train", "t_sync"]
        rows = []
        for r in history:
            cells = []
            for key, fmt in cols:
                v = r.get(key)
                cells.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v))
            rows.append(cells)
        widths = [max(len(h), *(len(c[i]) for c in rows)) for i, h in enumerate(heads)]
        print()
        print("  ".join(h.rjust(w) for h, w in zip(heads, widths)))
        for c in rows:
            print("  ".join(x.rjust(w) for x, w in zip(c, widths)))
        print(f"\nwrote {os.path.join(out, 'metrics.jsonl')}" + (f" and {plot}" if plot else ""))
        print("all invariants held: logprob skips MTP, train logits == logprob logits, "
              "MTP loss only where the mode trains it, isolation (online), frozen MTP untouched, drafter verified")


def _plot(history, path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [r["step"] for r in history]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for ax, key, title in zip(axes, ("reward", "mtp_loss", "expected_accept_rate"),
                              ("reward", "MTP loss", "expected acceptance (spec. sampling)")):
        ax.plot(steps, [r.get(key, math.nan) for r in history], marker="o")
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"verl-mtp demo, mode={history[0]['mode'] if history else '?'}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
