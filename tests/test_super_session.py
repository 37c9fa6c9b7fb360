"""``benchmarks/h200_main_ppo/super_session.sh prebuild``: causal_conv1d built in the background during a lease's
staging calls (the shared tool's ``build_causal_conv1d.sh``, here a stub that writes a wheel where ``OUT`` says)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SESSION = ROOT / "benchmarks" / "h200_main_ppo" / "super_session.sh"
WHEEL = "causal_conv1d-1.7.0-cp312-cp312-linux_x86_64.whl"


def _prebuild(tmp_path, build: str | None) -> tuple[subprocess.CompletedProcess, pathlib.Path]:
    stage, cc1d = tmp_path / "te", tmp_path / "cc1d"
    stage.mkdir(exist_ok=True)
    if build is not None:
        (stage / "build_causal_conv1d.sh").write_text(build)
    env = {**os.environ, "TE_STAGE": str(stage), "CC1D": str(cc1d), "OUT": str(tmp_path / "device_out"),
           "PYTHONPATH": "/elsewhere"}
    done = subprocess.run(["bash", str(SESSION), "prebuild"], env=env, capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    return done, cc1d


def _wait_for(path: pathlib.Path, seconds: float = 30.0) -> None:
    end = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.1)
    assert path.exists(), f"{path} never appeared"


def test_prebuild_builds_in_the_background_and_leaves_the_wheel_where_install_looks(tmp_path):
    # the stub builds only once the test says so, after the call returned: the call must not wait for the build
    go = tmp_path / "go"
    build = (f'for i in $(seq 600); do [ -f {go} ] && break; sleep 0.1; done\n'
             f'mkdir -p "$OUT"; echo x > "$OUT/{WHEEL}"; echo "causal_conv1d built in 1 s: $1 [$PYTHONPATH]"\n')
    done, cc1d = _prebuild(tmp_path, build)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "building in the background" in done.stdout
    assert not (cc1d / WHEEL).exists() and not pathlib.Path(f"{cc1d}.rc").exists()
    # a retried staging call while it builds starts no second build into the same folders
    retry, _ = _prebuild(tmp_path, build)
    assert retry.returncode == 0 and "building already" in retry.stdout
    go.touch()
    _wait_for(pathlib.Path(f"{cc1d}.rc"))
    assert pathlib.Path(f"{cc1d}.rc").read_text().strip() == "0"
    assert (cc1d / WHEEL).is_file()
    # the tool's OUT (the device call's output folder) is not where the wheel went
    assert not (tmp_path / "device_out").exists()
    # the build sees the image's packages only, not what the caller's PYTHONPATH (the lease's /tmp/site) names
    assert "built in 1 s" in pathlib.Path(f"{cc1d}.log").read_text() and "[]" in pathlib.Path(f"{cc1d}.log").read_text()
    again, _ = _prebuild(tmp_path, build)
    assert again.returncode == 0 and "already in" in again.stdout


def test_a_failed_prebuild_leaves_its_status_and_no_wheel(tmp_path):
    done, cc1d = _prebuild(tmp_path, 'echo "nvcc: error" >&2; exit 3\n')
    assert done.returncode == 0
    _wait_for(pathlib.Path(f"{cc1d}.rc"))
    assert pathlib.Path(f"{cc1d}.rc").read_text().strip() != "0"
    assert not list(cc1d.glob("*.whl"))
    assert "nvcc: error" in pathlib.Path(f"{cc1d}.log").read_text()


def test_prebuild_without_the_te_part_says_which_file_is_missing(tmp_path):
    done, _ = _prebuild(tmp_path, None)
    assert done.returncode == 6
    assert "build_causal_conv1d.sh" in done.stdout and "put the TE part" in done.stdout
