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
