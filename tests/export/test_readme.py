"""The README as a script: its ``kiln`` examples, run in order, as a new user runs them after Set up.

The rule, explicitly:

- A command is a line of an indented (4-space) code block of README.md that starts with
  ``kiln ``, joined with the lines after it while it ends in a backslash; and every ``kiln ...``
  part after ``&&`` in any other code line (Set up's install line ends in ``kiln export``: the
  install before it is this test environment itself).
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
match), so this stays about 6 minutes on two cores, most of it the exports. Output is not checked
here: the other tests check what each command writes.
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


def readme_commands(text: str) -> list[tuple[list[str], bool]]:
    """Every ``kiln`` command of the README's code blocks, in order (its words, as the shell
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


def test_the_rule_reads_the_readme() -> None:
    commands = readme_commands((ROOT / "README.md").read_text())
    assert commands[0] == ("kiln export --model demo --out build/demo".split(), True)  # Set up's, after its install
    assert all(not run for words, run in commands if any(w.startswith("path/to/") for w in words)), "a path/to/ example must be marked # needs:"
    assert sum(run for _, run in commands) >= 20 and sum(not run for _, run in commands) >= 5
    assert not any("#" in w for words, _ in commands for w in words)  # comments are not arguments
    continued = [words for words, _ in commands if words[:3] == ["kiln", "bench", "build/llama"]]
    assert continued and continued[0][-4:] == ["--sweep", "64,256,1024,4096", "--out", "bench.json"]  # a backslash line, joined
    stop = [words for words, _ in commands if "--stop" in words]
    assert stop and stop[0][stop[0].index("--stop") + 1] == "\\n\\n"  # as the shell passes it: kiln reads \n as a newline


def _tensorrt_missing() -> bool:
    try:
        load_tensorrt()
    except EngineError:
        return True
    return False


@pytest.mark.slow
def test_every_readme_example_runs_in_order(tmp_path: Path) -> None:
    (tmp_path / "demo").symlink_to(ROOT / "demo")
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    missing_trt = _tensorrt_missing()
    for words, run in readme_commands((ROOT / "README.md").read_text()):
        if not run:
            continue
        args = words[1:]
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "kiln.cli", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        print(f"{time.perf_counter() - start:6.1f} s  {shlex.join(words)}")  # shown with -s, or when a later command fails
        where = f"{shlex.join(words)}\n--- exit {done.returncode}; stderr:\n{done.stderr[-3000:]}"
        if args[0] == "build" and missing_trt:
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: engine: TensorRT is not installed"), where
        else:
            assert done.returncode == 0, where
