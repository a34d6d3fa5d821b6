"""The README and the docs as a script: their ``kiln`` examples, run in order, as a new user runs
them after Set up.

The rule, explicitly:

- The files are read in this order: README.md, then ``DOCS`` (the pages of the README's
  Documentation table, in its order; every ``docs/*.md`` is one of them). An example may use what
  an earlier one wrote, in the same file or an earlier one (the docs reuse the README's exports).
- A command is a line of an indented (4-space) code block of one of them that starts with
  ``kiln ``, joined with the lines after it while it ends in a backslash; and every ``kiln ...``
  part after ``&&`` in any other code line (Set up's install line ends in ``kiln export``: the
  install before it is this test environment itself). No fenced code block holds a ``kiln`` line
  (checked below): an example is an indented block, so this rule sees it.
- A command whose line ends in a comment starting ``# needs:`` is not run: it needs what a CI
  machine lacks (the user's checkpoint, a Llama, the peers' exports, TensorRT and a GPU).
  A command naming a ``path/to/...`` must be marked so (checked below).
- Every other command must exit 0, except ``kiln build`` where TensorRT cannot be loaded
  (``load_tensorrt`` raises): there it must exit 1 with exactly one line on stderr saying that
  TensorRT is not installed, as the README documents.
- ``kiln`` runs as ``python -m kiln.cli`` under this interpreter, in a temporary directory that
  holds a link ``demo`` to the repository's ``demo/`` (the examples read
  ``demo/checkpoint/heldout.txt``), with HOME inside it (the default calibration cache).

The examples use small flags where that does not hurt (``--parity-tokens 16``, ``--runs 20``;
not ``--calib-samples`` below the default: with 8 windows the int8+fp16 example fails its token
match), and each export is written once (a page names the exports of earlier ones instead of
repeating them), so this stays about 6 minutes on two cores, most of it the exports. Output is
not checked here: the other tests check what each command writes.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.errors import EngineError
from kiln.exporter.engine.build import load_tensorrt

ROOT = Path(__file__).resolve().parents[2]
NEEDS = re.compile(r"\s#\s*needs:")
DOCS = (
    "docs/commands.md",
    "docs/precisions.md",
    "docs/ort-target.md",
    "docs/onnx-target.md",
    "docs/parity.md",
    "docs/architectures.md",
    "docs/how-it-works.md",
    "docs/benchmarks.md",
    "docs/cpp-host.md",
)
FILES = ("README.md", *DOCS)


def readme_commands(text: str) -> list[tuple[list[str], bool]]:
    """Every ``kiln`` command of a Markdown file's code blocks, in order (its words, as the shell
    splits them, comment dropped), with whether it is run."""
    lines = [line[4:] for line in text.splitlines() if line.startswith("    ") and line.strip()]
    joined: list[str] = []
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1].rstrip() + " " + line.strip()
        else:
            joined.append(line.strip())
    commands = []
    for line in joined:
        if not line.startswith("kiln ") and "&& kiln " not in line:
            continue
        run = not NEEDS.search(line)
        words = shlex.split(line, comments=True)
        parts: list[list[str]] = [[]]
        for word in words:
            if word == "&&":
                parts.append([])
            else:
                parts[-1].append(word)
        commands += [(part, run) for part in parts if part[:1] == ["kiln"]]
    return commands


def all_commands() -> list[tuple[str, list[str], bool]]:
    """The commands of every file of ``FILES``, in that order, each with its file."""
    return [(name, words, run) for name in FILES for words, run in readme_commands((ROOT / name).read_text())]


def fenced_kiln_lines(text: str) -> list[str]:
    """The lines of fenced (```) code blocks that start with ``kiln ``: examples the rule would miss."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced and line.strip().startswith("kiln "):
            found.append(line.strip())
    return found


def test_the_rule_reads_the_readme_and_the_docs() -> None:
    assert sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")) == sorted(DOCS), (
        "a page of docs/ is missing from DOCS"
    )
    readme = (ROOT / "README.md").read_text()
    documentation = readme[readme.index("## Documentation") :]
    assert [d for d in re.findall(r"\]\((docs/[\w.-]+\.md)\)", documentation) if d in DOCS] == list(DOCS), (
        "DOCS is the README's Documentation order"
    )
    assert not [(name, line) for name in FILES for line in fenced_kiln_lines((ROOT / name).read_text())], (
        "a kiln example in a fenced block"
    )
    commands = all_commands()
    assert commands[0] == (
        "README.md",
        "kiln export --model demo --out build/demo".split(),
        True,
    )  # Set up's, after its install
    assert all(not run for _, words, run in commands if any(w.startswith("path/to/") for w in words)), (
        "a path/to/ example must be marked # needs:"
    )
    assert sum(run for *_, run in commands) >= 20 and sum(not run for *_, run in commands) >= 5
    assert {name for name, _, run in commands if run} >= {
        "README.md",
        "docs/commands.md",
        "docs/precisions.md",
        "docs/ort-target.md",
    }
    assert not any("#" in w for _, words, _ in commands for w in words)  # comments are not arguments
    continued = [words for _, words, _ in commands if words[:3] == ["kiln", "bench", "build/llama"]]
    assert continued and continued[0][-4:] == [
        "--sweep",
        "64,256,1024,4096",
        "--out",
        "bench.json",
    ]  # a backslash line, joined
    stop = [words for _, words, _ in commands if "--stop" in words]
    assert (
        stop and stop[0][stop[0].index("--stop") + 1] == "\\n\\n"
    )  # as the shell passes it: kiln reads \n as a newline
    exports = [
        words[words.index("--out") + 1]
        for _, words, run in commands
        if run and words[1] == "export" and "--force" not in words
    ]
    assert len(exports) == len(set(exports)), "an export is written once: later examples reuse it"


def _tensorrt_missing() -> bool:
    try:
        load_tensorrt()
    except EngineError:
        return True
    return False


@pytest.mark.slow
def test_every_example_runs_in_order(tmp_path: Path) -> None:
    (tmp_path / "demo").symlink_to(ROOT / "demo")
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    missing_trt = _tensorrt_missing()
    for name, words, run in all_commands():
        if not run:
            continue
        args = words[1:]
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "kiln.cli", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        print(
            f"{time.perf_counter() - start:6.1f} s  {name}: {shlex.join(words)}"
        )  # shown with -s, or when a later command fails
        where = f"{name}: {shlex.join(words)}\n--- exit {done.returncode}; stderr:\n{done.stderr[-3000:]}"
        if args[0] == "build" and missing_trt:
            lines = done.stderr.strip().splitlines()
            assert (
                done.returncode == 1
                and len(lines) == 1
                and lines[0].startswith("error: engine: TensorRT is not installed")
            ), where
        else:
            assert done.returncode == 0, where
