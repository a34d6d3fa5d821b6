"""The package's shape (issue 22): no import cycle between folders or between modules, no
function over 45 statements, no module over 250 (tests, benchmarks and docs aside; counted as the
lines a statement starts on, which ruff's layout does not change: on the tree before ruff formatted it
the longest were 41 and 245, as strict as its 60 and 400 physical lines were); no target folder
(``exporter/targets/<name>/``) imports another target's folder, even for annotations (issue 42:
what targets share lives in ``exporter/patterns/``), and no file there names a model architecture
(issue 42: a target asks the family's declaration, ``DecoderSpec``).

Imports counted: every ``import``/``from ... import`` of a kiln module, at module level or inside a
function (a lazy import is still a dependency); between folders, not those under
``if TYPE_CHECKING:`` (they exist for annotations only); between modules, those too (issue 42: an
annotation names a dependency a reader follows; where one would close a circle, the lower module
states what it reads as a ``Protocol``, as ``precision.kinds.base.Asked`` does of the options).
``from pkg import name`` depends on the module ``pkg.name`` when that is one, else on ``pkg``; a
package's ``__init__`` runs before any of its modules, which is no edge.
Folders are the package's directories, with a package's ``__init__`` (its public face, the
registry of ``plugins`` and ``exporter.targets``) a node of its own, and each module at the top
of ``kiln`` and ``kiln.exporter`` (cli, errors, options, pipeline...) a node of its own.
"""

from __future__ import annotations

import ast
import re
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


def _imports(path: Path, modules: dict[str, Path], typing: bool = False) -> Iterator[str]:
    """The kiln modules ``path`` imports (``typing``: those under ``if TYPE_CHECKING:`` too)."""
    tree = ast.parse(path.read_text())
    typing_only = (
        set()
        if typing
        else {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
    )
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kiln"):
            for alias in node.names:
                yield f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("kiln"))


def _graph(typing: bool = False) -> tuple[dict[str, set[str]], dict[str, Path]]:
    modules = _modules()
    return {
        name: {m for m in _imports(path, modules, typing) if m in modules and m != name}
        for name, path in modules.items()
    }, modules


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


def test_no_module_imports_itself_round_about_even_for_annotations() -> None:
    """Issue 42: options, the precision kinds, the load stage and the targets' registry were one
    circle of 13 modules through their annotations; the plan stage (``exporter.plan``) sits above them."""
    graph, _ = _graph(typing=True)
    assert _cycles(graph) == []


def test_the_cycle_finder_sees_typing_imports(tmp_path: Path) -> None:
    lower = tmp_path / "lower.py"
    lower.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kiln.upper import U\n")
    modules = {"kiln.upper": tmp_path / "upper.py", "kiln.lower": lower}
    assert list(_imports(lower, modules)) == []
    assert list(_imports(lower, modules, typing=True)) == ["kiln.upper"]
    assert _cycles({"kiln.upper": {"kiln.lower"}, "kiln.lower": {"kiln.upper"}}) == [["kiln.lower", "kiln.upper"]]


def test_no_folder_imports_itself_round_about() -> None:
    graph, modules = _graph()
    folders: dict[str, set[str]] = defaultdict(set)
    for name, deps in graph.items():
        folders[_folder(name, modules)] |= {_folder(d, modules) for d in deps} - {_folder(name, modules)}
    assert _cycles(folders) == []


def _statements(node: ast.AST) -> int:
    """The lines a statement of ``node`` starts on (its own ``def`` line aside): its length however
    the formatter lays out a long call or a literal table."""
    return len({n.lineno for n in ast.walk(node) if isinstance(n, ast.stmt)} - {getattr(node, "lineno", 0)})


def test_functions_and_modules_stay_short() -> None:
    long_functions, long_modules = [], []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        if _statements(tree) > 250:
            long_modules.append(f"{name}: {_statements(tree)} statements")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _statements(node) > 45:
                long_functions.append(f"{name}.{node.name}: {_statements(node)} statements")
    assert long_functions == [] and long_modules == []


def test_the_length_rule_counts_statements_not_layout() -> None:
    """A call laid out over many lines is one statement; 46 statements are too many."""
    laid_out = "def f():\n    g(\n" + "        1,\n" * 80 + "    )\n"
    assert _statements(ast.parse(laid_out).body[0]) == 1
    long = "def f():\n" + "    x = 1\n" * 46
    assert _statements(ast.parse(long).body[0]) == 46


TARGETS = "kiln.exporter.targets"


def _every_kiln_import(source: str) -> Iterator[tuple[int, str]]:
    """(line, module) of every kiln import of ``source``: module level, lazy or under TYPE_CHECKING."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kiln"):
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("kiln"))


def _target_of(module: str) -> str | None:
    """The target folder a module is in or below (``ort`` for ``kiln.exporter.targets.ort.gqa``);
    None for the registry and ``targets/base.py``, which every target may import."""
    parts = module.split(".")
    return parts[3] if module.startswith(TARGETS + ".") and len(parts) > 3 and parts[3] != "base" else None


def _crossings(sources: dict[str, str]) -> list[str]:
    """ "module:line imports other" for every import, in a target's folder, of another target's."""
    found = []
    for name, source in sorted(sources.items()):
        own = _target_of(name)
        for line, imported in _every_kiln_import(source) if own is not None else ():
            other = _target_of(imported)
            if other is not None and other != own:
                found.append(f"{name}:{line} imports {imported}")
    return found


def test_the_crossing_finder_sees_lazy_and_typing_imports() -> None:
    sources = {
        "kiln.exporter.targets.onnx.graphs": (
            "from kiln.exporter.patterns.norm import x\nfrom kiln.exporter.targets.base import T\n"
        ),
        "kiln.exporter.targets.onnx.cache": "if TYPE_CHECKING:\n    from kiln.exporter.targets.ort.gqa import G\n",
        "kiln.exporter.targets.ort.rotary": "def f():\n    import kiln.exporter.targets.onnx.rotary\n",
        "kiln.exporter.targets.ort.graphs": "from kiln.exporter.targets.ort import rules\n",
        "kiln.exporter.pipeline": "from kiln.exporter.targets.ort.graphs import w\n",
    }
    assert _crossings(sources) == [
        "kiln.exporter.targets.onnx.cache:2 imports kiln.exporter.targets.ort.gqa",
        "kiln.exporter.targets.ort.rotary:2 imports kiln.exporter.targets.onnx.rotary",
    ]


def test_no_target_folder_imports_another_target() -> None:
    modules = _modules()
    sources = {name: path.read_text() for name, path in modules.items() if _target_of(name) is not None}
    assert {_target_of(name) for name in sources} >= {"ort", "onnx"}, "the target folders were not found"
    crossings = _crossings(sources)
    why = "a target imports another target's folder; move what both use to exporter/patterns/:\n"
    assert crossings == [], why + "\n".join(crossings)


def test_the_shared_patterns_import_no_target() -> None:
    modules = _modules()
    shared = {name: path for name, path in modules.items() if name.startswith("kiln.exporter.patterns")}
    assert "kiln.exporter.patterns.attention" in shared, "exporter/patterns/ was not found"
    reaching = [
        f"{name}:{line} imports {imported}"
        for name, path in sorted(shared.items())
        for line, imported in _every_kiln_import(path.read_text())
        if imported.startswith(TARGETS)
    ]
    assert reaching == [], "exporter/patterns/ is shared by the targets and imports none of them:\n" + "\n".join(
        reaching
    )


# Issue 42: a target or a precision kind is asked what it is (a declared attribute, a method:
# ``Target.lora_slots``, ``PrecisionKind.weight_block``...), never tested by name outside its folder
# (a target's: exporter/targets/<name>/; a kind's: exporter/precision/, its declaration in kinds/
# and its machinery beside it or in a package of its name, exporter/<name>/ (int4's)). Found: a name
# compared (==, !=, in), looked up ([NAME], .get(NAME)), or bound to a constant (a target's), and an
# ``isinstance`` of a kind's class. Each file allowed
# below says why the name is not a test of the target or the kind there.
NAME_ALLOWED = {
    "exporter/artifacts/layout.py": "ONNX_DIR, the export's onnx/ folder, is no target",
    "exporter/artifacts/manifest.py": "'onnx' the Python package whose version the manifest records",
    "exporter/trace/cache.py": "'onnx' the Python package whose version keys the trace cache",
    "exporter/artifacts/manifest_v1.py": "manifest v1, a frozen format, held the ort target's graphs only",
    "exporter/parity/qdq_model.py": "the Q/DQ forms parity recomputes ('int8', 'fp8': their codes' types)",
    "exporter/parity/qdq_numbers.py": "the Q/DQ forms parity recomputes ('int8', 'fp8': their codes' types)",
    # parity's second reference named in its reports (written while this test was: Precision.weight_only would say it)
    "exporter/parity/report.py": "'int4 weights' or 'Q/DQ scales': the quantized reference's name",
    "exporter/parity/results.py": "'int4 weights' or 'Q/DQ scales': the quantized reference's name",
    "exporter/targets/onnx/graphs.py": "int8's Q/DQ in the form TensorRT and ONNX Runtime load (precision.int8_form)",
}


def _named(node: ast.AST, names: set[str]) -> str | None:
    if isinstance(node, ast.Constant) and node.value in names:
        return str(node.value)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return next((found for each in node.elts if (found := _named(each, names)) is not None), None)
    return None


def _name_tests(source: str, names: set[str], classes: set[str], constants: bool) -> Iterator[tuple[int, str]]:
    """(line, name) of every test of one of ``names`` (or ``isinstance`` of one of ``classes``) in ``source``."""
    for node in ast.walk(ast.parse(source)):
        sides: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
        elif isinstance(node, ast.Subscript):
            sides = [node.slice]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            sides = node.args[:1]
        elif constants and isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            sides = [node.value]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            named = [n for arg in node.args[1:2] for n in ast.walk(arg) if isinstance(n, ast.Name) and n.id in classes]
            yield from ((node.lineno, n.id) for n in named)
        yield from ((node.lineno, found) for side in sides if (found := _named(side, names)) is not None)


def test_the_name_finder_sees_comparisons_lookups_constants_and_isinstance() -> None:
    source = (
        'if options.target in (PORTABLE, "ort"):\n    pass\n'
        'x = (manifest.targets or {})["onnx"]\ny = targets.get("ort")\nZ = "onnx"\n'
        'ok = isinstance(k, (Fp16, Int4))\nw = {"ort": 1}\nprint("onnx")\n'
    )
    found = list(_name_tests(source, {"ort", "onnx"}, {"Fp16", "Int4"}, constants=True))
    assert sorted(found) == [(1, "ort"), (3, "onnx"), (4, "ort"), (5, "onnx"), (6, "Fp16"), (6, "Int4")], found
    assert sorted(_name_tests(source, {"ort", "onnx"}, set(), constants=False)) == [(1, "ort"), (3, "onnx"), (4, "ort")]


def test_no_target_or_kind_is_tested_by_name_outside_its_folder() -> None:
    from kiln.exporter.precision.kinds.registry import KINDS, kinds
    from kiln.exporter.targets import TARGETS

    target_names, kind_names = set(TARGETS.builtins()), set(KINDS.builtins())
    kind_classes = {k.__name__ for k in kinds() if k.name in kind_names}
    assert target_names >= {"ort", "onnx"} and kind_classes >= {"Fp16", "Int8", "Fp8", "Int4"}
    found = []
    for path in sorted(_modules().values()):
        where = path.relative_to(ROOT).as_posix()
        if where in NAME_ALLOWED:
            continue
        source = path.read_text()
        own_target = where.startswith(tuple(f"exporter/targets/{t}/" for t in target_names))
        if not own_target and where != "exporter/targets/__init__.py":
            tests = _name_tests(source, target_names, set(), constants=True)
            found += [f"{where}:{line} tests the target {n!r}" for line, n in tests]
        if not where.startswith(("exporter/precision/", *(f"exporter/{k}/" for k in kind_names))):
            tests = _name_tests(source, kind_names, kind_classes, constants=False)
            found += [f"{where}:{line} tests the kind {n!r}" for line, n in tests]
    why = "ask the target or the kind (a declared attribute or method) instead of testing its name:\n"
    assert found == [], why + "\n".join(found)
    stale = [where for where in NAME_ALLOWED if not (ROOT / where).is_file()]
    assert stale == [], f"allowed files that are no more: {stale}"


# Issue 42: a target names no model family; what it asks of one is the family's declaration in the
# spec it builds (``DecoderSpec.static_state``, ``DecoderSpec.sliding_window_proved``). Found: a
# Hugging Face class name (``...ForCausalLM``, ``...ForConditionalGeneration``) anywhere in a file
# under exporter/targets/ (code, comment or docstring), or an architecture a registered family's rows
# name (``ModelFamily.specs``: ``GPT2LMHeadModel``, ``kiln-ple-decoder``).
HF_CLASS = re.compile(r"\b\w+For(?:CausalLM|ConditionalGeneration)\b")


def _architectures_named(text: str, registered: set[str]) -> list[str]:
    """The architectures ``text`` names, sorted: Hugging Face class names and the ``registered`` ones."""
    return sorted(set(HF_CLASS.findall(text)) | {name for name in registered if name in text})


def test_the_architecture_finder_sees_class_names_in_code_and_prose() -> None:
    text = (
        'PROVED = ("MistralForCausalLM",)\n# Gemma3ForConditionalGeneration wraps it\n'
        'x = \'GPT2LMHeadModel\'\n"""a causal LM, ForCausalLM alone, gpt2"""\n'
    )
    found = _architectures_named(text, {"GPT2LMHeadModel", "OPTForCausalLM"})
    assert found == ["GPT2LMHeadModel", "Gemma3ForConditionalGeneration", "MistralForCausalLM"], found


def test_no_target_names_a_model_architecture() -> None:
    from kiln.plugins import families

    specs = [spec for family in families() if callable(rows := getattr(family, "specs", None)) for spec in rows()]
    registered = {str(spec.config["architecture"]) for spec in specs if spec.config.get("architecture")}
    assert {"LlamaForCausalLM", "GPT2LMHeadModel", "kiln-ple-decoder"} <= registered, "the families' rows were not read"
    files = [
        p for p in sorted((ROOT / "exporter" / "targets").rglob("*")) if p.is_file() and "__pycache__" not in p.parts
    ]
    named = [
        f"{path.relative_to(ROOT).as_posix()} names {', '.join(found)}"
        for path in files
        if (found := _architectures_named(path.read_text(), registered))
    ]
    assert len(files) > 20 and named == [], (
        "a target asks the family's declaration (DecoderSpec), never its name:\n" + "\n".join(named)
    )
