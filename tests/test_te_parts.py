"""``benchmarks/h200_main_ppo/te_parts.py``: the Transformer Engine stage re-cut into parts that fit one device call
beside the checkout's tree, and put back together on the device."""

from __future__ import annotations

import importlib.util
import pathlib
import random

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("te_parts", ROOT / "benchmarks" / "h200_main_ppo" / "te_parts.py")
te_parts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(te_parts)
MIB = 1 << 20


def _stage(tmp_path):
    """A stage as the shared tool writes it: p1 with small files and a sub-folder, then parts of one big file's
    pieces (``core.NN``), one of them larger than the parts re-cut below."""
    rng = random.Random(0)
    files = {"p1/te_on_h200.sh": 3000, "p1/deps/a.whl": MIB // 2, "p1/core.00": MIB + 5, "p2/core.01": 3 * MIB + 7,
             "p3/core.02": MIB // 3}
    for rel, size in files.items():
        (tmp_path / "stage" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "stage" / rel).write_bytes(rng.randbytes(size))
    return tmp_path / "stage", files


def test_split_fills_parts_up_to_the_limit_and_put_rebuilds_every_file_in_any_order(tmp_path):
    stage, files = _stage(tmp_path)
    folders = te_parts.split(stage, int(1.5 * MIB))
    sizes = [sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for d in folders]
    total = sum(files.values())
    assert all(s <= 1.5 * MIB for s in sizes) and sum(sizes) == total
    assert len(folders) == -(-total // int(1.5 * MIB))  # filled before the next: no part wasted
    assert any(p.name.startswith("core.01.piece-") for d in folders for p in d.iterdir())  # the big file cut
    assert not any(p.name.startswith("te_on_h200.sh.piece") for d in folders for p in d.rglob("*"))
    dest = tmp_path / "te"
    joined = [j for d in reversed(folders) for j in te_parts.put(d, dest)]
    assert (dest / "core.01") in joined and not list(dest.rglob("*.piece-*"))
    for rel in files:
        assert (dest / pathlib.Path(rel).relative_to(pathlib.Path(rel).parts[0])).read_bytes() == (
            stage / rel).read_bytes()
    # splitting again replaces the earlier parts
    assert [d.name for d in te_parts.split(stage, 2 * MIB)] == [f"t{i:02d}" for i in range(1, 4)]
    assert not (stage / "t04").exists()


def test_a_piece_alone_is_not_joined_until_its_set_is_complete(tmp_path):
    stage, _ = _stage(tmp_path)
    folders = te_parts.split(stage, int(1.5 * MIB))
    first = next(d for d in folders if any(p.name.startswith("core.01.piece-") for p in d.iterdir()))
    assert te_parts.put(first, tmp_path / "te") == []
    assert list((tmp_path / "te").glob("core.01.piece-*")) and not (tmp_path / "te" / "core.01").exists()


def test_split_refuses_what_leaves_no_room(tmp_path):
    stage, _ = _stage(tmp_path)
    with pytest.raises(SystemExit, match="the tree is too large"):
        te_parts.split(stage, MIB // 2)
    with pytest.raises(SystemExit):
        te_parts.main(["split", str(stage), "--max-mib", "0"])
    with pytest.raises(SystemExit, match="no p1"):
        te_parts.split(tmp_path, 2 * MIB)


def test_the_default_part_size_leaves_the_tree_its_room():
    tree = te_parts.tree_bytes(ROOT)
    assert tree >= (ROOT / "benchmarks" / "RESULTS.md").stat().st_size  # tracked files count
    assert 0 < te_parts.LIMIT_MIB * MIB - tree
