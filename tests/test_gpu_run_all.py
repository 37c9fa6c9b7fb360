"""``tests/gpu/run_all.py`` (run on a GPU machine, not collected here): the environment it gives the GPU tests."""

import importlib.util
import os
import pathlib
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
    # so no .pth of this venv's editable installs) with this process's import path, less the repository's source
    # folders, as plain PYTHONPATH entries.
    own = {ROOT, ROOT / "cpu_runtime", ROOT / "tests"}
    plain = os.pathsep.join(p for p in sys.path if p and pathlib.Path(p).resolve() not in own)
    env = _run_all().child_env({"PATH": os.environ.get("PATH", ""), "PYTHONPATH": plain})
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts[:2] == [str(ROOT), str(ROOT / "cpu_runtime")] and parts[2:] == plain.split(os.pathsep)
    code = ("import verl_mtp_cpu.mamba_triton, verl_mtp_plugin.testing, verl_mtp_cpu; "
            "print(verl_mtp_cpu.__file__)")
    done = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd="/", capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith(str(ROOT / "cpu_runtime" / "verl_mtp_cpu"))
    # without the CPU runtime on the path (what the GPU leases ran before) the same import fails, unless the CPU
    # runtime is installed (not editable) where this interpreter finds it anyway
    found = importlib.util.find_spec("verl_mtp_cpu")
    if found is not None and not pathlib.Path(found.origin).resolve().is_relative_to(ROOT):
        return
    bare = dict(env, PYTHONPATH=os.pathsep.join([str(ROOT), plain]))
    done = subprocess.run([sys.executable, "-S", "-c", code], env=bare, cwd="/", capture_output=True, text=True,
                          timeout=600)
    assert done.returncode != 0 and "No module named 'verl_mtp_cpu'" in done.stderr
