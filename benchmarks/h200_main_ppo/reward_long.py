"""Reward of the long count-on task of ``super_assets.py`` (verl ``reward.custom_reward_function``; this file's path).

A prompt ``count a b``; the ground truth is ``b``. The score is the number of the response's first ``MAX_STEPS``
steps that count on by one (mod 10) from the digit before (``b`` for the first), over the response's length, at
least ``MIN_STEPS`` (a response that stops early is not paid for the steps it did not take; one that runs past the
longest pretraining response is not paid for the steps beyond it). The pretrained policy mostly repeats the digit
two back (the rule its MTP head learned), so GRPO moves it to counting on.

Measured with the first version (no ``MAX_STEPS``; H200, 2026-12-04): the policy stopped ending its responses, and
from GRPO step 6 every response ran to ``data.max_response_length`` (verl's ``response_length/clip_ratio`` 1.0).
With ``MAX_STEPS`` (mode off, H100, 2026-12-06) it did too, from step 11: running on costs at most 4 % of the score
(384 / 400), too little to keep the stop, so the rollout loses its tail of lengths. A reward that scores a clipped
response 0 would keep it; kept as it is while the three modes' runs share the task.
The rule is the CPU harness's (:func:`verl_mtp_cpu.reward.counted_on`; ``run.py`` puts ``verl_mtp_cpu`` on the
path of every process of the run).
"""

from verl_mtp_cpu.reward import counted_on

#: the shortest response of the pretraining data: the score's smallest denominator
MIN_STEPS = 256
#: the longest response of the pretraining data: steps beyond it are not paid
MAX_STEPS = 384


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **_):
    got = str(solution_str).split()
    return counted_on(got[:MAX_STEPS], ground_truth) / max(MIN_STEPS, len(got))
