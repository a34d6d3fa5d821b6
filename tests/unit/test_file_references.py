"""No docstring or comment of the repository's Python files points to a file that is not in the
repository.

A reference is a path ending in ``.md``, ``.py`` or ``.json`` in a comment or a docstring (of a
module, class or function). It is found when it names a file of the repository: from the root
(``docs/precisions.md``), or as the end of a file's path (``passes/stamp.py``, ``records.py``).
Not checked: the names of files kiln writes or reads in an export or a checkpoint (``ARTIFACTS``),
what a command line in a docstring writes (``--out study.json``), and other projects' files,
named with their project where they are cited (``OTHER``).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]*\w\.(?:md|py|json))\b")
OUTPUT = re.compile(r"--out\s+$")
ARTIFACTS = frozenset({
    "manifest.json", "config.json", "generation_config.json", "genai_config.json", "tokenizer.json",
    "tokenizer_config.json", "engines.json", "parity.json", "parity.md", "model.safetensors.index.json",
    "training.json", "adapter_config.json",
})  # fmt: skip
OTHER = {
    "pydoc_data/topics.py": "CPython's standard library",
    "neural_compressor/weight_only.py": "ONNX Runtime's quantizer (onnx-neural-compressor)",
    "qa/common/gen_qa_implicit_models.py": "Triton server's tests",
    "float16.py": "ONNX Runtime's fp16 converter",
    "docs/operators.md": "onnx-tensorrt's operator support matrix (the TensorRT ONNX parser)",
}


def _skipped(path: Path) -> bool:
    parts = path.relative_to(ROOT).parts
    return any(
        p.startswith(".") or p in {"build", "__pycache__", "venv", "site-packages"} or p.endswith(".egg-info")
        for p in parts
    )


def _files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*") if p.is_file() and not _skipped(p))


def comments_and_docstrings(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and every module, class and function docstring."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                yield node.body[0].lineno, docstring


def references(source: str) -> Iterator[tuple[int, str]]:
    """(line, path) of every file path a comment or docstring of ``source`` names, less the exempt ones."""
    for line, text in comments_and_docstrings(source):
        for match in REFERENCE.finditer(text):
            ref = match.group(1)
            if ref.rsplit("/", 1)[-1] in ARTIFACTS or ref in OTHER or OUTPUT.search(text[: match.start()]):
                continue
            yield line, ref


def test_the_finder_reads_comments_and_docstrings_only() -> None:
    source = (
        '"""See docs/a.md and research/b/FINDINGS.md."""\nx = "code/c.py"  # and d.json\n\ndef f():\n    '
        '"""``e/f.md``; writes --out g.json and manifest.json"""\n'
    )
    assert list(references(source)) == [(2, "d.json"), (1, "docs/a.md"), (1, "research/b/FINDINGS.md"), (5, "e/f.md")]


def test_every_file_a_comment_or_docstring_names_is_in_the_repository() -> None:
    files = [p.relative_to(ROOT).as_posix() for p in _files()]
    known = set(files)

    def found(ref: str) -> bool:
        return ref in known or any(f.endswith("/" + ref) for f in files)

    missing = [
        f"{path.relative_to(ROOT)}:{line}: {ref}"
        for path in _files() if path.suffix == ".py"
        for line, ref in references(path.read_text())
        if not found(ref)
    ]  # fmt: skip
    assert not missing, (
        "a comment or docstring names a file that is not in the repository: point it at the file that holds the fact,"
        " or state the fact inline (an export's or another project's file: see ARTIFACTS and OTHER here)\n"
        + "\n".join(missing)
    )
    assert len(files) > 100 and "docs/precisions.md" in known
