"""Rewards for the harness's count-on task (verl ``reward.custom_reward_function``; this file's path).

A prompt ``count a b`` gives two different digits; the ground truth is ``b``, the digit to count on from.
The warm-up taught the checkpoint another rule (:func:`~verl_mtp_cpu.assets.warmup_response`:
mostly repeat the digit two back, ``a b a b ...``, sometimes count on by one), so RL has to move the policy
from the rule its MTP head learned to the one the reward pays for.

* :func:`compute_score` (learnable): the fraction of the response's steps that count on by one (mod 10)
  from the digit before (``b`` for the first); a warmed-up model sampling at temperature 1 gets different
  scores within a GRPO group, so the advantages are non-zero and the policy gradient reaches the trunk.
* :func:`zero_score`: 0 for every response, so every GRPO advantage is exactly 0 and the policy loss
  sends no gradient anywhere (what is left is the MTP loss: the isolation check).
"""

#: response steps the score is a fraction of (= the harness's ``data.max_response_length``)
STEPS = 8


def counted_on(words: list[str], ground_truth) -> int:
    """How many of ``words`` count on by one (mod 10) from the word before (``ground_truth`` for the first)."""
    prev = str(ground_truth).strip()
    right = 0
    for tok in words:
        if tok.isdigit() and len(tok) == 1 and prev.isdigit() and int(tok) == (int(prev) + 1) % 10:
            right += 1
        prev = tok
    return right


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **_):
    return counted_on(str(solution_str).split()[:STEPS], ground_truth) / STEPS


def zero_score(data_source, solution_str, ground_truth, extra_info=None, **_):
    return 0.0
