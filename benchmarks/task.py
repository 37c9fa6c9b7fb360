"""The demo's two-rule count-on task, as the benchmarks use it.

A prompt ``count a b`` (two different digits) through the demo's chat template; the reward
(:func:`verl_mtp_cpu.reward.compute_score`) asks to count on by one from ``b``. The demo's checkpoint learned a
second rule first (repeat the digit two back), so RL on this reward moves the policy away from what its MTP head
learned. Everything here wraps :mod:`verl_mtp_cpu.assets` and :mod:`verl_mtp_cpu.reward`.
"""

from __future__ import annotations

import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, os.path.join(ROOT, "cpu_runtime")):  # the product and its CPU runtime (verl_mtp_cpu)
    if _p not in sys.path:
        sys.path.insert(0, _p)


def tokenizer(vocab_size: int | None = None):
    """The demo's word-level tokenizer, sized for the demo model's vocabulary (or padded to ``vocab_size``)."""
    from verl_mtp_cpu.assets import demo_tokenizer
    from verl_mtp_cpu.vllm_engine import dense_spec

    return demo_tokenizer(vocab_size or dense_spec().vocab_size)


def prompt_ids(tok, a: int, b: int) -> list[int]:
    """The demo's prompt ``count a b`` through its chat template (what verl feeds vLLM)."""
    ids = tok.apply_chat_template([{"role": "user", "content": f"count {a} {b}"}], add_generation_prompt=True,
                                  tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return list(ids)


def prompt_pairs(n: int, seed: int) -> list[tuple[int, int]]:
    """``n`` (a, b) pairs with b != a, drawn as the demo's data (:func:`verl_mtp_cpu.assets.task_rows`)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = rng.randint(0, 9)
        out.append((a, (a + rng.randint(1, 9)) % 10))
    return out


def rewards(tok, pairs: list[tuple[int, int]], responses, steps: int | None = None):
    """The demo's reward (``compute_score``) of each decoded response (``responses``: ``[n, L]`` token ids).
    ``steps``: the same rule over longer responses, the fraction of the first ``steps`` that count on by one."""
    import torch

    from verl_mtp_cpu.reward import compute_score, counted_on

    def score(text: str, b: int) -> float:
        if steps is None:
            return compute_score("count_on", text, str(b))
        return counted_on(text.split()[:steps], str(b)) / steps

    words = tok.convert_ids_to_tokens(list(range(len(tok))))
    return torch.tensor([score(" ".join(words[int(t)] for t in r), b) for (a, b), r in zip(pairs, responses.tolist())])


def answer(a: int, b: int, n: int) -> list[int]:
    """The ``n`` digits that continue the progression ``a b`` (step ``b - a`` mod 10)."""
    step = (b - a) % 10
    return [(b + step * k) % 10 for k in range(1, n + 1)]


def task_rows(n: int, split: str, seed: int, answer_len: int | None = None) -> list[dict]:
    """``n`` rows in verl's RL dataset layout. ``answer_len`` None: the demo's rows
    (:func:`verl_mtp_cpu.assets.task_rows`, ground truth ``b``); else prompts ``count a b`` with a step of 1 or 2
    and a ground truth of ``answer_len`` digits continuing the progression."""
    if answer_len is None:
        from verl_mtp_cpu.assets import task_rows as demo_rows

        return demo_rows(n, split, seed)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, step = rng.randint(0, 9), rng.randint(1, 2)
        b = (a + step) % 10
        rows.append({
            "data_source": "count_on",
            "prompt": [{"role": "user", "content": f"count {a} {b}"}],
            "ability": "count",
            "reward_model": {"style": "rule", "ground_truth": " ".join(map(str, answer(a, b, answer_len)))},
            "extra_info": {"split": split, "index": i},
        })
    return rows
