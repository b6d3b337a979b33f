"""The project's import graph stays a house with floors: the library (``swiftkv``) at the bottom,
the Serve application (``serve_apps``) on it, the jobs (``ray_jobs``) above, the benchmarks on top,
imported by nobody. No import points up a floor, and no room (a module or subpackage of
``swiftkv``, a package elsewhere) reaches itself again through the others.

Every import counts, those inside functions too: a lazy import is still a dependency."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"swiftkv": 0, "serve_apps": 1, "ray_jobs": 2, "benchmarks": 3}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for top in FLOORS for p in (ROOT / top).rglob("*.py")}


def room(module: str, modules: dict[str, Path]) -> str:
    """``swiftkv`` is divided finely (each of its modules and subpackages is a room); elsewhere a
    package is a room."""
    parts = module.split(".")
    if parts[0] == "swiftkv":
        return ".".join(parts[:2])
    is_package = modules[module].name == "__init__.py"
    return module if is_package else ".".join(parts[:-1])


def imported(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The project modules an AST imports (``from a.b import c`` is ``a.b.c`` when that is a module)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
            names.add(node.module)
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def room_graph() -> dict[str, set[str]]:
    modules = project_modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        source = room(name, modules)
        graph[source]  # every room appears, importing or not
        for target in imported(ast.parse(path.read_text()), modules):
            if room(target, modules) != source:
                graph[source].add(room(target, modules))
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one room (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def floor(room_name: str) -> int:
    return FLOORS[room_name.split(".")[0]]


def test_no_circles_and_no_arrow_up_a_floor():
    graph = room_graph()
    assert "swiftkv.modeling" in graph and "serve_apps.fleet" in graph  # the walk saw the project
    assert circles(graph) == []
    up = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if floor(b) > floor(a))
    assert up == []


def test_every_library_module_imports_without_the_applications():
    """``swiftkv`` works as a library on its own: each of its modules imports with ``serve_apps``,
    ``ray_jobs`` and ``benchmarks`` made unimportable."""
    probe = """
import importlib, importlib.abc, pkgutil, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("serve_apps", "ray_jobs", "benchmarks"):
            raise ImportError(f"{name} is an application: the library must not import it")

sys.meta_path.insert(0, Refuse())
import swiftkv
names = [m.name for m in pkgutil.walk_packages(swiftkv.__path__, "swiftkv.")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.strip().splitlines()[-1]) > 50
