"""benchmarks/h200_main_ppo/import_profile.py: import time per process and package, and where the GPU lease runs it."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "h200_main_ppo"))
import import_profile as ip  # noqa: E402

SAMPLE = """\
import time: self [us] | cumulative | imported package
import time:       100 |        100 |   _io
import time:      2000 |       2100 | site
some library's warning line
import time:    300000 |     300000 |       torch._C
import time:    500000 |     800000 |     torch.nn
import time:   1000000 |    1800000 |   torch
import time:     50000 |      50000 |   numpy
import time:      7000 |    1857000 | megatron.core
"""


def test_by_package_sums_each_packages_own_time_and_counts_the_statements_imports_once():
    own, total = ip.by_package(SAMPLE)
    assert own == {"_io": pytest.approx(0.0001), "site": pytest.approx(0.002), "torch": pytest.approx(1.8),
                   "numpy": pytest.approx(0.05), "megatron": pytest.approx(0.007)}
    # site and megatron.core: the two top-level imports (megatron's cumulative holds torch's and numpy's)
    assert total == pytest.approx(0.0021 + 1.857)
    assert ip.by_package("no importtime lines") == ({}, 0.0)


def test_run_times_each_statement_in_fresh_processes_per_round_and_report_reads_them(tmp_path):
    rows = ip.run(tmp_path, {"python": "pass", "json": "import json, decimal"}, rounds=2, timeout=120,
                  python=sys.executable)
    assert [(r["name"], r["round"], r["rc"]) for r in rows] == [("python", 1, 0), ("json", 1, 0), ("python", 2, 0),
                                                                 ("json", 2, 0)]
    kept = [json.loads(line) for line in (tmp_path / "walls.jsonl").read_text().splitlines()]
    assert kept == rows and all(r["wall_s"] > 0 for r in rows)
    assert "decimal" in (tmp_path / "json_1.importtime").read_text()
    report = {(r["name"], r["round"]): r for r in ip.report(tmp_path, top=1000)}
    for rnd in (1, 2):
        row = report["json", rnd]
        assert 0 < row["import_s"] < row["wall_s"]
        assert {"json", "decimal"} <= {name for name, _ in row["top"]}
        assert "decimal" not in {name for name, _ in report["python", rnd]["top"]}


def test_a_statement_that_fails_or_hangs_is_recorded_and_the_next_one_runs(tmp_path):
    rows = ip.run(tmp_path, {"bad": "import no_such_module_here", "slow": "import time; time.sleep(30)",
                             "ok": "pass"}, rounds=1, timeout=3, python=sys.executable)
    assert [(r["name"], r["rc"]) for r in rows] == [("bad", 1), ("slow", "timeout"), ("ok", 0)]
    assert rows[1]["wall_s"] < 20
    assert "no_such_module_here" in (tmp_path / "bad_1.importtime").read_text()


def test_the_mode_lease_profiles_imports_while_the_checkpoint_pretrains_and_stops_before_main_ppo():
    script = (REPO / "benchmarks" / "h200_main_ppo" / "super_session.sh").read_text()
    start = script[script.index("\nstart)"):]
    start = start[:start.index("\n  ;;")]
    order = [start.index(s) for s in ("t_start", "rm -rf $S/imports", "setsid python3 benchmarks/h200_main_ppo/"
                                      "import_profile.py run $S/imports", "super_assets.py", "t_assets")]
    order += [start.rindex("kill -- -\\$IP"), start.index("run.py run")]
    assert order == sorted(order)
    assert start.count("kill -- -\\$IP") == 2  # also when the pretraining fails
    poll = script[script.index("\npoll)"):]
    tar = poll[poll.index("tar czf"):poll.index("assets.json", poll.index("tar czf"))]
    assert " imports" in tar  # the poll's archive brings the profile back


def test_report_reads_committed_gzipped_output_and_marks_a_missing_one(tmp_path):
    """The committed results keep ``-X importtime`` output gzipped; a process whose output did not come back is shown
    as n/a, not as 0 s of imports."""
    import gzip

    (tmp_path / "walls.jsonl").write_text('{"name": "torch", "round": 1, "rc": 0, "wall_s": 2.5}\n'
                                          '{"name": "vllm", "round": 1, "rc": 0, "wall_s": 9.0}\n')
    (tmp_path / "torch_1.importtime.gz").write_bytes(gzip.compress(SAMPLE.encode()))
    rows = {r["name"]: r for r in ip.report(tmp_path, top=2)}
    assert rows["torch"]["import_s"] == pytest.approx(0.0021 + 1.857, abs=1e-3)  # rounded to ms
    assert rows["torch"]["top"] == [["torch", 1.8], ["numpy", 0.05]]
    assert rows["vllm"]["import_s"] is None and rows["vllm"]["top"] == []


def test_the_committed_h100_profile_gives_the_figures_results_quotes():
    """RESULTS, "What verl's processes and the plugin's driver import": the figures come from the committed files."""
    base = REPO / "benchmarks" / "results" / "h100_imports"
    one = {r["name"]: r for r in ip.report(base / "round1", top=6)}
    assert round(one["verl_engines"]["wall_s"], 2) == 26.01 and round(one["verl_engines"]["import_s"], 2) == 23.80
    assert dict(one["verl_engines"]["top"])["torch"] == pytest.approx(8.76, abs=0.005)
    assert one["vllm"]["import_s"] is None  # its output did not come back from the device
    drivers = ip.report(base / "driver_rounds", top=6) + [one["verl_driver"], one["plugin_check"]]
    walls = {name: sorted(round(r["wall_s"], 2) for r in drivers if r["name"] == name)
             for name in ("verl_driver", "plugin_check")}
    assert walls == {"verl_driver": [14.28, 15.92, 17.13], "plugin_check": [29.34, 29.57, 32.53]}
    assert "6 passed, 1 skipped" in (base / "gpu_tests.log").read_text()
