"""In-trainer estimate of the acceptance rate MTP speculative decoding would see for the current policy.

The estimate uses only logits the trainer can compute cheaply during a forward in which MTP runs:
the policy's next-token distribution ``p_main`` (the logits the forward returns) and the MTP head's
distribution ``q_mtp`` (computed here, on a subsample of response positions, from the MTP hidden
states captured by a forward hook).

Alignment (megatron-core 0.19.2, ``hybrid_model.py`` / ``multi_token_prediction.py``):

* main logits at position ``t`` predict token ``t+1``;
* MTP depth ``d`` (1-based) at position ``t`` combines the main hidden state ``h_t`` (depth 1) or the
  previous depth's hidden state with the embedding of token ``t+d`` and predicts token ``t+1+d``
  (``process_mtp_loss`` rolls the labels ``d+1`` times);
* vLLM's MTP drafter, after the target produced token ``t+1``, proposes token ``t+2`` from
  ``q_mtp1[t]``; the target verifies it with ``p_main[t+1]``.

So the per-position acceptance probability of speculative sampling (Leviathan et al. 2023; Chen et
al. 2023) is ``alpha_t = sum_v min(p_main[t+1, v], q_mtp1[t, v])``, and in general, for depth ``d``,
``alpha_t = sum_v min(p_main[t+d, v], q_mtp_d[t, v])``. A position ``t`` is counted when the tokens
``t+1 .. t+1+d`` are all response tokens (``response_mask != 0``, token coordinates): prompt and
padding are excluded. The first drafting position is the last prompt position (after the prefill
produced the first response token, the drafter proposes the second); the first response token itself
is never a draft target.

Temperature: both distributions use the same temperature ``T`` (``softmax(logits / T)``), as vLLM's
rejection sampler applies the request's temperature to the target logits and (with
``draft_sample_method="probabilistic"``) to the draft logits. ``T == 0`` is the greedy limit: the
acceptance is 1 where both argmaxes agree, else 0. top-p / top-k are not modelled.

What vLLM actually does (0.31): by default ``speculative_config.draft_sample_method="greedy"``: the
drafter proposes ``argmax q`` and the rejection sampler treats ``q`` as one-hot, so a draft is
accepted with probability ``p_main[argmax q]`` (:func:`argmax_draft_acceptance`), not with the
overlap. Both are reported; with greedy target sampling (temperature 0) both reduce to
:func:`greedy_agreement`.

Accepted length: with ``k`` draft tokens, each accepted independently with probability ``alpha``,
a verification step yields ``E = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)``
tokens (``k+1`` at ``alpha = 1``). vLLM reuses one MTP layer for ``k > 1``; the depth-1 ``alpha`` is
then an optimistic stand-in for the later positions (models with several MTP depths also get a
per-depth rate).

Cost: one ``[n, h] x [h, V]`` product per MTP depth (``n <= max_positions``, default 256) plus two
softmaxes over ``[n, V]`` (a chunk of rows at a time: :data:`~verl_mtp_plugin.acceptance.estimate.CHUNK_BYTES`),
under ``torch.no_grad``; see ``benchmarks/RESULTS.md``.

Modules: :mod:`~verl_mtp_plugin.acceptance.estimate` (the arithmetic on logits, the metric keys) and
:mod:`~verl_mtp_plugin.acceptance.probe` (the forward hook on the MTP block).
"""

from verl_mtp_plugin.acceptance.estimate import (
    ACCEPT_LENGTH_KEY,
    ARGMAX_DRAFT_KEY,
    DEPTH_EXPECTED_KEY,
    DEPTH_GREEDY_KEY,
    EXPECTED_KEY,
    GREEDY_KEY,
    POSITIONS_KEY,
    acceptance_positions,
    argmax_draft_acceptance,
    expected_accept_length,
    expected_speedup,
    greedy_agreement,
    per_position_acceptance,
    select_positions,
    speculative_overlap,
)
from verl_mtp_plugin.acceptance.probe import AcceptanceProbe

__all__ = [
    "ACCEPT_LENGTH_KEY",
    "ARGMAX_DRAFT_KEY",
    "DEPTH_EXPECTED_KEY",
    "DEPTH_GREEDY_KEY",
    "EXPECTED_KEY",
    "GREEDY_KEY",
    "POSITIONS_KEY",
    "AcceptanceProbe",
    "acceptance_positions",
    "argmax_draft_acceptance",
    "expected_accept_length",
    "expected_speedup",
    "greedy_agreement",
    "per_position_acceptance",
    "select_positions",
    "speculative_overlap",
]
