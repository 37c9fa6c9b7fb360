"""The text of the drafter-desync guard's messages (what a user reads when a rule fires).

:class:`~verl_mtp_plugin.rollout.monitor.desync_guard.MTPDesyncGuard` decides *when* to report (its rules);
these functions say *what*: line 1 names the rule, the step and the numbers; then the measured rates,
the trainer's estimate and its key; then the likely causes, each with the config keys involved.
"""

from __future__ import annotations

from typing import Any

from verl_mtp_plugin.config_keys import MTP as _MTP
from verl_mtp_plugin.config_keys import ROLLOUT as _RO
from verl_mtp_plugin.config_keys import VLLM_KWARGS as _VLLM
from verl_mtp_plugin.config_keys import (
    ARGMAX_DRAFT_METRIC,
    DRAFT_METHOD_ESTIMATE_METRIC,
    EXPECTED_METRIC,
    GUARD_CONFIG_PATH,
    WORKER_EXTENSION_CLS,
)

__all__ = ["desync_message", "draft_method_message", "missing_message", "slow_message"]



def desync_message(
    cfg: Any,
    step: Any,
    *,
    rate: float,
    length: float | None,
    pos: list[float],
    drafts: float | None,
    measured: float,
    expected: float | None,
    alpha: float | None,
    key: str | None,
    basis: str,
    zero: bool,
    low_streak: int,
    zero_streak: int,
    reset_steps: list[Any],
) -> str:
    """The desync report: the rule that fired, measured vs expected numbers, the likely causes with keys.

    Args:
        cfg: the guard's ``MTPGuardConfig``.
        step: the training step.
        rate, length, pos, drafts: the step's measured acceptance rate, accepted length, per-position
            rates and verify steps.
        measured, expected: the compared pair (on ``basis``); alpha, key: the trainer's raw estimate
            and its metric key.
        zero: True when the zero rule fired (else the ratio rule).
        low_streak, zero_streak: the rules' streaks; reset_steps: steps whose counters went backwards.

    Returns:
        str: the message (first line: the headline).
    """
    lines = []
    if zero:
        lines.append(
            f"MTP drafter desync suspected at step {step}: rollout acceptance {rate:.4f} <= "
            f"zero_rate {cfg.zero_rate} for {zero_streak} consecutive steps "
            f"({GUARD_CONFIG_PATH}.zero_patience={cfg.zero_patience}) while MTP rollout is on."
        )
    else:
        lines.append(
            f"MTP drafter desync suspected at step {step}: measured acceptance {measured:.4f} < "
            f"{cfg.threshold} x expected {expected:.4f} (ratio {measured / expected:.3f}) for "
            f"{low_streak} consecutive steps ({GUARD_CONFIG_PATH}.threshold={cfg.threshold}, "
            f"patience={cfg.patience})."
        )
    pos_txt = ", ".join(f"{p:.3f}" for p in pos) if pos else "n/a"
    lines.append(
        f"  measured by vLLM this step: rollout/spec_accept_rate={rate:.4f}, "
        f"rollout/spec_accept_length={'n/a' if length is None else f'{length:.3f}'}, "
        f"per draft position [{pos_txt}], verify steps={'n/a' if drafts is None else int(drafts)}; "
        f"compared on the {basis}."
    )
    if alpha is not None:
        lines.append(
            f"  expected by the trainer for the same policy version: {key}={alpha:.4f}"
            + (f" (comparable value {expected:.4f})" if expected is not None and expected != alpha else "")
            + "."
        )
    else:
        lines.append(
            f"  no trainer estimate in the metrics ({ARGMAX_DRAFT_METRIC} / {EXPECTED_METRIC}): frozen "
            "mode never runs the MTP forward, or the engine does not log it."
        )
    if reset_steps:
        lines.append(
            f"  vLLM's speculative-decoding counters went backwards at step(s) {reset_steps[-5:]} "
            "(engine restart): if acceptance fell right after, suspect causes 1 and 2."
        )
    lines.append("Likely causes and the config keys involved:")
    lines.append(
        "  1. Drafter not synced / names dropped: the trained MTP weights never reached vLLM's drafter, or its "
        "loader skipped them silently (vLLM's NemotronHMTP.load_weights drops unknown names). Use the plugin's "
        f"verified drafter sync, {_VLLM}.worker_extension_cls={WORKER_EXTENSION_CLS} (VERL_MTP_SYNC_CHECKSUM=1 also compares "
        f"digests); check {_MTP}.enable_train (frozen mode keeps the checkpoint drafter) and {_RO}.load_format "
        "(dummy leaves a random drafter until the first sync)."
    )
    lines.append(
        "  2. Sleep level 2 discarded the drafter weights: verl 0.9.1 has no sleep-level key; it sleeps vLLM at "
        f"level 1 only when {_MTP}.enable=true and {_MTP}.enable_rollout=true, else at level 2 whenever "
        f"{_RO}.free_cache_engine=true and {_RO}.enable_sleep_mode=true (speculation switched on only through "
        f"{_VLLM}.speculative_config lands here)."
    )
    lines.append(
        f"  3. Prefix caching on a hybrid model: {_RO}.enable_prefix_caching=true (or "
        f"{_VLLM}.enable_prefix_caching) needs {_VLLM}.mamba_cache_mode=align, the mode in which vLLM caches "
        f"Mamba states per block (vLLM #39809); or set {_RO}.enable_prefix_caching=false."
    )
    lines.append(
        f"  4. The drafter ignores hf_overrides/YaRN: dict overrides in {_VLLM}.hf_overrides (rope_scaling, "
        "max_position_embeddings, ...) reach the target model only (vLLM #58080): acceptance collapses on "
        "long rollouts."
    )
    lines.append(
        "  5. Temperature / draft-method mismatch: the estimate uses the temperature verl gives the actor "
        f"({_RO}.temperature) while vLLM drafts with {_VLLM}.speculative_config.draft_sample_method (default "
        f"greedy: compare with {ARGMAX_DRAFT_METRIC}); set {GUARD_CONFIG_PATH}.expected_key to the matching "
        "estimate."
    )
    lines.append(
        f"{GUARD_CONFIG_PATH}.action=fail stops the run on this, =off silences it "
        f"(threshold/patience/zero_patience/zero_rate tune it)."
    )
    return "\n".join(lines)

def slow_message(
    cfg: Any,
    step: Any,
    *,
    length: float,
    k: float,
    speedup: float,
    verify_cost: float,
    cost_source: str,
    batch: int | None,
    options: list[tuple[int, float]],
    slow_streak: int,
) -> str:
    """The slow-speculation warning: the speedup estimate, the break-even length and the speedup by k.

    Args:
        cfg: the guard's ``MTPGuardConfig``.
        step: the training step.
        length: measured accepted length; k: draft tokens; speedup: estimated speedup;
            verify_cost: ``c_k``, the verify-step cost in plain decode steps (also the break-even length);
            cost_source: where ``c_k`` comes from; batch: sequences per engine it was read at (None: 64).
        options: ``(k', speedup)`` for k' = 0..k from the per-position rates ([] without them).
        slow_streak: consecutive slow steps.

    Returns:
        str: the message.
    """
    k_text = f"{k}" if float(k).is_integer() else f"{k:.2f}"
    mean = "" if float(k).is_integer() else " (the mean per verify step, k chosen by batch size)"
    at = f"{batch} sequences per engine" if batch is not None else "64 sequences (batch not known)"
    lines = [
        f"MTP speculation is estimated to slow the rollout down at step {step} ({slow_streak} consecutive "
        f"steps): accepted length L = {length:.3f} tokens per verify step with k = {k_text} draft tokens{mean}; a "
        f"verify step costs c_k = {verify_cost:.3f} plain decode steps at {at} ({cost_source}): speedup ~= L / c_k "
        f"= {length:.3f} / {verify_cost:.3f} = {speedup:.3f} < {cfg.min_speedup}; break-even L = c_k = "
        f"{verify_cost:.3f}."
    ]
    if options:
        table = ", ".join(f"k={kk}: {s:.3f}" for kk, s in options)
        best = max(options, key=lambda t: t[1])
        lines.append(
            f"  from the measured per-position acceptance, speedup by k (k=0: no speculation): {table}; "
            f"best k = {best[0]}."
        )
    lines.append(
        f"  Lower {_MTP}.num_speculative_tokens or switch speculation off ({_MTP}.enable_rollout=false); if "
        "acceptance used to be higher, see the desync causes (drafter sync, sleep level). c_k measured on "
        f"another model or machine misleads: set {GUARD_CONFIG_PATH}.verify_cost from your own step times."
    )
    lines.append(
        "  The estimate counts engine steps only. Where the rollout's time follows the tokens generated instead "
        "(verl's timing_per_token_ms/gen about the same with and without speculation), speculation changes little "
        "either way: compare timing_per_token_ms/gen with a run without speculation before switching it off."
    )
    return "\n".join(lines)


def draft_method_message(
    cfg: Any,
    step: Any,
    *,
    current: str,
    other: str,
    estimates: dict[str, float],
    measured: float,
    streak: int,
) -> str:
    """The drafting-method advice: both estimates, what vLLM measured, the key to set.

    Args:
        cfg: the guard's ``MTPGuardConfig``.
        step: the training step.
        current: the configured ``draft_sample_method``; other: the one estimated to accept more.
        estimates: estimated first-draft acceptance per method (``greedy``: ``p[argmax q]``,
            ``probabilistic``: the overlap ``sum min(p, q)``).
        measured: vLLM's measured first-draft acceptance this step.
        streak: consecutive steps with the gain at or above the margin.

    Returns:
        str: the message.
    """
    gain = estimates[other] - estimates[current]
    lines = [
        f"MTP drafting method: for {streak} consecutive steps (step {step}) the trainer estimates that vLLM "
        f"would accept the first draft with probability {estimates[other]:.3f} with {other} drafting "
        f"({DRAFT_METHOD_ESTIMATE_METRIC[other]}) against {estimates[current]:.3f} with the configured {current} drafting "
        f"({DRAFT_METHOD_ESTIMATE_METRIC[current]}; vLLM measured {measured:.3f}): +{gain:.3f}, above "
        f"{GUARD_CONFIG_PATH}.draft_method_margin={cfg.draft_method_margin}.",
        f"  Set {_VLLM}.speculative_config.draft_sample_method={other} (verl merges it into the MTP speculative "
        f"config it gives vLLM; on the command line {_VLLM}.speculative_config.draft_sample_method={other} where the "
        f"recipe sets it, as the shipped recipes do, +{_VLLM}.speculative_config.draft_sample_method={other} where "
        "it does not)."
        + (" Probabilistic drafting keeps the draft probabilities: more device memory per sequence."
           if other == "probabilistic" else ""),
        "  Greedy drafting accepts a draft with p[argmax q], which a high-entropy policy keeps low; probabilistic "
        f"drafting accepts with the overlap sum min(p, q). {GUARD_CONFIG_PATH}.draft_method_margin=null silences "
        "this advice.",
    ]
    return "\n".join(lines)


def missing_message(cfg: Any, step: Any, *, drafts: float | None, missing_streak: int) -> str:
    """The warning for steps without enough speculative-decoding statistics to judge.

    Args:
        cfg: the guard's ``MTPGuardConfig``.
        step: the training step; drafts: the step's verify steps (None: no statistics);
        missing_streak: consecutive such steps.

    Returns:
        str: the message.
    """
    what = (
        f"only {int(drafts)} verify steps (< {GUARD_CONFIG_PATH}.min_drafts={cfg.min_drafts})"
        if drafts is not None and drafts > 0
        else "no speculative-decoding statistics"
    )
    return (
        f"MTP rollout is on but step {step} has {what} for {missing_streak} consecutive steps, so the "
        "desync guard cannot judge the drafter. vLLM's counters exist only with "
        f"{_RO}.disable_log_stats=false (verl's default is true); per-request statistics need "
        f"{_VLLM}.per_request_spec_decode_metrics=summary and a server that reads "
        "CompletionOutput.spec_decode_metrics (verl 0.9.1 reads a field vLLM 0.31 does not have)."
    )
