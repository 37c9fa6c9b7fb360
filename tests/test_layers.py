"""The suite's layers (markers ``unit``, ``integration``, ``e2e``; tests/conftest.py assigns them): every test has
exactly one, the tables name only tests that exist, and the unit layer's guard refuses a Python process."""

import json
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).parent


@pytest.fixture(scope="module")
def conftest(request):
    """tests/conftest.py as pytest loaded it (in a whole-suite run the module name ``conftest`` may name another
    folder's conftest, e.g. tests/gpu/conftest.py, so it is looked up by its file)."""
    want = (TESTS / "conftest.py").resolve()
    for plugin in request.config.pluginmanager.get_plugins():
        path = getattr(plugin, "__file__", None)
        if path and pathlib.Path(path).resolve() == want:
            return plugin
    raise AssertionError("tests/conftest.py is not among pytest's plugins")

#: collects the suite as ``pytest --collect-only`` does and prints each test's layer markers
_COLLECT = """
import json, sys
import pytest

class Layers:
    def pytest_collection_finish(self, session):
        self.seen = {it.nodeid: [m.name for m in it.iter_markers() if m.name in ("unit", "integration", "e2e")]
                     for it in session.items}

p = Layers()
rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[p])
print("LAYERS " + json.dumps(p.seen))
sys.exit(rc)
"""


def _collect(*args: str) -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-c", _COLLECT, *args], cwd=TESTS.parent, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.rsplit("LAYERS ", 1)[1])


@pytest.fixture(scope="module")
def layers() -> dict[str, list[str]]:
    """node id -> its layer markers, for the whole suite (one collection, in a process of its own)."""
    return _collect()


def test_every_test_has_exactly_one_layer(layers, conftest):
    assert len(layers) > 600  # the whole suite was collected
    assert {n: m for n, m in layers.items() if len(m) != 1} == {}
    assert {m[0] for m in layers.values()} == set(conftest.LAYERS)  # no empty layer


def test_the_layers_follow_what_the_tests_start(layers):
    want = {
        "tests/test_main_ppo.py::test_ppo_online": "e2e",  # reads a run of the trainer-run machinery
        "tests/test_cli.py::test_main_ppo_refuses_contradictions_before_starting_ray": "e2e",  # starts main_ppo
        "tests/test_export_tp.py::test_tp2_and_ep2_export_equals_unsharded": "integration",  # megatron on 2 ranks
        "tests/test_vllm_moe.py::test_greedy_generation_and_acceptance_equal_megatrons": "integration",  # vLLM engine
        "tests/test_verl_trainer.py::test_invalid_guard_block_fails_when_the_trainer_is_built": "integration",  # Ray
        "tests/test_vllm_moe.py::test_expert_parallel_partial_sums_add_up_to_the_full_experts": "unit",
        "tests/test_policy.py::test_formatted_table_matches_the_table": "unit",
    }
    assert {n: layers[n][0] for n in want} == want
    readers = [n for n in layers if n.startswith(("tests/test_main_ppo.py::", "tests/test_main_ppo_tp2.py::"))]
    assert readers and {layers[n][0] for n in readers} == {"e2e"}


def test_the_tables_name_existing_files_and_tests(layers, conftest):
    names = {(n.split("::")[0].split("/")[-1], n.split("::")[1].split("[")[0]) for n in layers}
    files = {f for f, _ in names}
    for table in (conftest.E2E_TESTS, conftest.INTEGRATION_TESTS, conftest.INTEGRATION_FIXTURES):
        assert set(table) <= files, set(table) - files
    for table in (conftest.E2E_TESTS, conftest.INTEGRATION_TESTS):
        for f, tests in table.items():
            if tests != "*":
                assert {(f, t) for t in tests} <= names, {(f, t) for t in tests} - names


def test_a_layer_selection_collects_that_layer_only(layers):
    unit = _collect("-m", "unit", "tests/test_policy.py", "tests/test_vllm_moe.py")
    assert unit and {m[0] for m in unit.values()} == {"unit"}
    assert set(unit) == {n for n, m in layers.items() if m == ["unit"]
                         and n.startswith(("tests/test_policy.py::", "tests/test_vllm_moe.py::"))}


def test_the_unit_guard_refuses_a_python_process_and_lets_other_commands_run(request, conftest):
    import multiprocessing

    guard = conftest._UnitGuard(request.node)
    with guard, pytest.raises(RuntimeError, match="is in the unit layer but started a Python process"):
        subprocess.run([sys.executable, "-c", "pass"])
    with guard:
        assert subprocess.run(["true"]).returncode == 0
    with guard, pytest.raises(RuntimeError, match="started a multiprocessing process"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0  # restored on exit
