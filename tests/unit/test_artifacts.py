from __future__ import annotations

from pathlib import Path

import pytest

from kiln.errors import ArtifactError
from kiln.exporter.artifacts.staging import staged_output


def _litter(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}"))


def test_success_renames_into_place(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with staged_output(out, force=False) as tmp:
        (tmp / "a.txt").write_text("x")
        assert not out.exists()
    assert (out / "a.txt").read_text() == "x"
    assert _litter(tmp_path, "out") == []


def test_failure_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with staged_output(out, force=False) as tmp:
            (tmp / "a.txt").write_text("x")
            raise KeyboardInterrupt
    assert not out.exists()
    assert _litter(tmp_path, "out") == []


def test_non_empty_needs_force(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(ArtifactError, match="output directory exists and is not empty; pass --force to replace it"):
        with staged_output(out, force=False):
            pass
    assert (out / "old.txt").exists()
    with staged_output(out, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert _litter(tmp_path, "out") == []


def test_second_writer_fails_at_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with staged_output(out, force=False):
        with pytest.raises(ArtifactError, match="another kiln process is writing this directory"):
            with staged_output(out, force=False):
                pass
    assert out.is_dir()


def test_output_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("")
    with pytest.raises(ArtifactError, match="exists and is not a directory"):
        with staged_output(tmp_path / "out", force=True):
            pass
