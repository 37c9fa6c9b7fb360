"""``benchmarks/h200_main_ppo/startup.py`` (a mode run's start-up milestones; which functions hold vLLM's profiling
run) and ``spy_warmup.sh`` (py-spy on vLLM's worker, found by its warm-up line in the run's log)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HERE = ROOT / "benchmarks" / "h200_main_ppo"
_spec = importlib.util.spec_from_file_location("startup", HERE / "startup.py")
startup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(startup)
MODES = ROOT / "benchmarks" / "results" / "h100_super_modes"

# lines as run.py logs them: Ray's coloured actor prefix, vLLM's INFO lines, verl's step line
LOG = """\
[  10.0s] \x1b[36m(vLLMHttpServer pid=9)\x1b[0m (Worker pid=77) INFO [model_runner.py:305] Model loading took 3.86 GiB and 1.3 seconds
[  12.5s] \x1b[36m(vLLMHttpServer pid=9)\x1b[0m (Worker pid=77) INFO [mamba_mixer2.py:578] Warming up Mamba2 SSD Triton kernels...
[  70.0s] (Worker pid=77) INFO [monitor.py:53] torch.compile and initial profiling/warmup run together took 61.25 s in total
[  76.0s] (Worker pid=77) INFO [monitor.py:53] torch.compile and initial profiling/warmup run together took 5.5 s in total
[  95.0s] (Worker pid=77) INFO [model_runner.py:747] Graph capturing finished in 19 secs, took 1.01 GiB
[ 110.0s] (EngineCore pid=70) INFO [core.py:340] init engine (profile, create kv cache, warmup model) took 100.5 s (compilation: 10 s)
[ 250.0s] (MTPTaskRunner pid=5) step:1 - global_seqlen/min:1.0 - timing_s/gen:4.0
[ 270.0s] (MTPTaskRunner pid=5) step:10 - global_seqlen/min:1.0
"""


def test_milestones_read_vllms_phases_and_verls_first_step_from_the_runs_log():
    got = startup.milestones(LOG.splitlines())
    assert got == {"megatron_worker_at": None, "vllm_server_at": 10.0,
                   "vllm_model_loaded_at": 10.0, "vllm_ssd_warmup_at": 12.5, "vllm_compile_profile_s": 61.25,
                   "vllm_drafter_compile_profile_s": 5.5, "vllm_graphs_s": 19.0, "vllm_init_engine_s": 100.5,
                   "vllm_ready_at": 110.0, "agent_loops_at": None, "first_rollout_done_at": None,
                   "step1_logged_at": 250.0}
    # a run logged at verl's WARN (no vLLM INFO lines), mode off (no drafter): what is missing reads as None
    warn = startup.milestones([LOG.splitlines()[-2]])
    assert warn["step1_logged_at"] == 250.0 and warn["vllm_init_engine_s"] is None
    off = startup.milestones(LOG.splitlines()[:3])
    assert off["vllm_compile_profile_s"] == 61.25 and off["vllm_drafter_compile_profile_s"] is None


def test_milestones_time_verls_processes_by_their_first_lines():
    lines = ["[   5.0s] \x1b[36m(WorkerDict pid=3)\x1b[0m model built",
             "[   9.0s] \x1b[36m(WorkerDict pid=3)\x1b[0m again",
             "[  20.0s] \x1b[36m(MTPvLLMHttpServer pid=4)\x1b[0m ['serve',",
             "[  40.0s] \x1b[36m(AgentLoopWorkerTQ pid=8)\x1b[0m Using dataset class: RLHFDataset",
             "[  41.0s] \x1b[36m(AgentLoopWorker pid=9)\x1b[0m Using dataset class: RLHFDataset",
             "[  30.0s] (MTPvLLMHttpServer pid=4) INFO [async_llm.py:983] Engines are idle, requests have been drained",
             "[  50.0s] (MTPvLLMHttpServer pid=4) INFO [async_llm.py:983] Engines are idle, requests have been drained",
             "[  60.0s] (MTPvLLMHttpServer pid=4) INFO [async_llm.py:983] Engines are idle, requests have been drained"]
    got = startup.milestones(lines)
    assert (got["megatron_worker_at"], got["vllm_server_at"], got["agent_loops_at"]) == (5.0, 20.0, 40.0)
    # the first drain is vLLM's sleep after its start-up, the second the first rollout's end
    assert got["first_rollout_done_at"] == 50.0
    # two rollout replicas: the other server's start-up drain is not the first rollout's end
    other = lines[5].replace("pid=4", "pid=5").replace("30.0s", "31.0s")
    two = [*lines[:6], other, *lines[6:]]
    assert two[5:8] == [lines[5], other, lines[6]]
    assert startup.milestones(two)["first_rollout_done_at"] == 50.0


def test_a_leases_second_run_is_named_by_the_lease_and_its_folder(tmp_path):
    first, second = tmp_path / "lease" / "run" / "online.log", tmp_path / "lease" / "run2" / "online.log"
    assert (startup.run_name(first), startup.run_name(second)) == ("lease", "lease/run2")
    assert startup.lease_folder(second) == tmp_path / "lease"
    assert startup.run_name(tmp_path / "x" / "online.log") == "online"


def test_the_committed_warm_machine_lease_gives_the_quoted_start_up_figures():
    # RESULTS.md, "Start-up on a warm machine": the same run twice on one H200 (the tiny checkpoint, the TE stack),
    # the second with the first one's Triton and vLLM caches in place
    lease = ROOT / "benchmarks" / "results" / "h200_startup_warm"
    cold, warm = startup.startup(lease / "run" / "online.log"), startup.startup(lease / "run2" / "online.log")
    assert (cold["vllm_compile_profile_s"], warm["vllm_compile_profile_s"]) == (84.15, 3.02)
    assert (cold["vllm_init_engine_s"], warm["vllm_init_engine_s"]) == (139.36, 12.1)
    assert (cold["vllm_graphs_s"], warm["vllm_graphs_s"]) == (20.0, 5.0)
    assert (cold["vllm_server_at"], cold["vllm_model_loaded_at"], cold["vllm_ready_at"]) == (163.4, 249.4, 388.7)
    assert (warm["vllm_server_at"], warm["vllm_model_loaded_at"], warm["vllm_ready_at"]) == (167.6, 212.7, 224.8)
    assert (cold["megatron_worker_at"], warm["megatron_worker_at"], warm["agent_loops_at"]) == (122.1, 126.3, 261.4)
    # run 2 finished its first rollout; neither logged step 1
    assert (cold["first_rollout_done_at"], warm["first_rollout_done_at"]) == (None, 273.5)
    assert cold["step1_logged_at"] is None and warm["step1_logged_at"] is None
    # the first run's kernels went to Triton's named cache, vLLM's worker's among them, none to inductor's folder
    kernels = (lease / "triton_1.txt").read_text()
    assert " _chunk_scan_fwd_kernel.json" in kernels and " fused_moe_kernel.json" in kernels
    assert "inductor's triton folder: 0 kernels" in kernels


def test_the_committed_short_online_lease_gives_the_quoted_start_up_figures():
    # RESULTS, "the short lease of online with the plugin's server": the carried caches against a lease of the same
    # host pace without them (online without rollout log-probabilities)
    new = startup.startup(MODES / "online_lean_short" / "run" / "online.log")
    old = startup.startup(MODES / "online_nolp" / "run" / "online.log")
    assert (new["vllm_compile_profile_s"], old["vllm_compile_profile_s"]) == (62.6, 76.74)
    assert (new["vllm_init_engine_s"], new["vllm_ready_at"], new["step1_logged_at"]) == (105.91, 284.3, 398.3)
    assert new["first_rollout_done_at"] == 316.5
    assert (round(new["step1_log_prob_s"], 1), round(old["step1_log_prob_s"], 1)) == (13.8, 53.3)
    assert (round(new["step1_update_s"], 1), round(old["step1_update_s"], 1)) == (63.0, 80.5)
    assert (new["pretraining_s"], new["pretraining_step1_s"], old["pretraining_step1_s"]) == (195.3, 57.2, 92.4)
    assert old["step1_logged_at"] == 528.0
    # the lease of 2 steps, a host ~1.3x slower in Python (0.358 s against 0.278), the same carried caches
    spy = startup.startup(MODES / "online_lean_spy" / "run" / "online.log")
    assert (spy["vllm_compile_profile_s"], spy["vllm_ready_at"], spy["step1_logged_at"]) == (96.21, 440.0, 615.6)
    assert (spy["pretraining_s"], spy["pretraining_step1_s"], round(spy["step1_update_s"], 1)) == (225.7, 77.1, 99.7)


def test_spy_counts_a_function_once_per_stack_and_its_own_time_at_the_top():
    raw = ["<module> (a.py:1);run (a.py:5);f (b.py:10);f (b.py:12) 6",
           "<module> (a.py:1);run (a.py:5);g (b.py:20) 3",
           "<module> (a.py:1);idle (a.py:9) 1", "garbage", ""]
    got = startup.spy(raw)
    assert got["samples"] == 10
    assert got["inclusive"]["f (b.py)"] == 6  # recursion: once per sample, not per frame
    assert got["inclusive"]["run (a.py)"] == 9 and got["inclusive"]["<module> (a.py)"] == 10
    assert got["self"] == {"f (b.py)": 6, "g (b.py)": 3, "idle (a.py)": 1}


def test_triton_compiling_goes_to_the_vllm_function_that_launched_the_kernel():
    compile_ = "JITFunction.run (triton/runtime/jit.py:700);compile (triton/compiler/compiler.py:300);make_llir (x.py:1)"
    raw = [f"w (vllm/worker.py:1);_chunk_scan_fwd (vllm/ops/ssd.py:4);launch (torch/_ops.py:2);{compile_} 5",
           # launched from outside vLLM: the innermost frame outside Triton's and torch's
           f"main (job.py:1);kernel (mamba_ssm/ops.py:9);{compile_} 2",
           f"{compile_} 1",  # nothing outside Triton: "?"
           "w (vllm/worker.py:1);_chunk_scan_fwd (vllm/ops/ssd.py:4);JITFunction.run (triton/runtime/jit.py:700) 4"]
    got = startup.triton_compile(raw)
    assert got["samples"] == 12  # the kernel's launch without a compile (a cache hit) counts in all, not as compiling
    assert got["by_launcher"] == {"_chunk_scan_fwd (vllm/ops/ssd.py)": 5, "kernel (mamba_ssm/ops.py)": 2, "?": 1}


def test_the_committed_spy_of_vllms_profiling_run_is_triton_compiling_the_ssd_and_moe_kernels(capsys):
    # RESULTS.md, "vLLM's profiling run is Triton compiling": the worker's samples on a fresh H100 with the carried cache
    path = MODES / "online_lean_spy" / "spy_warmup.txt.gz"
    import gzip

    got = startup.triton_compile(gzip.decompress(path.read_bytes()).decode().splitlines())
    by = got["by_launcher"]
    assert (got["samples"], sum(by.values())) == (1958, 1660)
    ssd = sum(n for f, n in by.items() if "/layers/mamba/ops/ssd_" in f)
    moe = by["invoke_fused_moe_triton_kernel (vllm/model_executor/layers/fused_moe/fused_moe.py)"]
    assert (by["_chunk_scan_fwd (vllm/model_executor/layers/mamba/ops/ssd_chunk_scan.py)"], ssd, moe) == (871, 1107, 285)
    top = sorted(by.values(), reverse=True)
    assert (top[:6], sum(top[6:])) == ([871, 285, 107, 94, 63, 58], 182)
    assert startup.main(["spy", str(path), "--top", "3"]) == 0
    assert "1660 of 1958 samples (0.848, 83.0 s at 20 per second)" in capsys.readouterr().out


def test_spy_warmup_finds_vllms_worker_by_its_warm_up_line_and_samples_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    live = str(os.getpid())  # a process that is there while the script looks
    (run / "online.log").write_text(LOG.replace("Worker pid=77", f"Worker pid={live}"))
    fake = tmp_path / "py-spy"
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\n')
    fake.chmod(0o755)
    out = tmp_path / "spy_warmup.txt"
    env = {**os.environ, "PYSPY": str(fake), "SPY_WAIT_S": "3"}
    subprocess.run(["bash", str(HERE / "spy_warmup.sh"), str(run), str(out), "40"], env=env, check=True, timeout=60)
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("--pid") + 1] == live and args[args.index("--duration") + 1] == "40"
    assert args[args.index("-o") + 1] == str(out)
    # vLLM's worker under its tensor parallelism ("Worker_TP0"), verl's WorkerDict not taken for it
    (tmp_path / "args").unlink()
    (run / "online.log").write_text("[ 1.0s] (WorkerDict pid=1) Warming up Mamba2 SSD Triton kernels...\n"
                                    + LOG.replace("Worker pid=77", f"Worker_TP0 pid={live}"))
    subprocess.run(["bash", str(HERE / "spy_warmup.sh"), str(run), str(out), "40"], env=env, check=True, timeout=60)
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("--pid") + 1] == live
    # a worker that is gone (an earlier run's log): says so, samples nothing
    (tmp_path / "args").unlink()
    (run / "online.log").write_text(LOG.replace("Worker pid=77", "Worker pid=999999999"))
    subprocess.run(["bash", str(HERE / "spy_warmup.sh"), str(run), str(out)], env=env, check=True, timeout=60)
    assert not (tmp_path / "args").exists() and "is gone" in out.read_text()
    # no warm-up line within the wait: says so, samples nothing
    (run / "online.log").write_text(LOG.splitlines()[-1] + "\n")
    subprocess.run(["bash", str(HERE / "spy_warmup.sh"), str(run), str(out)], env=env, check=True, timeout=60)
    assert not (tmp_path / "args").exists() and out.read_text().startswith("no warm-up line")


def test_the_command_line_prints_a_table_per_run_and_the_spy_shares(tmp_path, capsys):
    log = tmp_path / "run" / "online.log"
    log.parent.mkdir()
    log.write_text(LOG)
    assert startup.main(["milestones", str(log), "--json", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    assert "| seconds | " + tmp_path.name + " |" in out and "| vllm_compile_profile_s | 61.2 |" in out
    assert json.loads((tmp_path / "m.json").read_text())[str(log)]["vllm_graphs_s"] == 19.0
    spy = tmp_path / "spy.txt"
    spy.write_text("m (a.py:1);w (b.py:2) 3\nm (a.py:1) 1\n")
    assert startup.main(["spy", str(spy)]) == 0
    out = capsys.readouterr().out
    assert "| 0.750 | `w (b.py)` |" in out and "| 1.000 | `m (a.py)` |" in out
    spy.write_text("no warm-up line in run/*.log\n")
    with pytest.raises(SystemExit, match="no py-spy samples"):
        startup.main(["spy", str(spy)])


def test_the_lease_scripts_parse_and_the_session_returns_the_spy_samples():
    for script in sorted(HERE.glob("*.sh")):
        res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, (script.name, res.stderr)
    session = (HERE / "super_session.sh").read_text()
    # the mode pipeline samples into $S/spy_warmup.txt; poll's archive takes spy_* with the logs
    assert "spy_warmup.sh $S/run $S/spy_warmup.txt" in session and " spy_* " in session


def test_vllms_worker_kept_a_core_busy_through_its_profiling_run_on_the_short_lease():
    # RESULTS.md: the worker (pid 3524 in the log's "Worker pid=") over the samples from 186 to 241 s after main_ppo began
    import gzip
    import statistics

    rows = [json.loads(x) for x in gzip.open(MODES / "online_lean_short" / "proc_cpu.jsonl.gz", "rt")]
    t0 = next(r["t"] for r in rows if any("verl_mtp_plugin.main_ppo" in k for k in r["cpu"]))
    window = [r for r in rows if 186 <= r["t"] - t0 <= 241]
    worker = [sum(v for k, v in r["cpu"].items() if k.startswith("3524 ")) for r in window]
    rest = [sum(v for k, v in r["cpu"].items() if not k.startswith("3524 ")) for r in window]
    assert "(Worker pid=3524)" in (MODES / "online_lean_short" / "run" / "online.log").read_text()
    assert (len(window), round(statistics.mean(worker)), round(statistics.mean(rest))) == (109, 79, 11)


def test_the_drafters_step_1_acceptance_differs_by_lease_from_one_pretraining_command():
    # RESULTS.md, "vLLM's profiling run is Triton compiling": vLLM's first-draft acceptance at step 1 (before any
    # update) on the k=2 leases, and the pretraining's joint loss at step 140 on two of them
    def step1(lease):
        summary = json.loads((MODES / lease / "run" / "summary.json").read_text())
        (run,) = summary["runs"].values()
        return round(run["metrics"]["1"]["rollout/spec_accept_rate_pos_0"], 3)

    leases = ["online_lean_spy", "online", "online2", "online_lean_short", "online_nolp", "frozen"]
    assert [step1(lease) for lease in leases] == [0.159, 0.237, 0.321, 0.34, 0.374, 0.363]

    def loss140(lease):
        curve = json.loads((MODES / lease / "assets.json").read_text())["curve"]
        return next(round(c["loss"], 4) for c in curve if c["phase"] != "mtp_only" and c["step"] == 140)

    assert (loss140("online_lean_spy"), loss140("online_lean_short")) == (0.3712, 0.3705)


def test_procs_names_each_process_by_the_work_it_took_and_times_its_busy_samples():
    rows = [{"t": 100.0, "dt": 0.5, "cpu": {"1 python3 -m verl_mtp_plugin.main_ppo": 100.0}},
            {"t": 101.0, "dt": 0.5, "cpu": {"1 python3 -m verl_mtp_plugin.main_ppo": 40.0, "7 ray::IDLE": 100.0}},
            {"t": 102.0, "dt": 1.0, "cpu": {"7 ray::TransferQueueController": 100.0, "8 ray::IDLE": 2.0}},
            {"t": 102.5, "dt": 0.1, "cpu": {"8 ray::IDLE": 100.0, "6 ray::IDLE": 5.0}},  # busy, but 0.12 CPU s
            {"t": 103.0, "dt": 1.0, "cpu": {"7 ray::IDLE": 60.0}},  # back to idle: keeps the name it took
            {"t": 200.0, "dt": 1.0, "cpu": {"9 ray::WorkerDict": 100.0}}]  # past --until
    got = startup.procs(rows, until=10.0, min_cpu_s=0.4)
    assert [(p["pid"], p["name"], p["first"], p["last"], round(p["cpu_s"], 2)) for p in got] == [
        ("1", "python3 -m verl_mtp_plugin.main_ppo", 0.0, 0.0, 0.7),  # 40 % is not busy
        ("7", "ray::TransferQueueController", 1.0, 3.0, 2.1)]  # 8 under min_cpu_s
    # with a lower floor: 8 is there (busy once); 6 never ran at half a core, however little the floor
    got = startup.procs(rows, until=10.0, min_cpu_s=0.001)
    assert [p["pid"] for p in got] == ["1", "7", "8"]
    with pytest.raises(ValueError, match="main_ppo"):
        startup.procs(rows[2:], until=10.0)


def test_the_committed_short_lease_shows_start_up_as_processes_starting_one_after_another(capsys):
    # RESULTS.md, "vLLM's profiling run is Triton compiling": the processes before vLLM loaded the model (178.3 s)
    import gzip

    rows = [json.loads(x) for x in gzip.open(MODES / "online_lean_short" / "proc_cpu.jsonl.gz", "rt")]
    got = {p["pid"]: (p["name"], round(p["first"], 1), round(p["last"], 1)) for p in startup.procs(rows, 180.0)}
    assert got["2889"] == ("ray::TransferQueueController:TransferQueueController.__init__", 48.8, 55.9)
    assert got["2951"] == ("ray::TransferQueueStorageUnit#0:SimpleStorageUnit.__init__", 56.9, 64.4)
    assert got["3104"] == ("ray::WorkerDict.actor_rollout_ref_init_model", 72.5, 106.2)
    assert got["3309"] == ("ray::vllm_server_0_0:MTPvLLMHttpServer.__init__", 107.7, 144.0)
    # vLLM's server inspects the drafter's model class in a subprocess (its modelinfos cache held the target's only)
    assert got["3481"][1:] == (127.9, 143.0) and got["3481"][0].endswith("-m vllm.model_executor.models.registry")
    assert (got["3505"][1:], got["3524"][1:]) == ((144.5, 178.8), (158.6, 179.8))  # vLLM's engine core, its worker
    assert startup.main(["procs", str(MODES / "online_lean_short" / "proc_cpu.jsonl.gz"), "--until", "180"]) == 0
    assert "| 2889 `ray::TransferQueueController:TransferQueueController.__init__` | 48.8 | 55.9 | 8.1 |" in (
        capsys.readouterr().out)


def test_with_vllms_tensor_parallelism_the_drafters_compile_line_is_the_first_workers_second():
    # each worker logs its own compile lines; the target's of rank 1 comes before rank 0's drafter line
    tp = [line.replace("(Worker pid=77)", "(Worker_TP0 pid=77)") for line in LOG.splitlines()]
    tp.insert(3, "[  70.5s] (Worker_TP1 pid=78) INFO [monitor.py:53] torch.compile and initial profiling/warmup run "
                 "together took 60.0 s in total")
    got = startup.milestones(tp)
    assert (got["vllm_compile_profile_s"], got["vllm_drafter_compile_profile_s"]) == (61.25, 5.5)
    assert startup.milestones(LOG.splitlines())["vllm_drafter_compile_profile_s"] == 5.5  # one worker: as before
