"""Harness events: what the CPU-only vLLM worker extension reports from vLLM's worker process
(one JSON line per weight update in ``$VERL_CPU_EVENTS``; ``vllm_worker`` when the worker loaded it), what the CPU
stand-ins report of packed (THD) forwards in the trainer workers (:func:`record_packed`; ``trainer_worker`` when a
trainer worker starts: the demo's progress reads both start-up events), and the switch that breaks the drafter
sync on purpose (``$VERL_CPU_BREAK_SYNC``). Imports nothing heavy."""

from __future__ import annotations

import json
import os
import time

__all__ = ["BREAK_SYNC_CHOICES", "ENV_BREAK_SYNC", "ENV_DRAFTER_DUMP", "ENV_EVENTS", "event", "parse_break_sync",
           "record_packed", "swap_eh", "truncate_eh"]

ENV_EVENTS = "VERL_CPU_EVENTS"
ENV_BREAK_SYNC = "VERL_CPU_BREAK_SYNC"
#: a folder: after every weight update each vLLM rank writes ``rank{R}.update{N}.pt`` there (the MTP tensors
#: it received and its drafter's tensors as loaded, its shard under tensor parallelism)
ENV_DRAFTER_DUMP = "VERL_CPU_DRAFTER_DUMP"
#: ``swap-eh``: the MTP ``eh_proj``'s two input halves trade places in what reaches vLLM (the demo's
#: ``--break-sync swap-eh``): names, shapes and checksums stay valid, only generation can tell;
#: ``skip-drafter``: the drafter is never loaded (it keeps its start-up weights) while the target follows;
#: ``truncate-eh-rank1``: on vLLM's tensor-parallel rank 1 only, the MTP ``eh_proj`` weight arrives one input
#: column short, so that rank's drafter load fails with vLLM's own shape check (a load failure on one rank)
BREAK_SYNC_CHOICES = ("none", "swap-eh", "skip-drafter", "truncate-eh-rank1")


def parse_break_sync(value: str | None) -> tuple[str, int]:
    """``"<mode>"`` or ``"<mode>@N"`` -> ``(mode, N)``: the sync is broken from the run's N-th weight
    update on (1 = every update; a run that resumes healthy and breaks later uses N > 1)."""
    text = (value or "none").strip() or "none"
    mode, _, start = text.partition("@")
    if mode not in BREAK_SYNC_CHOICES:
        raise ValueError(f"{ENV_BREAK_SYNC}={text!r}; allowed: {list(BREAK_SYNC_CHOICES)}, each optionally '@N'")
    try:
        first = int(start) if start else 1
    except ValueError:
        raise ValueError(f"{ENV_BREAK_SYNC}={text!r}: '@N' needs an integer N >= 1") from None
    if first < 1:
        raise ValueError(f"{ENV_BREAK_SYNC}={text!r}: '@N' needs an integer N >= 1")
    return mode, first


def truncate_eh(weights):
    """``truncate-eh-rank1``: the MTP ``eh_proj`` weight loses its last input column (a wrong shape)."""
    for name, t in weights:
        if name.startswith("mtp.") and name.endswith("eh_proj.weight"):
            t = t[:, :-1]
        yield name, t


def event(kind: str, **fields) -> None:
    """Append one event (a JSON line) to ``$VERL_CPU_EVENTS`` (nothing when unset)."""
    path = os.environ.get(ENV_EVENTS)
    if not path:
        return
    line = json.dumps({"event": kind, "pid": os.getpid(), "time": time.time(), **fields}, default=str)
    with open(path, "a") as f:
        f.write(line + "\n")


_PACKED_MAX: dict[str, int] = {}


def record_packed(kind: str, sequences: int, rows: int) -> None:
    """``kind`` event (``packed_attention``, ``packed_mamba``: a CPU stand-in ran a packed THD forward) when this
    process sees more sequences in one pack than before (a handful of lines per process, not one per layer)."""
    if not os.environ.get(ENV_EVENTS) or sequences <= _PACKED_MAX.get(kind, 0):
        return
    _PACKED_MAX[kind] = sequences
    event(kind, sequences=int(sequences), rows=int(rows))


def swap_eh(weights):
    """``swap-eh``: the MTP ``eh_proj`` weight's two input halves trade places in a weight stream (names,
    shapes and checksums stay valid; only generation can tell)."""
    for name, t in weights:
        if name.startswith("mtp.") and name.endswith("eh_proj.weight"):
            import torch

            h = t.shape[1] // 2
            t = torch.cat([t[:, h:], t[:, :h]], dim=1)
        yield name, t
