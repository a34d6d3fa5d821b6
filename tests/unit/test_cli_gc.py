"""The CLI's process hides its long-lived objects from the cyclic garbage collector (``gc.freeze``): after an
export's imports, before the checkpoint is read, and when a command is over (the interpreter's finalization
otherwise walks every object several times: 0.8 s of a tiny export's wall here). A test or a library caller
that imports the CLI freezes nothing: it runs command after command in one process."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln import interrupts
from kiln.cli import main
from kiln.errors import CheckpointError
from kiln_testing import tiny_config, write_checkpoint

_AT_EXIT = """
import atexit, gc, runpy, sys
atexit.register(lambda: print("frozen", gc.get_freeze_count()))
sys.argv = ["kiln", "plugins"]
runpy.run_module("kiln.cli", run_name="__main__")
"""


def test_the_cli_program_freezes_its_objects_when_the_command_is_over() -> None:
    done = subprocess.run([sys.executable, "-c", _AT_EXIT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    frozen = int(done.stdout.strip().splitlines()[-1].removeprefix("frozen "))
    assert frozen > 10_000  # click, kiln and the standard library's modules at least


def test_a_command_run_in_process_freezes_nothing() -> None:
    before = gc.get_freeze_count()
    result = CliRunner().invoke(main, ["plugins"])
    assert result.exit_code == 0, result.output
    assert gc.get_freeze_count() == before


def test_export_freezes_after_its_imports_and_before_the_checkpoint_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kiln.exporter.pipeline as pipeline

    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    seen: list[int] = []

    def load_model(model: object) -> None:  # stands for the load: what was frozen when it began
        seen.append(gc.get_freeze_count())
        raise CheckpointError("stopped where the load begins")

    monkeypatch.setattr(interrupts, "is_program", lambda: True)
    monkeypatch.setattr(pipeline, "load_model", load_model)
    gc.unfreeze()
    try:
        result = CliRunner().invoke(main, ["export", "--model", str(ckpt), "--out", str(tmp_path / "out")])
    finally:
        gc.unfreeze()  # this test process goes on: its objects back in the collector's sight
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines()[-1] == "error: checkpoint: stopped where the load begins"
    assert seen and seen[0] > 100_000  # torch, transformers and onnxruntime's objects
