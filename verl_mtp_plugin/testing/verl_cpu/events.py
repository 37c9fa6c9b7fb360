"""Harness events: what the test-only vLLM worker extension reports from vLLM's worker process
(one JSON line per weight update in ``$VERL_CPU_EVENTS``), and the switch that breaks the drafter
sync on purpose (``$VERL_CPU_BREAK_SYNC``). Imports nothing heavy."""

from __future__ import annotations

import json
import os
import time

__all__ = ["BREAK_SYNC_CHOICES", "ENV_BREAK_SYNC", "ENV_EVENTS", "event"]

ENV_EVENTS = "VERL_CPU_EVENTS"
ENV_BREAK_SYNC = "VERL_CPU_BREAK_SYNC"
#: ``swap-eh``: the MTP ``eh_proj``'s two input halves trade places in what reaches vLLM (the demo's
#: ``--break-sync swap-eh``): names, shapes and checksums stay valid, only generation can tell;
#: ``skip-drafter``: the drafter is never loaded (it keeps its start-up weights) while the target follows
BREAK_SYNC_CHOICES = ("none", "swap-eh", "skip-drafter")


def event(kind: str, **fields) -> None:
    """Append one event (a JSON line) to ``$VERL_CPU_EVENTS`` (nothing when unset)."""
    path = os.environ.get(ENV_EVENTS)
    if not path:
        return
    line = json.dumps({"event": kind, "pid": os.getpid(), "time": time.time(), **fields}, default=str)
    with open(path, "a") as f:
        f.write(line + "\n")
