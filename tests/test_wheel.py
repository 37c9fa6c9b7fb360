"""The built wheel: the product with its recipes and CPU runtime, without what only the tests use.

Builds the wheel from a copy of the package sources (``pip wheel --no-deps --no-build-isolation``, seconds: a
copy, so that no ``build/`` folder of an earlier build adds stale files) and reads its file list; nothing is
installed and no trainer runs.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

import verl_mtp_plugin
from verl_mtp_plugin.recipe_paths import CONFIG_DIR, RECIPES

PKG_DIR = pathlib.Path(verl_mtp_plugin.__file__).resolve().parent
REPO = PKG_DIR.parent


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> list[str]:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    shutil.copytree(PKG_DIR, src / PKG_DIR.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    (whl,) = out.glob("verl_mtp_plugin-*.whl")
    with zipfile.ZipFile(whl) as z:
        return z.namelist()


def test_the_wheel_ships_no_test_only_code(wheel_names):
    assert [n for n in wheel_names if n.startswith("verl_mtp_plugin/testing/")] == []


def test_the_wheel_ships_every_product_module(wheel_names):
    sources = {p.relative_to(REPO).as_posix() for p in PKG_DIR.rglob("*.py")}
    product = {s for s in sources if not s.startswith("verl_mtp_plugin/testing/")}
    assert product - set(wheel_names) == set()
    # the CPU platform's top-level loader (a PYTHONPATH folder, not a package) and the typing marker
    assert {"cpu_runtime/verl_mtp_cpu/pythonpath/verl_cpu_platform.py", "verl_mtp_plugin/py.typed"} <= set(wheel_names)


def test_the_wheel_ships_the_recipes(wheel_names):
    shipped = {n for n in wheel_names if n.startswith("verl_mtp_plugin/recipes/")}
    config = CONFIG_DIR.relative_to(REPO).as_posix()
    assert {f"{config}/{name}.yaml" for name in (*RECIPES, "super_mtp_common")} <= shipped
    # one source of truth: exactly the files of the recipe folder the checkout has
    on_disk = {p.relative_to(REPO).as_posix() for p in (PKG_DIR / "recipes").rglob("*") if p.is_file()}
    assert shipped == on_disk
    # the repository's recipes/ is the package's folder, not a copy
    assert (REPO / "recipes").resolve() == (PKG_DIR / "recipes").resolve()

