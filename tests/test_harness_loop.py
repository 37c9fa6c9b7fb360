"""The run loop the CPU harness and the GPU drivers share (:func:`verl_mtp_cpu.harness.run_trainer`), with shell
commands in place of verl's trainer: exit status, log, metrics and events read back, and each way a run is stopped
(its whole process group)."""

import os
import pathlib
import re

from verl_mtp_cpu import harness


def _run(tmp_path: pathlib.Path, script: str, **kw) -> tuple[harness.TrainerRun, str]:
    files = {k: tmp_path / f"run.{k}" for k in ("log", "metrics", "events")}
    run = harness.run_trainer(["sh", "-c", script], cwd=tmp_path, env={**os.environ, "RAY_ADDRESS": "elsewhere:1"},
                              log_path=files["log"], metrics_path=files["metrics"], events_path=files["events"], **kw)
    return run, files["log"].read_text()


def _gone(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")  # reaped later
    except FileNotFoundError:
        return True


def test_a_run_that_ends_by_itself_gives_its_exit_log_metrics_and_events(tmp_path):
    script = ('echo "ray tmp $RAY_TMPDIR address ${RAY_ADDRESS:-none}"; '
              'echo \'{"step": 1, "data": {"critic/score/mean": 0.5}}\' >> "$VERL_FILE_LOGGER_PATH"; '
              'echo \'{"event": "sync", "update": 1}\' >> "$VERL_CPU_EVENTS"; echo "step:1 - done"; exit 3')
    seen = []
    run, log = _run(tmp_path, script, timeout_s=60, on_line=lambda t, line: seen.append(line))
    assert (run.rc, run.stopped) == (3, None)
    assert run.metrics == {1: {"critic/score/mean": 0.5}}
    assert run.events == [{"event": "sync", "update": 1}]
    assert log.startswith("$ sh -c ")
    assert re.search(r"^\[ *\d+\.\ds\] step:1 - done$", log, re.M), log
    ray_tmp = re.search(r"ray tmp (\S+) address none", seen[0]).group(1)  # a Ray cluster of its own
    assert ray_tmp.startswith("/tmp/rv") and not os.path.exists(ray_tmp)  # removed after the run
    assert seen[1] == "step:1 - done\n" and "stopped" not in log


def test_a_run_past_its_time_limit_is_stopped_with_its_process_group(tmp_path):
    run, log = _run(tmp_path, "sleep 60 & echo child $!; wait", timeout_s=2)
    assert run.stopped == "timeout after 2 s" and run.rc != 0
    assert log.rstrip().endswith("[verl_cpu harness] stopped: timeout after 2 s")
    assert _gone(int(re.search(r"child (\d+)", log).group(1)))  # the group's other processes (Ray's) too
    assert run.wall_s < 30


def test_a_silent_run_and_one_past_a_fatal_line_are_stopped(tmp_path):
    run, _ = _run(tmp_path, "echo start; sleep 60", timeout_s=60, silence_s=1)
    assert run.stopped == "no output for 1 s"
    # the fatal line comes in one chunk with the line before it: seen when it comes, not with the next output
    fatal = (re.compile(r"MTPDesyncError"),)
    run, log = _run(tmp_path, "echo ok; echo 'raise MTPDesyncError'; sleep 60", timeout_s=60, fatal=fatal,
                    grace_s=1, label="h200 driver")
    assert run.stopped == "still running 1 s after a fatal log line"
    assert log.rstrip().endswith("[h200 driver] stopped: still running 1 s after a fatal log line")
    run, _ = _run(tmp_path, "echo ok; exit 0", timeout_s=60, silence_s=30, fatal=(re.compile("ok"),), grace_s=30)
    assert (run.rc, run.stopped) == (0, None)  # a fatal line in a run that ends: the exit decides


RAY_FAIL = "echo 'Exception: The current node timed out during startup. This could happen because ...'; exit 1"
PORT_FAIL = ("echo 'torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
             "address. port: 38867, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use'; exit 1")


def test_a_run_whose_process_group_port_was_taken_is_tried_again(tmp_path):
    marker = tmp_path / "tried"
    script = (f'if [ ! -e {marker} ]; then touch {marker}; {PORT_FAIL}; fi; '
              'echo \'{"step": 1, "data": {}}\' >> "$VERL_FILE_LOGGER_PATH"; exit 0')
    run, log = _run(tmp_path, script, timeout_s=60)
    assert (run.rc, run.metrics) == (0, {1: {}}) and "try 2" in log.splitlines()[0]
    assert "EADDRINUSE" in (tmp_path / "run.log.ray_start1").read_text()


def test_a_run_that_fails_in_rays_start_up_is_tried_again_once(tmp_path):
    # first try: Ray's raylet did not register in its fixed 30 s (a loaded host); the second try runs
    marker = tmp_path / "tried"
    script = (f'if [ ! -e {marker} ]; then touch {marker}; {RAY_FAIL}; fi; '
              'echo \'{"step": 1, "data": {"critic/score/mean": 0.5}}\' >> "$VERL_FILE_LOGGER_PATH"; echo ok; exit 0')
    run, log = _run(tmp_path, script, timeout_s=60)
    assert (run.rc, run.stopped, run.metrics) == (0, None, {1: {"critic/score/mean": 0.5}})
    assert log.startswith("[verl_cpu harness] try 2: the previous one failed in Ray's start-up (kept as run.log.ray_start1)")
    assert "timed out during startup" in (tmp_path / "run.log.ray_start1").read_text()
    # a Ray start that fails every time: two tries, then its failure
    (tmp_path / "b").mkdir()
    run, log = _run(tmp_path / "b", RAY_FAIL, timeout_s=60)
    assert run.rc == 1 and "try 2" in log and "timed out during startup" in log
    assert (tmp_path / "b" / "run.log.ray_start1").exists() and not (tmp_path / "b" / "run.log.ray_start2").exists()


def test_a_run_that_fails_otherwise_or_after_a_step_is_not_tried_again(tmp_path):
    run, log = _run(tmp_path, "echo 'RuntimeError: boom'; exit 1", timeout_s=60)
    assert run.rc == 1 and log.startswith("$ sh -c ")
    # the same message once the run has logged a step is the run's own failure, not Ray's start-up
    script = ('echo \'{"step": 1, "data": {}}\' >> "$VERL_FILE_LOGGER_PATH"; ' + RAY_FAIL)
    (tmp_path / "b").mkdir()
    run, log = _run(tmp_path / "b", script, timeout_s=60)
    assert run.rc == 1 and run.metrics == {1: {}} and log.startswith("$ sh -c ")
