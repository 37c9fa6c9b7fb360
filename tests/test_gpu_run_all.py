"""``tests/gpu/run_all.py`` (run on a GPU machine, not collected here): the environment it gives the GPU tests."""

import importlib.util
import os
import pathlib
import site
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run_all():
    spec = importlib.util.spec_from_file_location("gpu_run_all", ROOT / "tests" / "gpu" / "run_all.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_gpu_tests_find_the_cpu_runtime_where_nothing_of_the_repository_is_installed():
    # A GPU image puts its packages on PYTHONPATH (no editable installs): emulated by `python -S` (no site module,
    # so no .pth of this venv's editable installs) with the venv's site-packages as plain PYTHONPATH entries.
    plain = os.pathsep.join(site.getsitepackages())
    env = _run_all().child_env({"PATH": os.environ.get("PATH", ""), "PYTHONPATH": plain})
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts[:2] == [str(ROOT), str(ROOT / "cpu_runtime")] and parts[2:] == plain.split(os.pathsep)
    code = ("import verl_mtp_cpu.mamba_triton, verl_mtp_plugin.testing, verl_mtp_cpu; "
            "print(verl_mtp_cpu.__file__)")
    done = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd="/", capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith(str(ROOT / "cpu_runtime" / "verl_mtp_cpu"))
    # without the CPU runtime on the path (what the GPU leases ran before) the same import fails
    bare = dict(env, PYTHONPATH=os.pathsep.join([str(ROOT), plain]))
    done = subprocess.run([sys.executable, "-S", "-c", code], env=bare, cwd="/", capture_output=True, text=True,
                          timeout=600)
    assert done.returncode != 0 and "No module named 'verl_mtp_cpu'" in done.stderr
