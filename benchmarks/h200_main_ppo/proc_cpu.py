"""Which process holds verl's rollout: every process's CPU use, sampled from ``/proc`` while a mode's run goes on.

``sample OUT.jsonl``: every ``--interval`` seconds, each process's CPU time (user + system, all its threads) and
its name: the start of ``/proc/<pid>/cmdline``, where Ray's actors name themselves (``ray::vLLMHttpServer``,
``ray::AgentLoopWorker``, ...) and vLLM its engine core (``VLLM::EngineCore``). One JSON line per sample holds the
processes that used the CPU in the interval: ``{"t": seconds, "dt": seconds, "cpu": {"pid name": percent of one
core}}``. It runs until ``--seconds`` pass or it is killed (``super_session.sh`` starts it beside ``run.py run``).

``summary OUT.jsonl``: the samples in which the ``--busy`` process (default: vLLM's engine core) used at least
``--min`` percent of a core are the rollout's (its engine core waits without the CPU while vLLM sleeps, between
rollouts); for each process name, its mean CPU percent over those samples and the share of them it spent at or
above ``--pinned`` percent (a process at ~100 % of one core through a rollout is single-thread bound: a Python front
end at 100 % sets the rollout's pace, whatever the GPU does). Processes are grouped by name (pids dropped), so two
agent-loop workers show as one name with their mean per process.

Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

_TICKS = os.sysconf("SC_CLK_TCK")


def _name(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        raw = ""
    if not raw:
        try:
            with open(f"/proc/{pid}/comm") as f:
                raw = f.read().strip()
        except OSError:
            raw = "?"
    return raw[:80]


def cpu_ticks() -> dict[str, int]:
    """Every process's user + system CPU ticks so far, by pid."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3 of stat(5)
        out[pid] = int(fields[11]) + int(fields[12])  # utime, stime
    return out


def sample(out_path: str, interval: float, seconds: float | None) -> int:
    end = time.monotonic() + seconds if seconds is not None else float("inf")
    prev, t_prev = cpu_ticks(), time.monotonic()
    with open(out_path, "a") as out:
        while time.monotonic() < end:
            time.sleep(interval)
            now, t = cpu_ticks(), time.monotonic()
            dt = t - t_prev
            cpu = {}
            for pid, ticks in now.items():
                used = ticks - prev.get(pid, ticks)
                if used > 0:  # the name read again every time: a process renames itself after it starts
                    cpu[f"{pid} {_name(pid)}"] = round(100.0 * used / _TICKS / dt, 1)
            out.write(json.dumps({"t": round(time.time(), 2), "dt": round(dt, 3), "cpu": cpu}) + "\n")
            out.flush()
            prev, t_prev = now, t
    return 0


def group(key: str) -> str:
    """A sample key's process name without its pid, Ray's method suffix or arguments: ``ray::vLLMHttpServer``."""
    name = key.split(" ", 1)[1] if " " in key else key
    words = name.split()
    if not words:
        return name
    if os.path.basename(words[0]).startswith("python"):  # a plain Python process: its script or module
        return " ".join([os.path.basename(words[0]), *words[1:3]])
    return re.sub(r"^(ray::[A-Za-z_]+)\..*$", r"\1", words[0])


def summarize(samples: list[dict], busy: str, minimum: float, pinned: float) -> dict:
    """The rollout's samples (``busy``'s process at >= ``minimum`` percent) and, per process name, the mean CPU
    percent of one core per process over them and the share of (sample, process) pairs at >= ``pinned``."""
    # a process that renamed itself (vLLM's engine core after its spawn) is known by its last name
    last_key = {k.split(" ", 1)[0]: k for s in samples for k in s["cpu"]}
    last = {pid: group(k) for pid, k in last_key.items()}
    rollout = [s for s in samples if any(busy in last_key[k.split(" ", 1)[0]] and v >= minimum
                                         for k, v in s["cpu"].items())]
    per: dict[str, list[float]] = {}
    for s in rollout:
        for k, v in s["cpu"].items():
            per.setdefault(last[k.split(" ", 1)[0]], []).append(v)
    # a process absent from a sample used no CPU in it: its mean is over every rollout sample it could be in
    procs = {name: len({k.split(" ", 1)[0] for s in rollout for k in s["cpu"] if last[k.split(" ", 1)[0]] == name})
             for name in per}
    rows = {}
    for name, vs in per.items():
        n = len(rollout) * procs[name]
        rows[name] = {"processes": procs[name], "mean_pct": sum(vs) / n if n else 0.0,
                      "max_pct": max(vs), "pinned_share": sum(v >= pinned for v in vs) / n if n else 0.0}
    rows = dict(sorted(rows.items(), key=lambda kv: -kv[1]["mean_pct"]))
    return {"samples": len(samples), "rollout_samples": len(rollout), "busy": busy, "min_pct": minimum,
            "pinned_pct": pinned, "interval_s": statistics.median(s["dt"] for s in samples) if samples else None,
            "processes": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample", help="sample every process's CPU use into a JSONL file")
    s.add_argument("out")
    s.add_argument("--interval", type=float, default=0.5)
    s.add_argument("--seconds", type=float, default=None)
    m = sub.add_parser("summary", help="per process name, CPU use over the rollout's samples")
    m.add_argument("samples")
    m.add_argument("--busy", default="EngineCore", help="the process whose CPU use marks a rollout")
    m.add_argument("--min", type=float, default=50.0, dest="minimum")
    m.add_argument("--pinned", type=float, default=90.0)
    m.add_argument("--top", type=int, default=12)
    m.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.cmd == "sample":
        if a.interval <= 0:
            ap.error(f"--interval must be > 0, got {a.interval}")
        return sample(a.out, a.interval, a.seconds)
    with open(a.samples) as f:
        samples = [json.loads(line) for line in f if line.strip()]
    res = summarize(samples, a.busy, a.minimum, a.pinned)
    print(f"{res['rollout_samples']} of {res['samples']} samples with {a.busy} at >= {a.minimum:g} % "
          f"(interval {res['interval_s']} s)")
    print(f"| process | processes | mean % of a core | max % | share at >= {a.pinned:g} % |")
    print("|---|---|---|---|---|")
    for name, r in list(res["processes"].items())[: a.top]:
        print(f"| {name} | {r['processes']} | {r['mean_pct']:.1f} | {r['max_pct']:.1f} | {r['pinned_share']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
