"""Where a mode run's start-up goes: the milestones of ``python -m verl_mtp_plugin.main_ppo`` up to its first step.

``run.py run`` keeps each mode's log (``<out>/<mode>.log``, every line prefixed with ``[ seconds]`` since the run
started) beside its ``summary.json``, and ``super_session.sh`` keeps the pretraining's ``assets.json`` and
``assets.log`` one folder up. From them, per run:

- when verl's Megatron worker and vLLM's server logged their first lines (the processes start one after another);
- when vLLM loaded the model, the seconds of its compile and profiling run (the first one holds vLLM's "Warming up
  Mamba2 SSD Triton kernels": Triton's autotuning of the SSD kernels), of its CUDA-graph capture, of its whole
  engine start (``init engine ... took``), and when that ended (lines logged at vLLM's INFO level:
  ``VLLM_LOGGING_LEVEL=INFO``; runs logged at verl's WARN lack them), when verl's agent-loop workers logged, and
  when vLLM went to sleep after the first rollout;
- when verl logged step 1, and step 1's own phases (its first log-prob pass, reference, update: Megatron's first
  kernels run there);
- the pretraining script's seconds and its first logged step's.

    python benchmarks/h200_main_ppo/startup.py milestones RUN.log [RUN.log ...] [--json OUT]

``spy`` reads ``spy_warmup.sh``'s py-spy samples of vLLM's worker through that profiling run (py-spy's raw format:
one ``frame;frame;... count`` line per stack): the share of samples in which each function is on the stack and on
its top, the biggest first; then the samples in Triton's compiler (``triton/compiler/compiler.py``'s ``compile``: a
kernel built, not found in Triton's cache) by the function that launched the kernel (the innermost frame in vLLM's
code, else the innermost outside Triton and torch), in seconds at the samples' rate. Gzipped samples are read too.

    python benchmarks/h200_main_ppo/startup.py spy spy_warmup.txt[.gz] [--top 25] [--rate 20]

``procs`` reads ``proc_cpu.py sample``'s samples of a lease (``proc_cpu.jsonl[.gz]``) from when ``main_ppo`` started
to ``--until`` seconds after: per process, when it first and last ran at half a core or more, and its CPU seconds,
in the order they started (a Ray worker named by the actor it took: ``ray::IDLE`` until then).

    python benchmarks/h200_main_ppo/startup.py procs proc_cpu.jsonl.gz [--until 180] [--min-cpu-s 2]
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # proc_cpu.py beside this script
    sys.path.insert(0, str(HERE))
from proc_cpu import read_jsonl  # noqa: E402

#: milestone -> (pattern on a log line, what is read: "at" (the line's seconds since the run started) or "value"
#: (the pattern's first group), which occurrence (0: the first))
MILESTONES = {
    # verl's processes, each at its first line: the Megatron worker, vLLM's server (its engine core and worker log
    # under it), then, once vLLM is up, verl's agent-loop workers (the rollout starts after them)
    "megatron_worker_at": (r"\(WorkerDict pid=", "at", 0),
    "vllm_server_at": (r"vLLMHttpServer pid=", "at", 0),
    "vllm_model_loaded_at": (r"Model loading took", "at", 0),
    "vllm_ssd_warmup_at": (r"Warming up Mamba2 SSD Triton kernels", "at", 0),
    "vllm_compile_profile_s": (r"torch\.compile and initial profiling/warmup run together took ([0-9.]+) s", "value", 0),
    "vllm_drafter_compile_profile_s": (
        r"torch\.compile and initial profiling/warmup run together took ([0-9.]+) s", "value", 1),
    "vllm_graphs_s": (r"Graph capturing finished in ([0-9.]+) secs", "value", 0),
    "vllm_init_engine_s": (r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s", "value", 0),
    "vllm_ready_at": (r"init engine \(profile, create kv cache, warmup model\) took", "at", 0),
    "agent_loops_at": (r"\(AgentLoopWorker\w* pid=", "at", 0),
    # vLLM drained and put to sleep: first after its start-up, then after each rollout
    "first_rollout_done_at": (r"Engines are idle, requests have been drained", "at", 1),
    "step1_logged_at": (r"\bstep:1 - ", "at", 0),
}
#: step 1's phases, verl's timing keys
STEP1 = {"step1_gen_s": "timing_s/gen", "step1_log_prob_s": "timing_s/old_log_prob", "step1_ref_s": "timing_s/ref",
         "step1_update_s": "timing_s/update_actor", "step1_s": "timing_s/step"}
ROWS = [*MILESTONES, *STEP1, "pretraining_s", "pretraining_step1_s"]
_AT = re.compile(r"^\[\s*([0-9.]+)s\]")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


#: vLLM's worker process as its lines are prefixed: ``Worker``, or ``Worker_TP1_EP1`` and the like with parallelism
#: (not verl's ``WorkerDict``)
_WORKER = re.compile(r"\(Worker(?:_[A-Za-z0-9_]+)? pid=(\d+)\)")
#: vLLM's server process (verl's ``vLLMHttpServer`` actor, one per rollout replica): a line it logs outside a worker
#: is counted in it
_SERVER = re.compile(r"vLLMHttpServer pid=(\d+)\)")


def milestones(lines) -> dict:
    """The log's milestones (:data:`MILESTONES`); ``None`` where the log has no such line. A milestone's occurrences
    are counted in the process that logged its first one (vLLM's ``Worker pid=``, else its server's): with vLLM's
    tensor parallelism each worker logs its own compile line, and the drafter's is its first worker's second; with
    several rollout replicas each server drains once after its start-up, and the first rollout's end is the first
    server's second drain (a run that validates before training would drain once more before it)."""
    seen: dict[str, list[tuple[float, str | None]]] = {name: [] for name in MILESTONES}
    compiled = {name: re.compile(pattern) for name, (pattern, _, _) in MILESTONES.items()}
    for raw in lines:
        line = _ANSI.sub("", raw)
        at = _AT.match(line)
        proc = _WORKER.search(line) or _SERVER.search(line)
        pid = proc.group(1) if proc else None
        for name, (_, what, _) in MILESTONES.items():
            m = compiled[name].search(line)
            if m is None:
                continue
            if what == "at":
                if at:
                    seen[name].append((float(at.group(1)), pid))
            else:
                seen[name].append((float(m.group(1)), pid))
    out = {}
    for name, (_, _, nth) in MILESTONES.items():
        first = seen[name][0][1] if seen[name] else None
        same = [v for v, pid in seen[name] if pid == first]
        out[name] = same[nth] if len(same) > nth else None
    return out


def step1(summary: dict) -> dict:
    """Step 1's phases (:data:`STEP1`) of the summary's one mode run."""
    runs = list((summary.get("runs") or {}).values())
    first = ((runs[0].get("metrics") or {}).get("1") or {}) if runs else {}
    return {name: first.get(key) for name, key in STEP1.items()}


def pretraining(folder: pathlib.Path) -> dict:
    """The pretraining's seconds (``assets.json``) and its first logged step's (``assets.log``)."""
    out = {"pretraining_s": None, "pretraining_step1_s": None}
    assets = folder / "assets.json"
    if assets.is_file():
        out["pretraining_s"] = json.loads(assets.read_text()).get("seconds")
    log = folder / "assets.log"
    if log.is_file():
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"step": 1,' in line:
                out["pretraining_step1_s"] = json.loads(line).get("seconds")
                break
    return out


def lease_folder(log: pathlib.Path) -> pathlib.Path:
    """The folder of the lease whose run wrote ``log`` (``<lease>/run/<mode>.log`` as the results keep it; a lease's
    second run on its warm machine in ``<lease>/run2/``)."""
    return log.parent.parent if re.fullmatch(r"run\d*", log.parent.name) else log.parent


def run_name(log: pathlib.Path) -> str:
    """A run's column: its lease (``<lease>/run/``), the lease and its run (``<lease>/run2/``), else the log's name."""
    parent = log.parent.name
    if parent == "run":
        return lease_folder(log).name
    return f"{lease_folder(log).name}/{parent}" if re.fullmatch(r"run\d+", parent) else log.stem


def startup(log: pathlib.Path) -> dict:
    """Every row of :data:`ROWS` for the run whose log this is."""
    out = milestones(log.read_text(errors="replace").splitlines())
    summary = log.parent / "summary.json"
    out.update(step1(json.loads(summary.read_text())) if summary.is_file() else dict.fromkeys(STEP1))
    out.update(pretraining(lease_folder(log)))
    return out


def _stacks(lines):
    """py-spy's raw lines (``frame;frame;... count``) as ``(frames, count)``, each frame ``function (file)`` without
    its line number; other lines skipped."""
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if stack and count.isdigit():
            yield [re.sub(r":\d+\)$", ")", f.strip()) for f in stack.split(";") if f.strip()], int(count)


def spy(lines) -> dict:
    """py-spy's raw samples (``frame;frame;... count``, each frame ``function (file:line)``) as each function's
    samples on the stack (``inclusive``, once per stack) and on its top (``self``), functions named without their
    line, and the samples in all."""
    inclusive: dict[str, int] = {}
    self_: dict[str, int] = {}
    total = 0
    for frames, n in _stacks(lines):
        total += n
        for f in set(frames):
            inclusive[f] = inclusive.get(f, 0) + n
        if frames:
            self_[frames[-1]] = self_.get(frames[-1], 0) + n
    return {"samples": total, "inclusive": inclusive, "self": self_}


#: a frame of Triton's compiler: the sample is spent building a kernel that Triton's cache did not hold
TRITON_COMPILE = "compile (triton/compiler/compiler.py)"
_LIBRARY = ("triton/", "torch/")


def _launcher(frames: list[str]) -> str:
    """The function that launched the kernel being compiled: the innermost frame in vLLM's code, else the innermost
    frame outside Triton's and torch's, else ``?``."""
    below = frames[:frames.index(TRITON_COMPILE)]
    for f in reversed(below):
        if "(vllm/" in f:
            return f
    for f in reversed(below):
        if not any(f"({lib}" in f for lib in _LIBRARY):
            return f
    return "?"


def triton_compile(lines) -> dict:
    """py-spy's raw samples in Triton's compiler (:data:`TRITON_COMPILE` on the stack), by the function that
    launched the kernel (:func:`_launcher`), and the samples in all."""
    by: dict[str, int] = {}
    total = 0
    for frames, n in _stacks(lines):
        total += n
        if TRITON_COMPILE in frames:
            key = _launcher(frames)
            by[key] = by.get(key, 0) + n
    return {"samples": total, "by_launcher": by}


def _read_lines(path: str) -> list[str]:
    p = pathlib.Path(path)
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    return raw.decode(errors="replace").splitlines()


#: a sample this busy (percent of one core) counts towards a process's first and last busy times
BUSY_PCT = 50.0


def _name_rank(name: str) -> tuple[int, int]:
    """A Ray actor's name (``ray::Class.method``) names a process best, then the longest command line, then
    ``ray::IDLE`` (a Ray worker before it takes an actor)."""
    actor = name.startswith("ray::") and name != "ray::IDLE"
    return (2 if actor else 0 if name == "ray::IDLE" else 1, len(name))


def procs(rows: list[dict], until: float, min_cpu_s: float = 2.0) -> list[dict]:
    """Per process (pid) from ``main_ppo``'s first sample to ``until`` seconds after it: ``name`` (the best it had,
    :func:`_name_rank`: a process's short name and its command line alternate in the samples), ``first`` / ``last``
    (seconds of its first and last sample at :data:`BUSY_PCT` or more), ``cpu_s`` (CPU seconds); for those with
    ``min_cpu_s`` or more that were busy at least once, by ``first``."""
    t0 = next((r["t"] for r in rows if any("verl_mtp_plugin.main_ppo" in k for k in r["cpu"])), None)
    if t0 is None:
        raise ValueError("no sample of verl_mtp_plugin.main_ppo")
    seen: dict[str, dict] = {}
    for r in rows:
        at = r["t"] - t0
        if at < 0 or at > until:
            continue
        for key, pct in r["cpu"].items():
            pid, _, name = key.partition(" ")
            p = seen.setdefault(pid, {"pid": pid, "name": name, "first": None, "last": None, "cpu_s": 0.0})
            if _name_rank(name) > _name_rank(p["name"]):
                p["name"] = name
            p["cpu_s"] += pct / 100.0 * r.get("dt", 0.0)
            if pct >= BUSY_PCT:
                p["first"] = at if p["first"] is None else p["first"]
                p["last"] = at
    out = [p for p in seen.values() if p["cpu_s"] >= min_cpu_s and p["first"] is not None]
    return sorted(out, key=lambda p: p["first"])


def _cell(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def cmd_milestones(a) -> int:
    res = {}
    for path in a.logs:
        p = pathlib.Path(path)
        if not p.is_file():
            raise SystemExit(f"no such log: {path}")
        res[path] = startup(p)
    names = [run_name(pathlib.Path(p)) for p in a.logs]
    print("| seconds | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for row in ROWS:
        print(f"| {row} | " + " | ".join(_cell(res[p][row]) for p in a.logs) + " |")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


def cmd_spy(a) -> int:
    lines = _read_lines(a.samples)
    res = spy(lines)
    if not res["samples"]:
        raise SystemExit(f"no py-spy samples in {a.samples}")
    for kind in ("inclusive", "self"):
        print(f"| {kind}: share of {res['samples']} samples | function |")
        print("|---|---|")
        for f, n in sorted(res[kind].items(), key=lambda kv: -kv[1])[:a.top]:
            print(f"| {n / res['samples']:.3f} | `{f}` |")
        print()
    comp = triton_compile(lines)
    built = sum(comp["by_launcher"].values())
    print(f"| Triton compiling: {built} of {comp['samples']} samples ({built / comp['samples']:.3f}, "
          f"{built / a.rate:.1f} s at {a.rate:g} per second), by the function that launched the kernel | samples "
          "| s |")
    print("|---|---|---|")
    for f, n in sorted(comp["by_launcher"].items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"| `{f}` | {n} | {n / a.rate:.1f} |")
    return 0


def cmd_procs(a) -> int:
    got = procs(read_jsonl(a.samples), a.until, a.min_cpu_s)
    print(f"| process (first {a.until:g} s of main_ppo) | busy from s | to s | CPU s |")
    print("|---|---|---|---|")
    for p in got:
        print(f"| {p['pid']} `{p['name'][:70]}` | {p['first']:.1f} | {p['last']:.1f} | {p['cpu_s']:.1f} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("milestones", help="each run's start-up milestones from its log, summary and pretraining")
    m.add_argument("logs", nargs="+", help="a mode run's log (run.py run's <out>/<mode>.log)")
    m.add_argument("--json", help="write every run's rows here")
    s = sub.add_parser("spy", help="which functions hold vLLM's profiling run (spy_warmup.sh's py-spy samples)")
    s.add_argument("samples")
    s.add_argument("--top", type=int, default=25)
    s.add_argument("--rate", type=float, default=20.0, help="samples per second (spy_warmup.sh records 20)")
    pr = sub.add_parser("procs", help="which processes ran, when, through main_ppo's start-up (proc_cpu.py's samples)")
    pr.add_argument("samples")
    pr.add_argument("--until", type=float, default=180.0, help="seconds after main_ppo started")
    pr.add_argument("--min-cpu-s", type=float, default=2.0)
    a = ap.parse_args(argv)
    return {"milestones": cmd_milestones, "spy": cmd_spy, "procs": cmd_procs}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
