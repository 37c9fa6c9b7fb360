"""Rewards for the harness's count-on task (verl ``reward.custom_reward_function``; this file's path).

A prompt asks to continue ``a b`` as the progression ``a, b, 2b-a, ...`` modulo 10; the ground truth
is the correct continuation (space-separated digits).

* :func:`compute_score` (learnable): the fraction of response tokens equal to the correct
  continuation; a partly warmed-up model sampling at temperature 1 gets different scores within a
  GRPO group, so the advantages are non-zero and the policy gradient reaches the trunk.
* :func:`zero_score`: 0 for every response, so every GRPO advantage is exactly 0 and the policy loss
  sends no gradient anywhere (what is left is the MTP loss: the isolation check).
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **_):
    want = str(ground_truth).split()
    got = str(solution_str).split()
    if not want:
        return 0.0
    return sum(1.0 for i, w in enumerate(want) if i < len(got) and got[i] == w) / len(want)


def zero_score(data_source, solution_str, ground_truth, extra_info=None, **_):
    return 0.0
