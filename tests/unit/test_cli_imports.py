"""The CLI answers help, listing, hashing and bad flags without importing torch, onnxruntime or
transformers (issue 17: each of those costs seconds). Each command runs in a fresh interpreter,
which then reports the heavy modules it imported."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln_testing import heavy_imports


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (("--help",), 0),
        (("plugins",), 0),
        (("plugins", "--json"), 0),
        (("export", "--help"), 0),
        (("check", "--help"), 0),
        (("export", "--model", "demo", "--ort-int8", "--out", "OUT"), 1),  # a flag error
        (("export", "--model", "no/such-model", "--out", "OUT"), 1),  # a checkpoint that is not there
        (("export", "--model", "CKPT", "--out", "NOT_EMPTY"), 1),  # an output directory kiln refuses to replace
        (("verify", "NO_EXPORT"), 1),
    ],
    ids=[
        "help",
        "plugins",
        "plugins-json",
        "export-help",
        "check-help",
        "flag-error",
        "missing-model",
        "refused-out",
        "verify-missing",
    ],
)
def test_fast_paths_import_nothing_heavy(args: tuple[str, ...], code: int, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("mine")
    names = {"OUT": tmp_path / "out", "CKPT": ckpt, "NOT_EMPTY": tmp_path / "notes", "NO_EXPORT": tmp_path / "none"}
    assert heavy_imports(*(str(names.get(a, a)) for a in args)) == (code, [])
    assert (tmp_path / "notes" / "notes.txt").read_text() == "mine"


def test_cli_makes_pytorch_threads_passive_unless_set() -> None:
    import os
    import subprocess
    import sys

    probe = "import os; import kiln.cli; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert (
        subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        == "PASSIVE"
    )
    mine = subprocess.run(
        [sys.executable, "-c", probe],
        env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert mine.stdout.strip() == "ACTIVE"
