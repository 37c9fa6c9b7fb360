"""The two built wheels: the product (``verl-mtp-plugin``: what a cluster installs) with its recipes and without
the CPU runtime, the demo or what only the tests use; and the CPU runtime (``verl-mtp-cpu``, ``cpu_runtime/``:
the runtime of ``verl-mtp demo`` and of the CPU tests) with its loader folder.

Builds each wheel from a copy of its sources (``pip wheel --no-deps --no-build-isolation``, seconds: a copy, so
that no ``build/`` folder of an earlier build adds stale files) and reads its file list and metadata; the product
wheel's modules are then imported from the wheel, in a fresh interpreter where the CPU runtime and the demo's
packages cannot be imported. Nothing is installed and no trainer runs.
"""

from __future__ import annotations

import email.parser
import json
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

import verl_mtp_cpu
import verl_mtp_plugin
from verl_mtp_plugin.recipe_paths import CONFIG_DIR, RECIPES

PKG_DIR = pathlib.Path(verl_mtp_plugin.__file__).resolve().parent
REPO = PKG_DIR.parent
CPU_PKG_DIR = pathlib.Path(verl_mtp_cpu.__file__).resolve().parent
CPU_DIST = REPO / "cpu_runtime"
#: what the product must import without: the CPU runtime (blocked for every importer) and the demo's own packages
#: (blocked for the product's modules: verl, transformers and vLLM import safetensors and tqdm themselves)
DEMO_DEPS = ("matplotlib", "tqdm", "safetensors")


def _build(tmp_path_factory, project: pathlib.Path, package: pathlib.Path, extra: tuple[str, ...]) -> pathlib.Path:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    shutil.copytree(package, src / package.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", *extra):
        shutil.copy2(project / name, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    (whl,) = out.glob("*.whl")
    return whl


@pytest.fixture(scope="module")
def product_wheel(tmp_path_factory) -> pathlib.Path:
    return _build(tmp_path_factory, REPO, PKG_DIR, ("README.md",))


@pytest.fixture(scope="module")
def cpu_wheel(tmp_path_factory) -> pathlib.Path:
    return _build(tmp_path_factory, CPU_DIST, CPU_PKG_DIR, ())


@pytest.fixture(scope="module")
def wheel_names(product_wheel) -> list[str]:
    with zipfile.ZipFile(product_wheel) as z:
        return z.namelist()


@pytest.fixture(scope="module")
def cpu_wheel_names(cpu_wheel) -> list[str]:
    with zipfile.ZipFile(cpu_wheel) as z:
        return z.namelist()


def _metadata(whl: pathlib.Path):
    with zipfile.ZipFile(whl) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(z.read(meta).decode())


def _requires(whl: pathlib.Path) -> dict[str, str]:
    """Requirement name -> its specifier text (the base requirements, not the extras')."""
    out = {}
    for r in _metadata(whl).get_all("Requires-Dist") or []:
        if "extra ==" in r:
            continue
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(.*)", r)
        out[m.group(1).lower().replace("_", "-")] = m.group(2).strip()
    return out


# ---------------------------------------------------------------------------------------------- product


def test_the_wheel_ships_no_test_only_code(wheel_names):
    assert [n for n in wheel_names if n.startswith("verl_mtp_plugin/testing/")] == []


def test_the_product_wheel_ships_no_cpu_runtime_and_no_demo(wheel_names):
    assert [n for n in wheel_names if n.startswith("verl_mtp_cpu/")] == []
    assert [n for n in wheel_names if "/cpu/" in n or "pythonpath/" in n or n.rsplit("/", 1)[-1] == "demo.py"] == []


def test_the_wheel_ships_every_product_module(wheel_names):
    sources = {p.relative_to(REPO).as_posix() for p in PKG_DIR.rglob("*.py")}
    product = {s for s in sources if not s.startswith("verl_mtp_plugin/testing/")}
    assert product - set(wheel_names) == set()
    # and nothing else of the package: the package's modules, its recipes and the typing marker
    shipped = {n for n in wheel_names if n.startswith("verl_mtp_plugin/")}
    extra = {n for n in shipped - product if not n.startswith("verl_mtp_plugin/recipes/")}
    assert extra == {"verl_mtp_plugin/py.typed"}


def test_the_wheel_ships_the_recipes(wheel_names):
    shipped = {n for n in wheel_names if n.startswith("verl_mtp_plugin/recipes/")}
    config = CONFIG_DIR.relative_to(REPO).as_posix()
    assert {f"{config}/{name}.yaml" for name in (*RECIPES, "super_mtp_common")} <= shipped
    # one source of truth: exactly the files of the recipe folder the checkout has
    on_disk = {p.relative_to(REPO).as_posix() for p in (PKG_DIR / "recipes").rglob("*") if p.is_file()}
    assert shipped == on_disk
    # the repository's recipes/ is the package's folder, not a copy
    assert (REPO / "recipes").resolve() == (PKG_DIR / "recipes").resolve()


def test_the_product_requires_what_a_cluster_needs_and_no_demo_package(product_wheel):
    req = _requires(product_wheel)
    assert set(DEMO_DEPS) & set(req) == set()
    assert {"verl", "megatron-core", "torch", "omegaconf", "einops", "transferqueue"} <= set(req)
    # the cluster's own torch stays: a floor, no upper pin
    assert req["torch"] == ">=2.6"
    assert ">=0.19.2" in req["megatron-core"] and "<0.20" in req["megatron-core"]


_IMPORT_ALL = textwrap.dedent(
    """
    import importlib, importlib.abc, json, sys
    root, names = sys.argv[1], json.loads(sys.argv[2])
    everywhere, from_product = tuple(json.loads(sys.argv[3])), tuple(json.loads(sys.argv[4]))

    def importer():
        # the file of the import statement (or import_module call) that asks: the first frame outside importlib
        f = sys._getframe(2)
        while f and ("importlib" in f.f_code.co_filename or f.f_code.co_filename.startswith("<frozen")):
            f = f.f_back
        return f.f_code.co_filename if f else ""

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            top = name.split(".")[0]
            if top in everywhere or (top in from_product and importer().startswith(root)):
                raise ImportError(f"{name} is blocked: the product must import without it", name=name)
            return None

    sys.meta_path.insert(0, Block())
    sys.path.insert(0, root)  # the wheel's files ahead of the editable install
    loaded, failed = [], {}
    for name in names:
        try:
            mod = importlib.import_module(name)
        except BaseException as e:
            failed[name] = f"{type(e).__name__}: {e}"
            continue
        loaded.append(name if (mod.__file__ or "").startswith(root) else f"{name} from {mod.__file__}")
    print(json.dumps({"loaded": loaded, "failed": failed,
                      "cpu_runtime_loaded": sorted(m for m in sys.modules if m.split(".")[0] in everywhere)}))
    """
)


def test_the_product_wheel_imports_without_the_cpu_runtime_or_the_demo_packages(product_wheel, tmp_path):
    """Every module of the product wheel imports from the wheel's own files in a fresh interpreter where
    ``verl_mtp_cpu`` and matplotlib raise ImportError, and so do tqdm and safetensors when a product module imports
    them first (verl, vLLM and transformers, installed here, import those two themselves: an import of them from the
    cache reaches no finder, so the source check below covers them)."""
    root = tmp_path / "site"
    with zipfile.ZipFile(product_wheel) as z:
        z.extractall(root)
    names = sorted(
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for p in (root / "verl_mtp_plugin").rglob("*.py")
        if p.name != "__main__.py"  # runs the command line
    )
    assert len(names) > 40, names
    # the blocker's own check: a module of the product that imports a demo package fails
    (root / "verl_mtp_plugin" / "_blocker_check.py").write_text("def f():\n    pass\n\n\nimport matplotlib\n")
    argv = [str(root), json.dumps([*names, "verl_mtp_plugin._blocker_check"]),
            json.dumps(["verl_mtp_cpu", "matplotlib"]), json.dumps(DEMO_DEPS)]
    p = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *argv], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["failed"] == {
        "verl_mtp_plugin._blocker_check": "ImportError: matplotlib is blocked: the product must import without it"
    }
    assert out["loaded"] == names  # each from the wheel's files
    assert out["cpu_runtime_loaded"] == []


def test_the_demo_command_names_the_cpu_runtime_install_when_it_is_absent(tmp_path):
    """``verl-mtp demo`` without the CPU runtime: one line naming ``pip install ./cpu_runtime``, exit 1."""
    code = textwrap.dedent(
        """
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "verl_mtp_cpu":
                    raise ImportError(name)
                return None
        sys.meta_path.insert(0, Block())
        sys.path.insert(0, sys.argv[1])
        from verl_mtp_plugin.cli import main
        sys.exit(main(["demo", "--out", sys.argv[2]]))
        """
    )
    p = subprocess.run([sys.executable, "-c", code, str(REPO), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 1, (p.stdout, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install ./cpu_runtime" in lines[0] and "verl_mtp_cpu" in lines[0], p.stderr
    assert not (tmp_path / "out").exists()


def test_no_product_module_imports_the_cpu_runtime_or_a_demo_package(wheel_names, product_wheel):
    """Read from the wheel's sources (imports inside functions count): none of the product's modules imports
    ``verl_mtp_cpu``, matplotlib, tqdm or safetensors, but the command line's lazy ``verl-mtp demo``."""
    import ast

    found = []
    with zipfile.ZipFile(product_wheel) as z:
        for name in (n for n in wheel_names if n.startswith("verl_mtp_plugin/") and n.endswith(".py")):
            for node in ast.walk(ast.parse(z.read(name).decode(), name)):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    mods = [node.module or ""]
                else:
                    continue
                found += [(name, m) for m in mods if m.split(".")[0] in ("verl_mtp_cpu", *DEMO_DEPS)]
    assert found == [("verl_mtp_plugin/cli.py", "verl_mtp_cpu.demo")]


# ---------------------------------------------------------------------------------------------- CPU runtime


def test_the_cpu_wheel_ships_its_modules_and_the_loader_folder(cpu_wheel_names):
    sources = {p.relative_to(CPU_DIST).as_posix() for p in CPU_PKG_DIR.rglob("*.py")}
    assert "verl_mtp_cpu/demo.py" in sources and "verl_mtp_cpu/pythonpath/verl_cpu_platform.py" in sources
    assert sources - set(cpu_wheel_names) == set()
    assert [n for n in cpu_wheel_names if n.startswith("verl_mtp_plugin/")] == []


def test_the_cpu_wheel_requires_the_same_product_release_and_the_demo_packages(cpu_wheel, product_wheel):
    from verl_mtp_cpu._version import __version__ as cpu_version
    from verl_mtp_plugin._version import __version__

    assert cpu_version == __version__ == _metadata(product_wheel)["Version"] == _metadata(cpu_wheel)["Version"]
    req = _requires(cpu_wheel)
    assert req["verl-mtp-plugin"] == f"=={__version__}"
    assert set(DEMO_DEPS) <= set(req)
