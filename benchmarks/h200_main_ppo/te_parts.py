"""Re-cut the Transformer Engine stage (``../shared/tools/h200-te/prepare_te_stage.sh``: ``.te-stage/p1 .. p6``) into
parts that fit one device call beside this checkout's tree.

The device tool carries at most 64 MiB per call: the tracked tree, untracked files git does not ignore, and the
carried paths. The shared tool cuts its stream into parts of ~52 MB, which stopped fitting once the tracked tree
passed ~13.4 MB (2026-12-06: 13.6 MB tracked, every ``.te-stage/pK`` call refused).

``split [STAGE]`` (here): every file of ``STAGE/p*`` (in part order) packed into ``STAGE/tNN`` folders of at most
``--max-mib`` (default: 64 MiB less this tree less ``--margin-mib``); a file larger than that is cut into
``NAME.piece-II-of-NN`` files. Prints one line per folder: the device command that puts it in place.

``put DIR [DEST]`` (on the device): copies ``DIR`` into ``DEST`` (default ``/tmp/te``) and joins every file whose
pieces are all there (``cat`` in order, the pieces removed), so the parts can come in any order.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys

LIMIT_MIB = 64.0  # the device tool's carry limit per call
_PIECE = re.compile(r"^(?P<name>.+)\.piece-(?P<i>\d{2})-of-(?P<n>\d{2})$")


def tree_bytes(repo: pathlib.Path) -> int:
    """The bytes of what a device call sends besides its carried paths: tracked files and untracked files git does
    not ignore."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         check=True, capture_output=True).stdout
    total = 0
    for name in out.split(b"\0"):
        p = repo / os.fsdecode(name)
        if name and p.is_file():
            total += p.stat().st_size
    return total


def _files(stage: pathlib.Path) -> list[tuple[pathlib.Path, pathlib.Path]]:
    """``(file, path relative to its part)`` of every file of ``stage/p1 .. pN``, parts in numeric order."""
    parts = sorted((d for d in stage.iterdir() if d.is_dir() and re.fullmatch(r"p\d+", d.name)),
                   key=lambda d: int(d.name[1:]))
    if not parts:
        raise SystemExit(f"te_parts: no p1 .. pN folders in {stage}")
    return [(f, f.relative_to(d)) for d in parts for f in sorted(d.rglob("*")) if f.is_file()]


def split(stage: pathlib.Path, max_bytes: int) -> list[pathlib.Path]:
    """Pack ``stage``'s files into ``stage/tNN`` folders of at most ``max_bytes`` each, filling each folder before
    the next (a file that does not fit whole is cut at the folder's end); return the folders."""
    if max_bytes < 1 << 20:
        raise SystemExit(f"te_parts: --max-mib leaves {max_bytes / 2**20:.2f} MiB per part: the tree is too large")
    for old in stage.glob("t[0-9][0-9]"):
        shutil.rmtree(old)
    plan: list[tuple[pathlib.Path, pathlib.Path, list[tuple[int, int, int]]]] = []  # (folder, offset, bytes) runs
    folder, used = 0, 0
    for f, rel in _files(stage):
        size, off, runs = f.stat().st_size, 0, []
        if 0 < used and used + size > max_bytes and size <= max_bytes:
            folder, used = folder + 1, 0  # a file that fits a folder whole is not cut
        while off < size or not runs:
            if used == max_bytes:
                folder, used = folder + 1, 0
            n = min(size - off, max_bytes - used)
            runs.append((folder, off, n))
            off, used = off + n, used + n
        plan.append((f, rel, runs))
    if any(len(runs) > 99 for _, _, runs in plan):
        raise SystemExit(f"te_parts: a file would need more than 99 pieces of {max_bytes} bytes")
    folders = [stage / f"t{i + 1:02d}" for i in range(folder + 1)]
    for f, rel, runs in plan:
        with open(f, "rb") as src:
            for i, (k, off, n) in enumerate(runs):
                name = rel.name if len(runs) == 1 else f"{rel.name}.piece-{i:02d}-of-{len(runs):02d}"
                dest = folders[k] / rel.parent / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                src.seek(off)
                dest.write_bytes(src.read(n))
    return [d for d in folders if d.exists()]


def put(src: pathlib.Path, dest: pathlib.Path) -> list[pathlib.Path]:
    """Copy ``src`` into ``dest`` and join every file whose pieces are all in ``dest``; return the joined files."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dest, dirs_exist_ok=True)
    groups: dict[tuple[pathlib.Path, int], dict[int, pathlib.Path]] = {}
    for p in dest.rglob("*.piece-*-of-*"):
        m = _PIECE.match(p.name)
        if m:
            groups.setdefault((p.parent / m["name"], int(m["n"])), {})[int(m["i"])] = p
    joined = []
    for (target, n), pieces in sorted(groups.items()):
        if len(pieces) < n:
            continue
        with open(target, "wb") as out:
            for i in range(n):
                with open(pieces[i], "rb") as f:
                    shutil.copyfileobj(f, out)
        for p in pieces.values():
            p.unlink()
        joined.append(target)
    return joined


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="re-cut STAGE/p* into STAGE/tNN folders that fit a device call")
    s.add_argument("stage", nargs="?", default=".te-stage")
    s.add_argument("--max-mib", type=float, default=None, help="per folder (default: what the tree leaves)")
    s.add_argument("--margin-mib", type=float, default=2.0)
    p = sub.add_parser("put", help="on the device: copy DIR into DEST, join complete pieces")
    p.add_argument("src")
    p.add_argument("dest", nargs="?", default="/tmp/te")
    a = ap.parse_args(argv)
    if a.cmd == "put":
        for f in put(pathlib.Path(a.src), pathlib.Path(a.dest)):
            print(f"joined {f}")
        print(f"{a.dest}: {sum(1 for _ in pathlib.Path(a.dest).iterdir())} entries")
        return 0
    stage = pathlib.Path(a.stage)
    if a.max_mib is not None and a.max_mib <= 0:
        ap.error(f"--max-mib must be > 0, got {a.max_mib}")
    repo = pathlib.Path(__file__).resolve().parents[2]
    max_mib = a.max_mib if a.max_mib is not None else LIMIT_MIB - tree_bytes(repo) / 2**20 - a.margin_mib
    folders = split(stage, int(max_mib * 2**20))
    for d in folders:
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        print(f'carry ["{d}"] ({size / 2**20:.1f} MiB): python3 benchmarks/h200_main_ppo/te_parts.py put {d}')
    return 0


if __name__ == "__main__":
    sys.exit(main())
