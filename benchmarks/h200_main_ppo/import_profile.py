"""What each of verl's processes pays to import its libraries on a machine, before it does any work.

verl starts its processes one after another at start-up (the driver, its task runner, the actor workers, vLLM's
server, the agent loops); each imports torch and verl first, and on the GPU leases each took ~24-29 s from its start
to its first line (RESULTS, "Start-up on a warm machine"). ``run`` times ``python -X importtime`` of what they
import, one fresh process per statement, in two rounds (their spread; the pretraining has read most of the files
by then, as verl's processes find them). ``super_session.sh start`` runs it in the background while the checkpoint
pretrains (the GPU busy, one of the host's cores busy with the pretraining's loop) and stops it before ``main_ppo``
starts: the figures are a host's with one busy core, not an idle one's.

    python benchmarks/h200_main_ppo/import_profile.py run OUT [--rounds 2] [--timeout 300]

``report`` prints, per statement and round, the wall seconds of the process and where its import time went: the
modules' own ("self") import time summed by top-level package, the largest first.

    python benchmarks/h200_main_ppo/import_profile.py report OUT [--top 6] [--json FILE]

The processes see the benchmark's stand-in hooks (``pythonpath/``), the repository and the CPU runtime before the
installed stack, as ``run.py run``'s do, and ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import re
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]

#: the plugin's driver: ``python -m verl_mtp_plugin.main_ppo``'s start-up check on the shipped recipe (it probes
#: vLLM's and megatron's internals, so it imports them)
PLUGIN_CHECK = "\n".join([
    "import verl_mtp_plugin.trainer.main_ppo as m",
    "from verl_mtp_plugin.recipe_paths import CONFIG_DIR",
    "from verl_mtp_plugin.trainer.config import compose_recipe",
    "m.check(compose_recipe(str(CONFIG_DIR), 'grpo_online', ['trainer.resume_mode=disable']))",
])
#: name -> statement, in the order they run
STATEMENTS = {
    "python": "pass",
    "torch": "import torch",
    "transformer_engine": "import transformer_engine.pytorch",
    "megatron": "import megatron.core",
    "vllm": "import vllm",
    "verl_driver": "import verl.trainer.main_ppo",  # verl's own driver
    "verl_engines": "import verl.workers.engine",  # verl's engine registry: its Ray processes import it
    "plugin_check": PLUGIN_CHECK,
}
# "import time:       self [us] |  cumulative | imported package" (the name indented two spaces per level)
_LINE = re.compile(r"^import time:\s+(\d+)\s+\|\s+(\d+)\s+\|(\s*)(\S+)\s*$")


def environment() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "pythonpath"), str(REPO), str(REPO / "cpu_runtime"),
                                                      env.get("PYTHONPATH")]))
    env["HF_HUB_OFFLINE"] = "1"
    return env


def run(out: pathlib.Path, statements: dict[str, str], rounds: int, timeout: float, python: str) -> list[dict]:
    """Each statement in a fresh ``python -X importtime -c`` process, ``rounds`` times over the list; the process's
    stderr kept as ``<name>_<round>.importtime``, one row per process written to ``walls.jsonl`` as it ends (so a
    profile stopped midway keeps what ran; a new profile starts the file afresh)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "walls.jsonl").write_text("")  # this profile's rows only
    env, rows = environment(), []
    for rnd in range(1, rounds + 1):
        for name, stmt in statements.items():
            t0 = time.monotonic()
            try:
                proc = subprocess.run([python, "-X", "importtime", "-c", stmt], env=env, capture_output=True,
                                      text=True, timeout=timeout)
                rc, err = proc.returncode, proc.stderr
            except subprocess.TimeoutExpired as e:
                rc, err = "timeout", (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else
                                      (e.stderr or ""))
            row = {"name": name, "round": rnd, "rc": rc, "wall_s": round(time.monotonic() - t0, 3)}
            (out / f"{name}_{rnd}.importtime").write_text(err)
            with open(out / "walls.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            rows.append(row)
    return rows


def by_package(text: str) -> tuple[dict[str, float], float]:
    """``({top-level package: seconds of its modules' own import time}, the statement's total import seconds)``
    from ``-X importtime`` output (other stderr lines are ignored)."""
    own: dict[str, float] = {}
    total = 0.0
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        self_us, cum_us, indent, name = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        top = name.split(".")[0]
        own[top] = own.get(top, 0.0) + self_us / 1e6
        if len(indent) <= 1:  # a module the statement itself imported: its cumulative time counts once
            total += cum_us / 1e6
    return own, total


def report(out: pathlib.Path, top: int) -> list[dict]:
    rows = []
    for line in (out / "walls.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        f = out / f"{row['name']}_{row['round']}.importtime"
        gz = f.with_name(f.name + ".gz")  # as committed under benchmarks/results
        text = f.read_text(errors="replace") if f.exists() else (
            gzip.decompress(gz.read_bytes()).decode(errors="replace") if gz.exists() else None)
        own, total = by_package(text or "")
        row["import_s"] = None if text is None else round(total, 3)  # None: its -X importtime output is not there
        row["top"] = [[k, round(v, 3)] for k, v in sorted(own.items(), key=lambda kv: -kv[1])[:top]]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="time each statement's imports in fresh processes")
    r.add_argument("out", type=pathlib.Path)
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--timeout", type=float, default=300.0, help="seconds per process")
    r.add_argument("--only", default=None, help="comma-separated statement names (default: all)")
    r.add_argument("--python", default=sys.executable)
    p = sub.add_parser("report", help="per process: wall seconds and import seconds by top-level package")
    p.add_argument("out", type=pathlib.Path)
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--json", type=pathlib.Path, default=None)
    a = ap.parse_args(argv)
    if a.cmd == "run":
        names = a.only.split(",") if a.only else list(STATEMENTS)
        unknown = [n for n in names if n not in STATEMENTS]
        if unknown:
            ap.error(f"unknown statement(s) {unknown}; known: {', '.join(STATEMENTS)}")
        for row in run(a.out, {n: STATEMENTS[n] for n in names}, a.rounds, a.timeout, a.python):
            print(json.dumps(row), flush=True)
        return 0
    rows = report(a.out, a.top)
    print("| process | round | rc | wall s | import s | import s by package (own time), largest first |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in row["top"])
        imp = "n/a" if row["import_s"] is None else f"{row['import_s']:.2f}"
        print(f"| {row['name']} | {row['round']} | {row['rc']} | {row['wall_s']:.2f} | {imp} | {parts} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
