"""Speculation depth ``k`` chosen by batch size: vLLM's ``num_speculative_tokens_per_batch_size``.

A verify step with ``k`` drafts costs more at large batches than at small ones (H200, Nemotron 3 Lightning
30B-A3B shape: k = 1, 2, 3 cost 1.18, 1.33, 1.46 plain decode steps at 64 sequences but 1.28, 1.64, 2.54 at
256), and an RL rollout runs at both ends: hundreds of sequences per replica at its start, a long tail of a few
at its end. vLLM 0.31 can pick ``k`` from the number of requests scheduled in each step
(``vllm/v1/core/sched/scheduler.py``: ``dynamic_sd_lookup[len(num_scheduled_tokens)]``) from
``SpeculativeConfig.num_speculative_tokens_per_batch_size``, a list of inclusive ranges
``[[lo, hi, k], ...]``. verl 0.9.1 forwards every key of ``engine_kwargs.vllm.speculative_config`` into the MTP
speculative config it builds (``build_mtp_speculative_config``), so a recipe sets it at
:data:`~verl_mtp_plugin.config_keys.SPEC_SCHEDULE_KEY`; ``actor_rollout_ref.model.mtp.num_speculative_tokens``
stays the largest ``k`` (vLLM sizes the drafter, its buffers and its CUDA graphs for it).

What vLLM 0.31 does with the schedule, and what the plugin's start-up check refuses instead
(``vllm/v1/spec_decode/dynamic/utils.py``, ``vllm/config/vllm.py``):

* validated only when the scheduler is built (after the model load): first range must start at 1, ranges sorted
  and non-overlapping, ``k >= 0``; entries are passed through ``int()`` (``2.7`` becomes 2);
* a ``k`` above ``num_speculative_tokens`` is clamped to it without a word; a gap between ranges takes the
  previous range's ``k``, and sizes past the last range take the last ``k``, without a word;
* with ``data_parallel_size > 1`` the schedule is dropped (a log warning; static ``k``);
* on the V1 model runner a CUDA-graph mode with full graphs is lowered to ``PIECEWISE`` (a log warning);
* on the V2 runner (vLLM 0.31's default on CUDA for Nemotron-H with MTP) with full CUDA graphs and an MTP
  drafter, the engine fails at start: the decode graph capture can fail an assert on 0.31 (vLLM issue
  "num_speculative_tokens_per_batch_size + MTP speculator fails full CUDA graph decode capture"; the guard is in
  vLLM 0.33), and on 0.26 the speculator's CUDA-graph manager raised ``ZeroDivisionError`` (measured on an H100).

The plugin refuses the first two kinds at start-up naming the key (non-integers, overlaps, gaps, a range that
does not reach ``rollout.max_num_seqs``, ``k`` above ``num_speculative_tokens``) and the last two as well
(:func:`verl_mtp_plugin.trainer.config.validate_verl_config`); the V1 piecewise lowering is a speed warning.

Measuring with a schedule: vLLM's counters do not say how many verify steps drafted each position
(``num_draft_tokens_per_pos`` is in its per-step ``SpecDecodingStats`` but not in its Prometheus counters).
:func:`drafted_per_position` recovers it from the totals wherever the schedule allows (below its smallest
``k`` every verify step drafted; with at most two distinct ``k`` the split follows from the draft-token total)
and says ``None`` where it cannot. Core module: no verl / vLLM import.
"""

from __future__ import annotations

from typing import Any, Sequence

from verl_mtp_plugin.config_keys import MTP, ROLLOUT, SPEC_SCHEDULE_KEY, to_plain
from verl_mtp_plugin.policy import MTPConfigError

__all__ = [
    "Schedule",
    "dense_lookup",
    "depth_batches",
    "depth_shares",
    "drafted_per_position",
    "format_schedule",
    "parse_schedule",
    "schedule_depths",
    "schedule_errors",
]

#: ``((lo, hi, k), ...)`` sorted by ``lo``: inclusive ranges of the number of running requests -> drafts per step.
Schedule = tuple[tuple[int, int, int], ...]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_schedule(raw: Any, *, key: str = SPEC_SCHEDULE_KEY) -> Schedule:
    """The schedule as vLLM reads it, refusing what vLLM would read silently differently.

    Args:
        raw: ``[[lo, hi, k], ...]`` (a list of 3-item lists of integers; omegaconf containers are accepted).
        key: the config key named in messages.

    Returns:
        Schedule: the ranges sorted by ``lo``.

    Raises:
        MTPConfigError: every problem, one per line, each naming ``key``: not a non-empty list, an entry that is
            not 3 integers (vLLM would truncate floats), ``lo < 1``, ``lo > hi``, ``k < 0``, overlapping ranges,
            a gap between ranges (vLLM fills it with the previous ``k``), a first range not starting at 1.
    """
    raw = to_plain(raw)
    if not isinstance(raw, (list, tuple)) or not raw:
        raise MTPConfigError(f"{key}={raw!r}: must be a non-empty list of [lo, hi, k] ranges (inclusive batch sizes)")
    errors: list[str] = []
    entries: list[tuple[int, int, int]] = []
    for i, entry in enumerate(raw):
        entry = to_plain(entry)
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            errors.append(f"{key}[{i}]={entry!r}: each entry is [lo, hi, k] (3 integers)")
            continue
        if not all(_is_int(v) for v in entry):
            errors.append(
                f"{key}[{i}]={list(entry)!r}: lo, hi and k must be integers (vLLM passes them through int(), "
                "so 2.7 would silently become 2)"
            )
            continue
        lo, hi, k = entry
        if lo < 1:
            errors.append(f"{key}[{i}]={list(entry)}: lo={lo} must be >= 1 (a batch size)")
        elif lo > hi:
            errors.append(f"{key}[{i}]={list(entry)}: lo={lo} > hi={hi} (ranges are inclusive: [lo, hi])")
        elif k < 0:
            errors.append(f"{key}[{i}]={list(entry)}: k={k} must be >= 0 (0: no drafts at these batch sizes)")
        else:
            entries.append((lo, hi, k))
    if errors:
        raise MTPConfigError("\n".join(errors))
    entries.sort()
    if entries[0][0] != 1:
        errors.append(
            f"{key}: the first range starts at {entries[0][0]}; it must start at 1 so that every batch size has a k "
            "(vLLM refuses it when the engine starts, after loading the model)"
        )
    for prev, cur in zip(entries, entries[1:]):
        if cur[0] <= prev[1]:
            errors.append(f"{key}: ranges {list(prev)} and {list(cur)} overlap")
        elif cur[0] > prev[1] + 1:
            errors.append(
                f"{key}: gap between {list(prev)} and {list(cur)} (batch sizes {prev[1] + 1}..{cur[0] - 1}): vLLM "
                f"would use k={prev[2]} there without saying so; make the ranges contiguous"
            )
    if errors:
        raise MTPConfigError("\n".join(errors))
    return tuple(entries)


def schedule_errors(raw: Any, *, num_speculative_tokens: int, max_num_seqs: int,
                    k_key: str = f"{MTP}.num_speculative_tokens") -> tuple[Schedule | None, list[str]]:
    """:func:`parse_schedule` plus the checks that need the rest of the config.

    Args:
        raw: the schedule (None: unset).
        num_speculative_tokens: the ``k`` vLLM gets (the largest it will draft; vLLM clamps larger ``k``).
        max_num_seqs: ``actor_rollout_ref.rollout.max_num_seqs`` (the largest batch vLLM schedules).
        k_key: the key that sets ``num_speculative_tokens`` (for messages).

    Returns:
        (schedule or None, errors naming :data:`SPEC_SCHEDULE_KEY`).
    """
    if raw is None:
        return None, []
    try:
        schedule = parse_schedule(raw)
    except MTPConfigError as e:
        return None, str(e).splitlines()
    errors: list[str] = []
    too_deep = [list(e) for e in schedule if e[2] > num_speculative_tokens]
    if too_deep:
        errors.append(
            f"{SPEC_SCHEDULE_KEY}: {too_deep} ask for more drafts than {k_key}={num_speculative_tokens}, the most the "
            f"drafter is built for (vLLM would clamp them to {num_speculative_tokens} without saying so); lower k "
            f"or raise {k_key}"
        )
    if schedule[-1][1] < max_num_seqs:
        errors.append(
            f"{SPEC_SCHEDULE_KEY}: the last range {list(schedule[-1])} ends below {ROLLOUT}.max_num_seqs={max_num_seqs}: "
            f"vLLM would use k={schedule[-1][2]} for {schedule[-1][1] + 1}..{max_num_seqs} running requests without "
            f"saying so; extend the last range to {max_num_seqs}"
        )
    if all(e[2] == 0 for e in schedule):
        errors.append(
            f"{SPEC_SCHEDULE_KEY}: every range has k=0, so vLLM would never draft; set {MTP}.enable_rollout=false "
            "instead"
        )
    return (None if errors else schedule), errors


def dense_lookup(schedule: Schedule, max_num_seqs: int, num_speculative_tokens: int) -> list[int]:
    """``lookup[n]`` = drafts per step with ``n`` running requests (index 0 unused): vLLM's
    ``build_dynamic_sd_schedule_lookup`` for a schedule :func:`schedule_errors` accepts (parity in the tests)."""
    out = [0] * (max_num_seqs + 1)
    for lo, hi, k in schedule:
        for n in range(lo, min(hi, max_num_seqs) + 1):
            out[n] = min(k, num_speculative_tokens)
    last = min(schedule[-1][2], num_speculative_tokens)
    for n in range(schedule[-1][1] + 1, max_num_seqs + 1):
        out[n] = last
    return out


def schedule_depths(schedule: Schedule | None, max_num_seqs: int, num_speculative_tokens: int) -> tuple[int, ...]:
    """The distinct ``k > 0`` vLLM drafts with (ascending); ``(num_speculative_tokens,)`` without a schedule."""
    if not schedule:
        return (int(num_speculative_tokens),)
    return tuple(sorted({k for k in dense_lookup(schedule, max_num_seqs, num_speculative_tokens)[1:] if k > 0}))


def depth_batches(schedule: Schedule, max_num_seqs: int, num_speculative_tokens: int,
                  batch: int | None = None) -> dict[int, int]:
    """Each ``k > 0`` of the schedule with the batch its verify steps are costed at: the largest number of running
    requests, at most ``batch`` (the rollout's starting batch per engine; default ``max_num_seqs``), that drafts
    that ``k`` (a verify step costs more at larger batches: the upper end bounds it); a ``k`` whose ranges all lie
    above ``batch`` gets its smallest batch (a rollout that starts at ``batch`` never reaches it)."""
    lookup = dense_lookup(schedule, max_num_seqs, num_speculative_tokens)
    top = max_num_seqs if batch is None else max(1, min(int(batch), max_num_seqs))
    out: dict[int, int] = {}
    for k in sorted({x for x in lookup[1:] if x > 0}):
        sizes = [n for n in range(1, max_num_seqs + 1) if lookup[n] == k]
        below = [n for n in sizes if n <= top]
        out[k] = max(below) if below else min(sizes)
    return out


def depth_shares(mean_drafts: float, depths: Sequence[int]) -> dict[int, float] | None:
    """The share of verify steps at each ``k`` from the mean drafts per verify step (vLLM's ``num_draft_tokens /
    num_drafts``): all at ``k`` for one depth; for two ``k1 < k2`` the share at ``k2`` is ``(mean - k1) / (k2 -
    k1)`` (clamped to ``[0, 1]``); None for three or more (the mean does not determine them)."""
    ds = sorted({int(d) for d in depths if int(d) > 0})
    if len(ds) == 1:
        return {ds[0]: 1.0}
    if len(ds) != 2:
        return None
    k1, k2 = ds
    w = min(max((float(mean_drafts) - k1) / (k2 - k1), 0.0), 1.0)
    return {k1: 1.0 - w, k2: w}


def format_schedule(schedule: Schedule | None) -> str | None:
    """``"1-64: k=3, 65-256: k=1"`` (None without a schedule)."""
    if not schedule:
        return None
    return ", ".join(f"{lo}-{hi}: k={k}" for lo, hi, k in schedule)


def drafted_per_position(num_drafts: int, num_draft_tokens: int, num_positions: int,
                         depths: Sequence[int]) -> tuple[float | None, ...]:
    """How many verify steps drafted each position, from vLLM's totals.

    Args:
        num_drafts: verify steps with at least one draft (vLLM ``num_drafts``; steps with ``k = 0`` are not counted).
        num_draft_tokens: draft tokens proposed.
        num_positions: positions reported (vLLM's ``num_speculative_tokens``).
        depths: the distinct ``k > 0`` the schedule drafts with (:func:`schedule_depths`).

    Returns:
        per position: the verify steps that drafted it; ``None`` where the totals cannot tell (three or more
        depths, positions at or past the second smallest). Every verify step drafts the positions below the
        smallest depth; with two depths ``k1 < k2`` the steps at ``k2`` are
        ``(num_draft_tokens - num_drafts * k1) / (k2 - k1)`` (clamped to ``[0, num_drafts]``; drafts vLLM
        shortens at the end of ``max_model_len`` make it a slight under-count); positions past the largest depth
        were drafted by none.
    """
    depths = sorted({int(d) for d in depths if int(d) > 0})
    n = float(num_drafts)
    if not depths:
        return tuple(0.0 for _ in range(num_positions))
    out: list[float | None] = []
    for i in range(num_positions):
        if i < depths[0]:
            out.append(n)
        elif i >= depths[-1]:
            out.append(0.0)
        elif len(depths) == 2:
            k1, k2 = depths
            out.append(min(max((float(num_draft_tokens) - n * k1) / (k2 - k1), 0.0), n))
        else:
            out.append(None)
    return tuple(out)
