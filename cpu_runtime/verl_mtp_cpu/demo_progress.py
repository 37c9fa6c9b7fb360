"""What ``verl-mtp demo`` shows while a run of verl's trainer is under way: the phase the run is in (Ray, the
actor/ref workers, vLLM's server, the first weight sync, step k/N) and a line per finished step.

Each run is read from what it already writes (:func:`verl_mtp_cpu.run_recipe`): its log (the trainer's
stdout and stderr, one line each, prefixed with the run's seconds), the harness events (``<tag>.events.jsonl``:
the plugin's CPU hooks report there when a trainer worker starts, when vLLM's worker loads the plugin's worker
extension, and after each weight update) and verl's metrics file (one row per step). The plugin's own markers
come first; where a phase is told only by a line of verl or Ray, :data:`PHASES` names the line and the file that
prints it. A run whose output shows none of the markers (another verl, another Ray) still shows its elapsed time;
nothing read here ever stops the demo.

On a terminal each run has a ``tqdm`` bar (start-up phases, then steps) under the lines; elsewhere (CI, a pipe, a
file) only lines, one per phase change and step, and a line every :attr:`RunProgress.HEARTBEAT_S` while nothing
changes; never a carriage return.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import sys
import time
from collections.abc import Callable

__all__ = ["PHASES", "Phase", "RunProgress", "RunTracker"]


@dataclasses.dataclass(frozen=True)
class Phase:
    """A start-up phase: ``label`` says what the run does while in it; the run has reached it when its log shows
    one of ``log`` (substrings of a line, terminal colours removed) or the harness writes an event of a kind in
    ``events``."""

    key: str
    label: str
    log: tuple[str, ...] = ()
    events: tuple[str, ...] = ()


#: a run's phases in order. A marker of a later phase means the earlier ones are passed (each is shown).
PHASES: tuple[Phase, ...] = (
    Phase("launch", "starting verl's trainer (Hydra config, the plugin's start-up checks, Ray)"),
    Phase("ray", "Ray started; verl's task runner loads the data",
          log=(
              "Started a local Ray instance.",  # ray/_private/worker.py:2027 (ray.init starting a local cluster)
              # the plugin's task runner (verl_mtp_plugin/trainer/main_ppo.py: MTPTaskRunner, a Ray actor); Ray
              # prefixes every line an actor prints with "(<class> pid=N)"
              "(MTPTaskRunner pid=",
          )),
    Phase("workers", "building the actor/ref workers (Megatron through the plugin engine, loading the checkpoint)",
          log=("create worker group",),  # verl/trainer/ppo/v1/trainer_base.py:317 (logger.info, before the workers)
          events=("trainer_worker",)),  # cpu/workers.py: first thing in verl's TrainingWorker.__init__
    Phase("vllm", "actor/ref models loaded; starting vLLM's server",
          log=(
              "actor and ref model engine initialized",  # verl/trainer/ppo/v1/trainer_base.py:330 (logger.info)
              # verl's vLLM server actor (verl/workers/rollout/vllm_rollout/vllm_async_server.py:87), Ray's prefix,
              # or the plugin's subclass of it (verl_mtp_plugin/rollout/server.py), which verl's rollout starts
              "(vLLMHttpServer pid=",
              "(MTPvLLMHttpServer pid=",
          )),
    Phase("vllm_engine", "vLLM's worker loaded the plugin's worker extension; building the engine with the MTP drafter",
          events=("vllm_worker",)),  # cpu/vllm_extension.py, at import in vLLM's worker process
    Phase("sync", "vLLM's server ready; first weight sync (trainer -> vLLM's target and drafter)",
          log=(
              "LLMServerManager: [",  # verl/workers/rollout/llm_server.py:487 (print, the servers' addresses)
              "checkpoint engine manager initialized",  # verl/trainer/ppo/v1/trainer_base.py:388 (logger.info)
          )),
    Phase("train", "weights synced; training",
          events=("sync",)),  # the plugin's vLLM worker extension after each weight update (cpu/vllm_extension.py)
)
STARTUP = len(PHASES)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class RunTracker:
    """The state of one run as its output comes: the phase reached and the steps logged. Every ``feed_*`` returns
    what changed, in order: ``("phase", i)`` for each phase newly passed (index into :data:`PHASES`), ``("step",
    step, metrics)`` for each new step, and ``("done", steps)`` once the last step is logged."""

    def __init__(self, steps: int):
        self.steps = steps
        self.phase = 0
        self.done: list[int] = []
        self.finished = False

    def _reach(self, index: int) -> list[tuple]:
        out = [("phase", i) for i in range(self.phase + 1, index + 1)]
        self.phase = max(self.phase, index)
        return out

    def feed_log(self, line: str) -> list[tuple]:
        text = _ANSI.sub("", line)
        for i in range(len(PHASES) - 1, self.phase, -1):
            if any(m in text for m in PHASES[i].log):
                return self._reach(i)
        return []

    def feed_event(self, event: dict) -> list[tuple]:
        kind = event.get("event")
        for i in range(len(PHASES) - 1, self.phase, -1):
            if kind in PHASES[i].events:
                return self._reach(i)
        return []

    def feed_metrics(self, row: dict) -> list[tuple]:
        step = row.get("step")
        if not isinstance(step, int) or step in self.done:
            return []
        out = self._reach(STARTUP - 1)
        self.done.append(step)
        out.append(("step", step, row.get("data", {})))
        if not self.finished and len(self.done) >= self.steps:
            self.finished = True
            out.append(("done", len(self.done)))
        return out

    def now_doing(self) -> str:
        """What the run is doing now, in a few words."""
        if self.finished:
            return f"{len(self.done)}/{self.steps} steps done; saving the checkpoint, stopping Ray"
        if self.phase == STARTUP - 1:
            return f"step {len(self.done) + 1}/{self.steps} running (rollout, reward, actor update)"
        return PHASES[self.phase].label


class _Tail:
    """The complete lines a growing file gained since the last call (a file written anew starts over)."""

    def __init__(self, path: pathlib.Path):
        self.path, self.pos, self.rest = pathlib.Path(path), 0, b""

    def lines(self) -> list[str]:
        try:
            size = self.path.stat().st_size
        except OSError:
            return []
        if size < self.pos:
            self.pos, self.rest = 0, b""
        if size == self.pos:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.pos)
            data = f.read(size - self.pos)
        self.pos += len(data)
        *full, self.rest = (self.rest + data).split(b"\n")
        return [x.decode("utf-8", errors="replace") for x in full]


def _json_lines(tail: _Tail) -> list[dict]:
    out = []
    for line in tail.lines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


class RunProgress:
    """What one run shows while it runs (see the module docstring); ``enabled=False`` (``--no-progress``) shows
    nothing.

    Args:
        mode (str): the run's name in its lines (``[online] ...``).
        steps (int): the steps the run makes.
        log_path, events_path, metrics_path: the run's log, harness events and verl's metrics file.
        step_line: ``(step, metrics) -> str``, the line a finished step prints.
        enabled (bool): show anything.
        tty (bool | None): draw a bar (default: when ``stream`` is a terminal).
        position (int): the bar's row among the runs side by side.
        stream: where to write (default ``sys.stdout``, read at each write).
        clock: seconds (the run's elapsed time is ``clock() - clock()`` at construction).
    """

    HEARTBEAT_S = 30.0

    def __init__(self, mode: str, steps: int, *, log_path, events_path, metrics_path,
                 step_line: Callable[[int, dict], str], enabled: bool = True, tty: bool | None = None,
                 position: int = 0, stream=None, clock: Callable[[], float] = time.perf_counter):
        self.mode, self.steps, self.enabled, self.step_line = mode, steps, enabled, step_line
        self.stream, self.clock = stream, clock
        self.t0 = self.last = self.since = clock()
        self.tracker = RunTracker(steps)
        self.log, self.events, self.metrics = _Tail(log_path), _Tail(events_path), _Tail(metrics_path)
        self.broken = False
        self.bar = None
        if not enabled:
            return
        out = self._out()
        self.tty = bool(tty if tty is not None else getattr(out, "isatty", lambda: False)())
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=STARTUP - 1 + steps, position=position, leave=False, file=out,
                            dynamic_ncols=True, desc=self.tracker.now_doing(),
                            bar_format=f"[{mode}] {{elapsed}} |{{bar:20}}| {{n}}/{{total}} {{desc}}")
        self._line(f"start-up 1/{STARTUP}: {PHASES[0].label}")

    # ------------------------------------------------------------------ output

    def _out(self):
        return self.stream if self.stream is not None else sys.stdout

    def _write(self, text: str) -> None:
        if self.bar is not None:
            from tqdm import tqdm

            tqdm.write(text, file=self._out())
        else:
            print(text, file=self._out(), flush=True)

    def _line(self, what: str) -> None:
        self._write(f"[{self.mode}] {self.clock() - self.t0:5.0f} s  {what}")

    # ------------------------------------------------------------------ reading

    def poll(self) -> None:
        """Read what the run wrote since the last call and show what changed."""
        if not self.enabled:
            return
        now = self.clock()
        changed = False
        if not self.broken:
            try:
                changes = []
                for line in self.log.lines():
                    changes += self.tracker.feed_log(line)
                for event in _json_lines(self.events):
                    changes += self.tracker.feed_event(event)
                for row in _json_lines(self.metrics):
                    changes += self.tracker.feed_metrics(row)
                for change in changes:
                    self._show(change)
                changed = bool(changes)
            except Exception as e:  # noqa: BLE001 - what the run writes never stops the demo: elapsed time only
                self.broken = True
                self.last = now
                self._line(f"(progress: cannot read the run's output, {type(e).__name__}: {e}; elapsed time only)")
        if changed:
            self.last = self.since = now
        if self.bar is not None:
            self.bar.n = self.tracker.phase + len(self.tracker.done)
            self.bar.set_description_str(self.tracker.now_doing(), refresh=False)
            self.bar.refresh()
        elif now - self.last >= self.HEARTBEAT_S:
            self.last = now
            self._line("... verl's trainer is running" if self.broken else self._still(now - self.since))

    def _still(self, for_s: float) -> str:
        t = self.tracker
        if t.finished:
            return f"... still saving the checkpoint, stopping Ray (for {for_s:.0f} s)"
        if t.phase == STARTUP - 1:
            return f"... step {len(t.done) + 1}/{self.steps} running (for {for_s:.0f} s)"
        return f"... still in start-up {t.phase + 1}/{STARTUP} (for {for_s:.0f} s): {PHASES[t.phase].label}"

    def _show(self, change: tuple) -> None:
        kind = change[0]
        if kind == "phase":
            i = change[1]
            text = f"start-up {i + 1}/{STARTUP}: {PHASES[i].label}"
            if i == STARTUP - 1:
                text += f"; step 1/{self.steps} running (rollout, reward, actor update)"
            self._line(text)
        elif kind == "step":
            self._write(self.step_line(change[1], change[2]))
        elif kind == "done":
            self._line(f"{change[1]}/{self.steps} steps done; saving the checkpoint, stopping Ray")

    def close(self) -> None:
        """Remove the bar (the lines stay)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
