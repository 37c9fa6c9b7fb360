"""Reward of the long count-on task of ``super_assets.py`` (verl ``reward.custom_reward_function``; this file's path).

A prompt ``count a b``; the ground truth is ``b``. The score is the fraction of the response's steps that count on
by one (mod 10) from the digit before (``b`` for the first), over at least ``MIN_STEPS`` steps (a response that
stops early is not paid for the steps it did not take). The pretrained policy mostly repeats the digit two back
(the rule its MTP head learned), so GRPO moves it to counting on.
"""

#: the shortest response of the pretraining data: the score's smallest denominator
MIN_STEPS = 256


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **_):
    prev = str(ground_truth).strip()
    got = str(solution_str).split()
    right = 0
    for tok in got:
        if tok.isdigit() and len(tok) == 1 and prev.isdigit() and int(tok) == (int(prev) + 1) % 10:
            right += 1
        prev = tok
    return right / max(MIN_STEPS, len(got))
