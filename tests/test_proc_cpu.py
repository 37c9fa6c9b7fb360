"""``benchmarks/h200_main_ppo/proc_cpu.py``: the per-process CPU sampler of the verl-trainer leases, and its summary
over the rollout's samples."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("proc_cpu", ROOT / "benchmarks" / "h200_main_ppo" / "proc_cpu.py")
proc_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(proc_cpu)


def test_names_group_ray_actors_vllms_engine_core_and_python_processes():
    assert proc_cpu.group("12 ray::vLLMHttpServer.generate") == "ray::vLLMHttpServer"
    # verl's front end and the plugin's subclass of it play the same part
    assert proc_cpu.role("12 ray::vLLMHttpServer.generate", set()) == proc_cpu.role("3 ray::MTPvLLMHttpServer", set())
    assert proc_cpu.role("3 ray::MTPvLLMHttpServer", set()) == proc_cpu.FRONT_END
    assert proc_cpu.group("13 ray::AgentLoopWorker") == "ray::AgentLoopWorker"
    assert proc_cpu.group("14 VLLM::EngineCore") == "VLLM::EngineCore"
    assert proc_cpu.group("15 /opt/venv/bin/python3 -m verl_mtp_plugin.main_ppo --x y") == "python3 -m verl_mtp_plugin.main_ppo"


def test_the_summary_reads_only_the_rollouts_samples_and_counts_absent_processes_as_idle():
    samples = [  # 2 rollout samples (engine core busy), 1 between rollouts
        {"t": 0, "dt": 0.5, "cpu": {"1 VLLM::EngineCore": 99.0, "2 ray::vLLMHttpServer.generate": 100.0,
                                    "3 ray::AgentLoopWorker": 40.0, "4 ray::AgentLoopWorker": 20.0}},
        {"t": 1, "dt": 0.5, "cpu": {"1 VLLM::EngineCore": 98.0, "2 ray::vLLMHttpServer.generate": 80.0,
                                    "3 ray::AgentLoopWorker": 60.0}},
        {"t": 2, "dt": 0.5, "cpu": {"1 VLLM::EngineCore": 2.0, "5 ray::WorkerDict": 300.0}},
    ]
    # the engine core's first sample, before it renamed itself, is filed under its last name
    samples[0]["cpu"]["1 python -B -c from multiprocessing.spawn import spawn_main"] = samples[0]["cpu"].pop(
        "1 VLLM::EngineCore")
    res = proc_cpu.summarize(samples, "EngineCore", 50.0, 90.0)
    assert (res["samples"], res["rollout_samples"], res["interval_s"]) == (3, 2, 0.5)
    p = res["processes"]
    assert "ray::WorkerDict" not in p  # busy only between rollouts
    assert p["ray::vLLMHttpServer"] == {"processes": 1, "mean_pct": 90.0, "max_pct": 100.0, "pinned_share": 0.5}
    # two workers over two samples, one absent from the second: (40 + 20 + 60 + 0) / 4
    assert p["ray::AgentLoopWorker"]["processes"] == 2 and p["ray::AgentLoopWorker"]["mean_pct"] == 30.0
    assert list(p)[:2] == ["VLLM::EngineCore", "ray::vLLMHttpServer"]  # by mean, highest first
    assert p["VLLM::EngineCore"]["mean_pct"] == 98.5 and len(p) == 3


def test_sampling_sees_a_busy_process_use_the_cpu_and_an_idle_one_not(tmp_path):
    busy = subprocess.Popen([sys.executable, "-c", "#proc-cpu-test-busy\nprint('ready', flush=True)\nwhile True: pass"],
                            stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", "#proc-cpu-test-idle\nimport time\nprint('ready', flush=True)\n"
                             "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout.readline() == idle.stdout.readline() == "ready\n"  # both past the interpreter's start
        out = tmp_path / "cpu.jsonl"
        before = proc_cpu.cpu_ticks()
        assert proc_cpu.main(["sample", str(out), "--interval", "0.25", "--seconds", "2"]) == 0
        after = proc_cpu.cpu_ticks()
    finally:
        busy.kill(), idle.kill()
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(samples) >= 4 and all(s["dt"] >= 0.25 for s in samples)
    assert any(s["ppid"].get(str(busy.pid)) == str(os.getpid()) for s in samples)  # its parent: this process

    def sampled_s(pid):  # the CPU seconds the samples give the process (absent from a sample: none in it)
        return sum(v / 100 * s["dt"] for s in samples for k, v in s["cpu"].items() if k.startswith(f"{pid} "))

    def actual_s(pid):  # what the kernel counted for it over the same window, from outside the sampler
        return (after[str(pid)] - before[str(pid)]) / proc_cpu._TICKS

    # the samples account for the busy process's CPU time over the window (whatever share of a core a loaded
    # machine gave it), within a few clock ticks at the window's two ends; the idle one used none
    assert actual_s(busy.pid) > 0.02
    assert sampled_s(busy.pid) == pytest.approx(actual_s(busy.pid), abs=0.06)
    assert actual_s(idle.pid) < 0.03 and sampled_s(idle.pid) < 0.03
    assert any("proc-cpu-test-busy" in k for s in samples for k in s["cpu"])  # named by its command line
    res = proc_cpu.summarize(samples, "proc-cpu-test-busy", 0.1, 90.0)
    assert res["rollout_samples"] >= 1
    assert proc_cpu.main(["summary", str(out), "--busy", "proc-cpu-test-busy", "--min", "0.1",
                          "--json", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["rollout_samples"] == res["rollout_samples"]
    # the host's CPU by kind in every sample: the shares of all its CPUs add up, the busy process shows in them
    hosts = [s["host"] for s in samples]
    assert all(h["cores"] == os.cpu_count() for h in hosts)
    assert all(h["busy"] + h["idle"] + h["steal"] == pytest.approx(100.0, abs=0.05) for h in hosts)
    assert min(h["busy"] for h in hosts) > 0.5 * 100 / os.cpu_count()  # at least half of the busy one's core


def test_the_hosts_shares_come_from_proc_stat_and_the_summary_averages_them_over_the_rollout(tmp_path, capsys):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 50 0 25 400 5 0 0 20 0 0\ncpu1 50 0 25 400 5 0 0 20 0 0\n"
                    "intr 1\n")
    before, cores = proc_cpu.host_ticks(str(stat))
    assert cores == 2 and before == {"user": 100, "nice": 0, "system": 50, "idle": 800, "iowait": 10, "irq": 0,
                                     "softirq": 0, "steal": 40}
    after = {**before, "user": 160, "system": 70, "idle": 890, "steal": 70}  # +60 +20 +90 +30: 200 ticks
    assert proc_cpu.host_shares(before, after) == {"busy": 40.0, "idle": 45.0, "steal": 15.0}
    assert proc_cpu.host_shares(before, before) == {"busy": 0.0, "idle": 0.0, "steal": 0.0}
    samples = [{"t": 1, "dt": 0.5, "cpu": {"7 VLLM::EngineCore": 99.0}, "host": {"busy": 40, "idle": 50, "steal": 10,
                                                                               "cores": 2}},
               {"t": 2, "dt": 0.5, "cpu": {"7 VLLM::EngineCore": 95.0}, "host": {"busy": 60, "idle": 40, "steal": 0,
                                                                               "cores": 2}},
               {"t": 3, "dt": 0.5, "cpu": {"8 ray::WorkerDict": 80.0}, "host": {"busy": 50, "idle": 0, "steal": 50,
                                                                              "cores": 2}}]
    res = proc_cpu.summarize(samples, "EngineCore", 50.0, 90.0)
    assert res["host"] == {"cores": 2, "samples": 2, "busy": 50.0, "idle": 45.0, "steal": 5.0, "steal_max": 10}
    f = tmp_path / "s.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in samples))
    assert proc_cpu.main(["summary", str(f)]) == 0
    assert ("host over those samples (2 with it): 2 CPUs, busy 50.0 % of all, idle 45.0 %, stolen by the hypervisor "
            "5.00 % (at most 10.00 %)") in capsys.readouterr().out
    # samples from before the host was recorded: no host line
    assert proc_cpu.summarize([{k: v for k, v in x.items() if k != "host"} for x in samples], "EngineCore", 50.0,
                              90.0)["host"] is None


def test_sampling_refuses_an_interval_that_is_not_positive(tmp_path):
    with pytest.raises(SystemExit):
        proc_cpu.main(["sample", str(tmp_path / "x.jsonl"), "--interval", "0"])
    assert not (tmp_path / "x.jsonl").exists()


def test_the_sync_events_name_the_vllm_worker_and_mark_the_rollout_from_the_first_sync(tmp_path):
    # the GPU host: vLLM's processes keep their spawn command line; the plugin's sync events name the worker that
    # took the weights, its busy samples after the first sync are the rollout's (vLLM's start-up, before, is not)
    spawn = "python3 -B -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)"
    samples = [
        {"t": 5.0, "dt": 0.5, "cpu": {f"7 {spawn}": 100.0, f"6 {spawn}": 30.0}},  # compiling, before the sync
        {"t": 11.0, "dt": 0.5, "cpu": {f"7 {spawn}": 100.0, f"6 {spawn}": 100.0, "2 ray::vLLMHttpServer": 90.0},
         "ppid": {"7": "6", "6": "2", "2": "1"}},
        {"t": 11.5, "dt": 0.5, "cpu": {f"7 {spawn}": 96.0, f"6 {spawn}": 60.0, "2 ray::vLLMHttpServer": 50.0}},
        {"t": 12.0, "dt": 0.5, "cpu": {f"7 {spawn}": 2.0, "3 ray::WorkerDict": 100.0}},  # asleep: an update
        {"t": 13.0, "dt": 0.5, "cpu": {"6 python3": 1.0}},  # exiting: /proc/<pid>/comm's bare name
    ]
    (tmp_path / "s.jsonl.gz").write_bytes(__import__("gzip").compress(
        "".join(json.dumps(s) + "\n" for s in samples).encode()))
    events = [{"event": "sync", "pid": 7, "time": 10.0, "update": 1}, {"event": "sync", "pid": 7, "time": 12.5}]
    (tmp_path / "ev.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert proc_cpu.sync_pids(events) == {"7"}
    out = tmp_path / "sum.json"
    assert proc_cpu.main(["summary", str(tmp_path / "s.jsonl.gz"), "--events", str(tmp_path / "ev.jsonl"),
                          "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (res["samples"], res["rollout_samples"], res["busy"]) == (4, 2, proc_cpu.WORKER)
    p = res["processes"]
    assert p[proc_cpu.WORKER]["mean_pct"] == 98.0 and p[proc_cpu.WORKER]["pinned_share"] == 1.0
    # the other spawned process, named by its command line (not the exit's bare "python3") and its parent
    assert p["python3 -B -c (child of ray::vLLMHttpServer)"]["mean_pct"] == 80.0
    assert "ray::WorkerDict" not in p
    # without the events, no process of this host is named EngineCore: nothing marks a rollout
    assert proc_cpu.summarize(samples, "EngineCore", 50.0, 90.0)["rollout_samples"] == 0


def test_the_summary_refuses_events_without_a_sync_pid(tmp_path):
    (tmp_path / "s.jsonl").write_text(json.dumps({"t": 1.0, "dt": 0.5, "cpu": {}}) + "\n")
    (tmp_path / "ev.jsonl").write_text(json.dumps({"event": "drift", "time": 1.0}) + "\n")
    with pytest.raises(SystemExit):
        proc_cpu.main(["summary", str(tmp_path / "s.jsonl"), "--events", str(tmp_path / "ev.jsonl")])


def test_the_committed_second_online_run_has_three_processes_near_a_core_through_its_rollouts(capsys):
    # RESULTS.md, the second online run on the H100: vLLM's GPU worker, its front end and the other spawned vLLM
    # process near one core each through the rollouts
    d = ROOT / "benchmarks/results/h100_super_modes/online2"
    assert proc_cpu.main(["summary", str(d / "proc_cpu.jsonl.gz"), "--events",
                          str(d / "pack/online_events.jsonl")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("222 of 1004 samples with vLLM worker (sync events) at >= 50 %")
    assert "| vLLM worker (sync events) | 1 | 96.3 |" in out and "| ray::vLLMHttpServer | 1 | 60.1 |" in out
    assert "| python3 -B -c | 1 | 56.6 |" in out


def _phase_samples(spawn: str) -> list[dict]:
    """One rollout after a sync at t=10: the engine core busy 10.5-12.0, the front end until 13.0, the agent loops
    until 13.5; vLLM's GPU worker near 100 % throughout, waiting for work (left out); the trainer's log-prob pass
    after."""
    def s(t, **cpu):
        names = {"ec": f"6 {spawn}", "w": f"7 {spawn}", "fe": "2 ray::vLLMHttpServer.generate",
                 "ag1": "3 ray::AgentLoopWorkerTQ", "ag2": "4 ray::AgentLoopWorkerTQ", "tr": "5 ray::WorkerDict"}
        return {"t": t, "dt": 0.5, "cpu": {names[k]: v for k, v in cpu.items()}}
    return [
        s(9.5, ec=100.0, fe=100.0, w=100.0),  # the step before (ends at the sync): not this step's
        s(10.5, ec=60.0, w=100.0, ag1=100.0),
        s(11.0, ec=100.0, fe=100.0, w=100.0),
        s(11.5, ec=100.0, fe=100.0, w=100.0, ag2=30.0),
        s(12.0, ec=100.0, fe=100.0, w=100.0),
        s(12.5, ec=10.0, fe=100.0, w=100.0),
        s(13.0, fe=100.0, w=100.0, ag1=20.0),
        s(13.5, w=100.0, ag1=100.0, ag2=100.0),
        s(14.0, w=100.0, tr=100.0),
        s(20.5, ec=100.0, fe=100.0),  # after the next sync: the next step's
    ]


def test_phases_split_each_rollout_into_the_engine_core_the_front_end_after_it_and_the_agent_loops():
    spawn = "python3 -B -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)"
    log = "(EngineCore pid=6) INFO ...\n(Worker pid=7) INFO ...\n(EngineCore pid=6) INFO ..."
    assert proc_cpu.engine_core_pids(log) == {"6"}
    events = [{"event": "sync", "pid": 7, "time": 10.0, "update": 1}, {"event": "sync", "pid": 7, "time": 20.0,
                                                                         "update": 2}]
    metrics = {1: {"timing_s/gen": 4.0, "timing_per_token_ms/gen": 4.0},
               3: {"timing_s/gen": 1.0}}  # step 3: no sync event for its update, left out
    (row,) = proc_cpu.step_phases(_phase_samples(spawn), events, metrics, {"6"})
    assert row["step"] == 1 and row["tokens"] == pytest.approx(1000.0)
    assert row["engine_core_busy_s"] == pytest.approx(2.0)  # 10.0-12.0: its samples at >= 50 %
    assert row["front_end_after_s"] == pytest.approx(1.0)  # busy until 13.0
    assert row["agent_loops_after_s"] == pytest.approx(0.5)  # until 13.5
    # CPU seconds: the sync's window only (not the samples at 9.5 and 20.5); the waiting worker not counted
    assert row["engine_core_cpu_s"] == pytest.approx((60 + 100 * 3 + 10) / 100 * 0.5)
    assert row["front_end_cpu_s"] == pytest.approx(5 * 0.5)
    assert row["agent_loops_cpu_s"] == pytest.approx((100 + 30 + 20 + 200) / 100 * 0.5)
    assert row["front_end_us_per_token"] == pytest.approx(2.5 / 1000 * 1e6)


MODES_DIR = ROOT / "benchmarks/results/h100_super_modes"


def _committed_phases(run: str, tmp_path, *extra: str, mode: str = "online") -> dict:
    """``proc_cpu.py phases`` on a committed run of the H100 leases (mode online unless named): its JSON."""
    d, out = MODES_DIR / run, tmp_path / f"{run}.json"
    assert proc_cpu.main(["phases", str(d / "proc_cpu.jsonl.gz"), "--events", str(d / f"pack/{mode}_events.jsonl"),
                          "--metrics", str(d / f"pack/{mode}_metrics.jsonl"), "--log", str(d / f"run/{mode}.log"),
                          "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_the_committed_online_runs_front_end_outlasts_the_engine_core_more_on_the_slower_host(capsys, tmp_path):
    # RESULTS.md, "verl's rollout by process": the second online run and the k=3 run (a slower host), steps 11-20
    means = {}
    for run in ("online2", "online_k3"):
        res = _committed_phases(run, tmp_path)
        assert [r["step"] for r in res["steps"]] == list(range(1, 21))
        # a step whose front end finished with the engine core or first counts 0 after it (the k=2 run: 4 of 20)
        after = [r["front_end_after_s"] for r in res["steps"]]
        assert min(after) == 0.0 and sum(a > 0 for a in after) == {"online2": 16, "online_k3": 17}[run]
        means[run] = res["means"]
    assert "| mean, steps 11-20 | 6.47 | 3.91 | 1.72 | 0.71 | 5.59 | 54.5 |" in capsys.readouterr().out
    fast, slow = means["online2"], means["online_k3"]
    assert round(fast["front_end_us_per_token"], 1) == 30.8 and round(fast["engine_core_busy_s"], 2) == 2.62
    assert round(fast["front_end_after_s"], 2) == 0.60
    # the front end's CPU per rollout exceeds the engine core's busy span: the rollout ends when the front end does
    for m in (fast, slow):
        assert m["front_end_cpu_s"] > m["engine_core_busy_s"] and m["front_end_after_s"] > 0
    assert slow["front_end_after_s"] > 2.5 * fast["front_end_after_s"]


def test_the_committed_lean_off_runs_rollout_by_process(tmp_path, capsys):
    # RESULTS.md, "mode off with the plugin's vLLM server": steps 11-20; the front end kept up with the engine core
    # in most steps, verl's agent loops were busy after both
    res = _committed_phases("off_lean", tmp_path, mode="off")
    assert [r["step"] for r in res["steps"]] == list(range(1, 21))
    m = res["means"]
    assert (round(m["gen_s"], 2), round(m["engine_core_busy_s"], 2), round(m["front_end_after_s"], 2),
            round(m["agent_loops_after_s"], 2)) == (6.07, 4.60, 0.25, 0.86)
    assert round(m["front_end_us_per_token"], 1) == 40.5
    assert sum(r["front_end_after_s"] == 0.0 for r in res["steps"] if r["step"] >= 11) == 5


def test_phases_refuse_a_log_without_the_engine_cores_pid(tmp_path):
    (tmp_path / "s.jsonl").write_text(json.dumps({"t": 1.0, "dt": 0.5, "cpu": {}}) + "\n")
    (tmp_path / "ev.jsonl").write_text(json.dumps({"event": "sync", "pid": 7, "time": 0.5, "update": 1}) + "\n")
    (tmp_path / "m.jsonl").write_text(json.dumps({"step": 1, "data": {"timing_s/gen": 1.0}}) + "\n")
    (tmp_path / "run.log").write_text("(Worker pid=7) INFO\n")
    args = ["phases", str(tmp_path / "s.jsonl"), "--events", str(tmp_path / "ev.jsonl"), "--metrics",
            str(tmp_path / "m.jsonl"), "--log", str(tmp_path / "run.log")]
    with pytest.raises(SystemExit):
        proc_cpu.main(args)
    (tmp_path / "run.log").write_text("(EngineCore pid=6) INFO\n")  # named, but never busy: no step to split
    with pytest.raises(SystemExit):
        proc_cpu.main(args)


def test_the_summary_marks_the_rollout_by_the_engine_core_the_run_log_names(capsys):
    # the worker stays near 100 % after the engine core goes idle: marked by the engine core, the committed second
    # online run's front end is near a core through its rollouts, not at the 60 % the worker's marking gave
    d = ROOT / "benchmarks/results/h100_super_modes/online2"
    assert proc_cpu.main(["summary", str(d / "proc_cpu.jsonl.gz"), "--events", str(d / "pack/online_events.jsonl"),
                          "--log", str(d / "run/online.log")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("119 of 1004 samples with vLLM engine core (run log) at >= 50 %")
    assert "| ray::vLLMHttpServer | 1 | 89.3 |" in out and "| vLLM engine core (run log) | 1 | 93.3 |" in out
    assert "| vLLM worker (sync events) | 1 | 103.0 |" in out


def test_without_log_probabilities_the_committed_runs_front_end_halves_and_never_outlasts_the_engine(tmp_path, capsys):
    # RESULTS.md, "mode online without verl's rollout log-probabilities": steps 3-6 of it and of online again
    means = {}
    for run in ("online2", "online_nolp"):
        res = _committed_phases(run, tmp_path, "--steps", "3-6")
        assert res["means_over"] == [3, 6]
        means[run] = res
    lp, nolp = means["online2"]["means"], means["online_nolp"]["means"]
    assert (round(lp["front_end_us_per_token"], 1), round(nolp["front_end_us_per_token"], 1)) == (37.1, 18.3)
    assert round(lp["front_end_after_s"], 2) == 0.63
    assert all(r["front_end_after_s"] == 0.0 for r in means["online_nolp"]["steps"] if r["step"] >= 2)
    capsys.readouterr()
    d = MODES_DIR / "online_nolp"
    assert proc_cpu.main(["summary", str(d / "proc_cpu.jsonl.gz"), "--events", str(d / "pack/online_events.jsonl"),
                          "--log", str(d / "run/online.log")]) == 0
    assert "| ray::vLLMHttpServer | 1 | 54.1 | 85.0 | 0.00 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # no step of the run in the range
        proc_cpu.main(["phases", str(d / "proc_cpu.jsonl.gz"), "--events", str(d / "pack/online_events.jsonl"),
                       "--metrics", str(d / "pack/online_metrics.jsonl"), "--log", str(d / "run/online.log"),
                       "--steps", "30-40"])
