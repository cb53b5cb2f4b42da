"""The floor plan holds (issue 34, docs/ARCHITECTURE.md "The floor plan"): the layers import only
downward, nothing imports in a circle (function-local imports counted), only ``eventlog`` imports
nats-py, module names are unique in ``gateway``, and ``benchmarks/harness`` imports no benchmark.

Read from the source with ``ast``: nothing is imported, so a circle is caught even where the
imports happen to run in a working order."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGES = (
    "schemas",
    "eventlog",
    "shardstore",
    "gateway",
    "consumers",
    "trainer_sink",
    "turnstream",
)
# What each package may import of ours (DESIGN §2, ARCHITECTURE "The floor plan").
MAY_IMPORT = {
    "schemas": set(),
    "eventlog": {"schemas"},
    "shardstore": {"schemas"},
    "gateway": {"schemas", "eventlog"},
    "consumers": {"schemas", "eventlog", "shardstore"},
    "trainer_sink": {"schemas", "eventlog", "shardstore"},
    "turnstream": set(PACKAGES) - {"turnstream"},
}


def _imports(path: Path, module: str, is_package: bool) -> Iterator[str]:
    """Every module name ``path`` imports, anywhere in it, resolved to absolute names."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _graph(root: Path, names: list[Path]) -> dict[str, set[str]]:
    """module -> the modules of the tree it imports (a name imported from a package counts as
    the submodule where there is one, else as the package)."""
    modules: dict[str, tuple[Path, bool]] = {}
    for path in names:
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (path, is_package)
    return {
        module: {name for name in _imports(path, module, pkg) if name in modules} - {module}
        for module, (path, pkg) in modules.items()
    }


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _source_graph() -> dict[str, set[str]]:
    return _graph(ROOT, [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")])


def test_the_source_has_no_import_circle() -> None:
    assert _circles(_source_graph()) == []


def test_benchmarks_have_no_import_circle_and_the_harness_imports_no_benchmark() -> None:
    bench = ROOT / "benchmarks"
    graph = _graph(bench, sorted(bench.rglob("*.py")))  # scripts import each other top-level
    assert _circles(graph) == []
    harness = {m: deps for m, deps in graph.items() if m.split(".")[0] == "harness"}
    assert {
        m: deps for m, deps in harness.items() if any(not d.startswith("harness") for d in deps)
    } == {}


def test_layers_import_only_downward() -> None:
    wrong = sorted(
        f"{module} imports {target}"
        for module, deps in _source_graph().items()
        for target in deps
        if (top := target.split(".")[0]) != module.split(".")[0]
        and top not in MAY_IMPORT[module.split(".")[0]]
    )
    assert wrong == []


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "eventlog"])
def test_only_eventlog_imports_nats(package: str) -> None:
    importers = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / package).rglob("*.py")
        if any(name.split(".")[0] == "nats" for name in _imports(path, "x", False))
    )
    assert importers == []


def test_gateway_module_names_are_unique() -> None:
    names = [p.name for p in (ROOT / "gateway").rglob("*.py") if p.name != "__init__.py"]
    assert sorted({n for n in names if names.count(n) > 1}) == []
