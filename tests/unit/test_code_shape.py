"""The package's shape (issue 22): no import cycle between folders or between modules, no
function over 60 lines, no module over 400 (tests, benchmarks and docs aside).

Imports counted: every ``import``/``from ... import`` of a kiln module, at module level or inside a
function (a lazy import is still a dependency); not those under ``if TYPE_CHECKING:`` (they exist
for annotations only). ``from pkg import name`` depends on the module ``pkg.name`` when that is
one, else on ``pkg``; a package's ``__init__`` runs before any of its modules, which is no edge.
Folders are the package's directories, with a package's ``__init__`` (its public face, the
registry of ``plugins`` and ``exporter.targets``) a node of its own, and each module at the top
of ``kiln`` and ``kiln.exporter`` (cli, errors, options, pipeline...) a node of its own.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP = ("tests", "benchmarks", "docs", "demo", ".venv", "build")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP or any(p.startswith(".") for p in rel.parts):
            continue
        name = ".".join(("kiln", *rel.with_suffix("").parts))
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> Iterator[str]:
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kiln"):
            for alias in node.names:
                yield f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("kiln"))


def _graph() -> tuple[dict[str, set[str]], dict[str, Path]]:
    modules = _modules()
    return {name: {m for m in _imports(path, modules) if m in modules and m != name} for name, path in modules.items()}, modules


def _folder(name: str, modules: dict[str, Path]) -> str:
    if modules[name].name == "__init__.py":
        return name + " (__init__)"
    directory = name.rsplit(".", 1)[0]
    return name if directory in ("kiln", "kiln.exporter") else directory


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_round_about() -> None:
    graph, _ = _graph()
    assert _cycles(graph) == []


def test_no_folder_imports_itself_round_about() -> None:
    graph, modules = _graph()
    folders: dict[str, set[str]] = defaultdict(set)
    for name, deps in graph.items():
        folders[_folder(name, modules)] |= {_folder(d, modules) for d in deps} - {_folder(name, modules)}
    assert _cycles(folders) == []


def test_functions_and_modules_stay_short() -> None:
    long_functions, long_modules = [], []
    for name, path in _modules().items():
        text = path.read_text()
        if len(text.splitlines()) > 400:
            long_modules.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > 60:
                long_functions.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long_functions == [] and long_modules == []
