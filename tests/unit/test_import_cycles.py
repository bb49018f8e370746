"""No import cycle among the `pdmesh.*` modules, found statically.

A cycle works until someone imports its modules in another order (a new entry point, a test
that imports one module alone) and then fails with a half-initialised module, and it ties
modules that should stand alone, so each is cut where it appears: usually by moving a factory
that names its implementations into a module of its own.

The graph is built from the source, nothing is imported: every `import`/`from ... import` in
every module of every package that pyproject.toml installs (its `package-dir` mapping turns
`pdmesh.x.y` into a file), at module level or inside a function (a lazy import closes a cycle
at the moment it runs). Not counted: imports under `if TYPE_CHECKING:` (they never run);
`importlib.import_module` of a computed name; the implicit run of a package's `__init__`
before its submodules (a package that re-exports its submodules would otherwise always be a
"cycle").
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Edge:
    """`source` imports `target` at `line` of the source's file."""

    source: str
    target: str
    line: int


def package_dirs(pyproject: Path) -> dict[str, Path]:
    """Every installed package and its directory, as setuptools derives it: its own
    `package-dir` entry, else its nearest mapped ancestor's directory plus the rest."""
    setuptools = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = setuptools.get("package-dir", {})
    dirs: dict[str, Path] = {}
    for package in setuptools["packages"]:
        parts = package.split(".")
        for cut in range(len(parts), 0, -1):
            base = ".".join(parts[:cut])
            if base in mapping:
                dirs[package] = ROOT.joinpath(mapping[base], *parts[cut:])
                break
        else:
            dirs[package] = ROOT.joinpath(*parts)
    return dirs


def module_files(dirs: dict[str, Path]) -> dict[str, Path]:
    """Module name → file, for every `.py` file directly in each package's directory."""
    modules: dict[str, Path] = {}
    for package, directory in dirs.items():
        for path in sorted(directory.glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of `tree` except those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of dotted `name` that is one of ours (`a.b.C` → module `a.b`)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        candidate = ".".join(parts[:cut])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """The edges from `module` to the modules of ours it imports."""
    is_package = path.stem == "__init__"
    edges: list[Edge] = []
    for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = module.split(".") if is_package else module.split(".")[:-1]
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        for target in targets:
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != module:
                edges.append(Edge(module, resolved, node.lineno))
    return edges


def import_graph() -> dict[str, list[Edge]]:
    modules = module_files(package_dirs(ROOT / "pyproject.toml"))
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, list[Edge]]) -> list[list[Edge]]:
    """One cycle (as its edges) per strongly connected component of more than one module
    (Tarjan's algorithm, iterative: the graph is a few hundred modules deep at most)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for edge in edges:
                if edge.target not in index:
                    index[edge.target] = low[edge.target] = len(index)
                    stack.append(edge.target)
                    on_stack.add(edge.target)
                    work.append((edge.target, iter(graph.get(edge.target, []))))
                    break
                if edge.target in on_stack:
                    low[node] = min(low[node], index[edge.target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: set[str], graph: dict[str, list[Edge]]) -> list[Edge]:
    """A shortest cycle through the component's first module (breadth-first, back to it)."""
    start = min(component)
    came_by: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for edge in graph[node]:
                if edge.target not in component:
                    continue
                if edge.target == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, came_by[path[0].source])
                    return path
                if edge.target not in came_by:
                    came_by[edge.target] = edge
                    following.append(edge.target)
        frontier = following
    raise AssertionError(f"no cycle through {start} in its own component")  # cannot happen


def describe(cycle: list[Edge], modules: dict[str, Path]) -> str:
    steps = [f"  {e.source} ({modules[e.source].relative_to(ROOT)}:{e.line}) imports {e.target}"
             for e in cycle]
    return " → ".join([*(e.source for e in cycle), cycle[0].source]) + "\n" + "\n".join(steps)


def test_the_graph_sees_every_package_and_lazy_imports() -> None:
    """The parser itself: mapped directories resolve, and a function-level import counts."""
    modules = module_files(package_dirs(ROOT / "pyproject.toml"))
    assert modules["pdmesh.kernels.backend"] == ROOT / "kernels" / "backend.py"
    assert modules["pdmesh.v1"] == ROOT / "protos" / "pdmesh" / "v1" / "__init__.py"
    graph = import_graph()
    selection = {e.target for e in graph["pdmesh.kernels.backend_selection"]}
    assert "pdmesh.kernels.triton_attention" in selection  # imported inside a function
    assert "pdmesh.kernels.backend" in selection
    looped = {"a": [Edge("a", "b", 1)], "b": [Edge("b", "c", 2)], "c": [Edge("c", "a", 3)]}
    assert [[e.source for e in cycle] for cycle in find_cycles(looped)] == [["a", "b", "c"]]
    assert find_cycles({"a": [Edge("a", "b", 1)], "b": []}) == []


def test_no_import_cycle() -> None:
    modules = module_files(package_dirs(ROOT / "pyproject.toml"))
    cycles = find_cycles(import_graph())
    if cycles:
        pytest.fail("import cycles:\n" + "\n".join(describe(c, modules) for c in cycles),
                    pytrace=False)
