"""The import graph of engine/ and service/: no cycles, and the engine never imports the service.

Data flows one way (HTTP -> engine -> scheduler -> model runner -> kernels), and so should imports:
a cycle, even one hidden in a function-level import, means two modules each need the other and
neither can be read, tested or moved alone.  Every ``import`` statement counts, wherever it sits
(module level, inside a function, under ``TYPE_CHECKING``).  An import names the module it loads:
``from engine.kv_cache.layout import x`` is an edge to ``engine.kv_cache.layout``, not to the
package ``engine.kv_cache`` whose ``__init__`` Python also runs first (a package re-exporting
its submodules would otherwise be a cycle with each of them).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "service")
# Cycles known when this test was written, each to be broken by its module's owner; the test fails on
# any other cycle, and on a listed one that is gone (so that the list only shrinks).
KNOWN_CYCLES: list[list[str]] = []


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The engine/service modules ``name`` imports, at any level of its code."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # ``from pkg import sub`` loads the submodule pkg.sub; ``from mod import name`` loads mod.
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import a.b.c`` of a non-module attribute path
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_walk_sees_function_level_and_relative_imports():
    graph = import_graph()
    # dispatch imports the native extension's loader inside a function (it builds on first use)
    assert "engine.native" in graph["engine.attention.dispatch"]
    assert "engine.kv_cache.layout" in graph["engine.attention.kernels.ref"]
    assert graph["engine.kv_cache"] >= {"engine.kv_cache.block_pool", "engine.kv_cache.manager"}


def test_a_cycle_is_found():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    new = [c for c in cycles if c not in KNOWN_CYCLES]
    assert not new, "import cycles (each line: modules that import each other, directly or not):\n" + "\n".join(
        " <-> ".join(c) for c in new
    )
    gone = [c for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, f"no longer cycles, remove them from KNOWN_CYCLES: {gone}"


def test_engine_never_imports_service():
    graph = import_graph()
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.split(".")[0] == "engine" for t in ts if t.split(".")[0] == "service")
    assert not bad, bad


def test_kv_cache_imports_nothing_above_it():
    """The KV cache is a leaf under attention and the scheduler: it must not import them back."""
    graph = import_graph()
    above = ("engine.attention", "engine.scheduler", "engine.model_runner", "engine.engine", "engine.models")
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("engine.kv_cache") for t in ts if t.startswith(above))
    assert not bad, bad
