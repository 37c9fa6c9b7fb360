"""The package's layout holds: a core that imports neither verl nor vLLM, edge sub-packages that import
the core (never the other way round), no import circle, each edge sub-package importable on its own; the
product imports nothing of the CPU runtime (``verl_mtp_cpu``, the second distribution) but the demo, from
the command line, lazily.

Imports are read from the source (AST), not from a running interpreter, so an import inside a function
counts as much as one at module level. Every ``import``, ``from ... import`` (relative ones resolved)
and ``importlib.import_module("<constant>")`` of a ``verl_mtp_plugin`` or ``verl_mtp_cpu`` module is an edge
of the graph.
Not an edge: the implicit import of a module's parent packages (Python runs ``verl_mtp_plugin/__init__``
before any submodule; the package ``__init__`` files import only what they re-export, which the graph
does contain).
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

import verl_mtp_cpu
import verl_mtp_plugin

PKG = "verl_mtp_plugin"
ROOT = pathlib.Path(verl_mtp_plugin.__file__).resolve().parent
#: the CPU runtime and the demo: the repository's second distribution (cpu_runtime/), not the product
CPU_ROOT = pathlib.Path(verl_mtp_cpu.__file__).resolve().parent
PKGS = (PKG, "verl_mtp_cpu")

#: The core: what the edges build on. None of it may import verl or vLLM (policy: not even torch).
CORE = (
    "verl_mtp_plugin._version",
    "verl_mtp_plugin.policy",
    "verl_mtp_plugin.control",
    "verl_mtp_plugin.compat",
    "verl_mtp_plugin.compat.megatron_mtp_skip",
    "verl_mtp_plugin.compat.megatron_loss",
    "verl_mtp_plugin.compat.megatron_mtp_head",
    "verl_mtp_plugin.compat.probes",
    "verl_mtp_plugin.compat.verl_entry",
    "verl_mtp_plugin.compat.checkpoint_resume",
    "verl_mtp_plugin.compat.verl_weight_sender",
    "verl_mtp_plugin.compat.verl_replay_buffer",
    "verl_mtp_plugin.verl_config",
    "verl_mtp_plugin.export",
    "verl_mtp_plugin.export.names",
    "verl_mtp_plugin.export.gather",
    "verl_mtp_plugin.export.drafter",
    "verl_mtp_plugin.acceptance",
    "verl_mtp_plugin.acceptance.estimate",
    "verl_mtp_plugin.acceptance.probe",
    "verl_mtp_plugin.loss_mask",
    "verl_mtp_plugin.metrics",
    "verl_mtp_plugin.objective",
    "verl_mtp_plugin.config_keys",
    "verl_mtp_plugin.recipe_paths",
    "verl_mtp_plugin.spec_schedule",
)
#: Edge sub-package -> the other edge sub-packages it may import (verl's trainer drives its workers).
EDGES = {
    "verl_mtp_plugin.engine": (),
    "verl_mtp_plugin.rollout": (),
    "verl_mtp_plugin.trainer": ("verl_mtp_plugin.engine", "verl_mtp_plugin.rollout"),
}
#: Entry points and harnesses: on top, imported by nothing inside the package but themselves.
TOP = ("verl_mtp_plugin.cli", "verl_mtp_cpu.demo", "verl_mtp_plugin.main_ppo", "verl_mtp_plugin.__main__")
#: The CPU runtime (``verl-mtp demo`` runs verl on it): builds on the core and the edges, below the entry points.
CPU = "verl_mtp_cpu"
#: The one import of the CPU runtime inside the product: ``verl-mtp demo`` (lazily, naming the install when absent).
PRODUCT_TO_CPU = {("verl_mtp_plugin.cli", "verl_mtp_cpu.demo")}
#: What only the tests use (not shipped in the wheel): may import anything but the entry points; nothing
#: outside it imports it.
TESTING = "verl_mtp_plugin.testing"


def _module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    """Every module of both packages (the pythonpath/ loader of the CPU runtime is not a package module)."""
    out = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    out.update({_module_name(p, CPU_ROOT): p for p in sorted(CPU_ROOT.rglob("*.py")) if "pythonpath" not in p.parts})
    return out


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Package modules that ``name`` imports anywhere in its source (module level or in functions)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        # the deepest known module named by `target` (a.b.c where c may be an attribute)
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PKGS):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith(PKGS):
                continue
            for alias in node.names:
                full = f"{mod}.{alias.name}"
                add(full if full in known else mod)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and node.args[0].value.startswith(PKGS)
        ):
            add(node.args[0].value)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                cycle = visit(m)
                if cycle:
                    return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            cycle = visit(n)
            if cycle:
                return cycle
    return None


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _edge_of(module: str) -> str | None:
    return next((e for e in EDGES if _in(module, e)), None)


# ---------------------------------------------------------------------------------------------- graph


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    """The reader itself: an import inside a function, a relative import and importlib all count."""
    pkg = tmp_path / PKG
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("def f():\n    from verl_mtp_plugin.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from . import c\n")
    (pkg / "sub" / "c.py").write_text("import importlib\nimportlib.import_module('verl_mtp_plugin.a')\n")
    known = {f"{PKG}.a", f"{PKG}.sub", f"{PKG}.sub.b", f"{PKG}.sub.c"}
    graph = {
        f"{PKG}.a": _imports(f"{PKG}.a", pkg / "a.py", known),
        f"{PKG}.sub.b": _imports(f"{PKG}.sub.b", pkg / "sub" / "b.py", known),
        f"{PKG}.sub.c": _imports(f"{PKG}.sub.c", pkg / "sub" / "c.py", known),
    }
    assert graph == {f"{PKG}.a": {f"{PKG}.sub.b"}, f"{PKG}.sub.b": {f"{PKG}.sub.c"}, f"{PKG}.sub.c": {f"{PKG}.a"}}
    assert _find_cycle(graph) == [f"{PKG}.a", f"{PKG}.sub.b", f"{PKG}.sub.c", f"{PKG}.a"]


def test_no_import_circle_among_the_package_modules():
    graph = import_graph()
    assert set(CORE) <= set(graph), sorted(set(CORE) - set(graph))
    assert all(e in graph for e in EDGES)
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))


def test_imports_point_from_the_edges_to_the_core_never_back():
    graph = import_graph()
    wrong = []
    for mod, targets in sorted(graph.items()):
        for t in sorted(targets):
            if mod in CORE:
                ok = t in CORE
            elif _edge_of(mod):
                edge = _edge_of(mod)
                ok = t in CORE or _in(t, edge) or any(_in(t, e) for e in EDGES[edge])
            elif _in(mod, CPU):
                ok = not ((t in TOP and mod not in TOP) or _in(t, TESTING))
            elif _in(mod, TESTING):
                ok = t not in TOP
            else:  # the package __init__ and the entry points
                ok = (mod in TOP or t not in TOP) and not _in(t, TESTING)
            if _in(mod, PKG) and not _in(mod, TESTING) and _in(t, CPU):  # the product never needs the CPU runtime
                ok = (mod, t) in PRODUCT_TO_CPU
            if not ok:
                wrong.append(f"{mod} -> {t}")
    assert wrong == []
    # and every module is in exactly one place of the plan
    def placed(m):
        return m in CORE or _edge_of(m) or m in TOP or _in(m, CPU) or _in(m, TESTING) or m in PKGS

    unplaced = [m for m in graph if not placed(m)]
    assert unplaced == []


# ---------------------------------------------------------------------------------------------- core


def _fresh_import(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_REPORT = (
    "import json, sys; "
    "top = sorted({m.split('.')[0] for m in sys.modules}); "
    "ours = sorted(m for m in sys.modules if m.startswith('verl_mtp_plugin')); "
    "print(json.dumps({'top': top, 'ours': ours}))"
)


@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_neither_verl_nor_vllm(module):
    loaded = _fresh_import(f"import {module}; {_REPORT}")
    assert module in loaded["ours"]
    heavy = {"verl", "vllm"} if module != "verl_mtp_plugin.policy" else {"verl", "vllm", "torch"}
    assert heavy & set(loaded["top"]) == set()
    assert [m for m in loaded["ours"] if _edge_of(m) or m in TOP] == []


# ---------------------------------------------------------------------------------------------- edges


@pytest.mark.parametrize("edge", sorted(EDGES))
def test_each_edge_sub_package_imports_alone(edge):
    """Every module of the edge imports in a fresh interpreter, pulling in only the core (and, for the
    trainer side, the engine and rollout sides it drives)."""
    modules = sorted(m for m in import_graph() if _in(m, edge))
    assert len(modules) > 1, modules
    loaded = _fresh_import("import " + ", ".join(modules) + f"; {_REPORT}")
    assert set(modules) <= set(loaded["ours"])
    foreign = [
        m
        for m in loaded["ours"]
        if (_edge_of(m) and _edge_of(m) != edge and _edge_of(m) not in EDGES[edge]) or m in TOP
    ]
    assert foreign == []
