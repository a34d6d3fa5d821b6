from __future__ import annotations

from pathlib import Path

import pytest

from kiln.errors import ArtifactError
from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.artifacts.staging import listing, require_replaceable, staged_output
from kiln_testing import typed_manifest


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


def _earlier_export(out: Path) -> Path:
    out.mkdir()
    (out / "onnx").mkdir()
    (out / "onnx" / "old.onnx").write_text("old")
    manifest_mod.write(out, typed_manifest({"files": {"onnx/old.onnx": "0" * 64}}))  # a kiln export lists its files
    return out


def _unrelated(out: Path) -> Path:
    """A folder kiln did not write: notes.txt and sub/ (with a file of its own)."""
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "sub" / "data.bin").write_bytes(b"\x00\x01")
    return out


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_non_empty_needs_force(tmp_path: Path) -> None:
    out = _earlier_export(tmp_path / "out")
    with pytest.raises(ArtifactError, match="output directory exists and is not empty; pass --force to replace it"):
        with staged_output(out, force=False):
            pass
    assert (out / "onnx" / "old.onnx").exists()
    with staged_output(out, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert _litter(tmp_path, "out") == []


def test_force_refuses_a_directory_kiln_did_not_write(tmp_path: Path) -> None:
    out = _unrelated(tmp_path / "out")
    before = _tree(out)
    with pytest.raises(ArtifactError) as err:
        with staged_output(out, force=True):
            raise AssertionError("the block must not run")
    assert str(err.value) == (
        f"artifacts: {out}: --force replaces only an empty directory or an earlier kiln export, and this holds "
        "notes.txt, sub/"
        " with no manifest.json; nothing was deleted: move or remove it yourself"
    )
    assert _tree(out) == before and _litter(tmp_path, "out") == []
    (out / "manifest.json").write_text('{"manifest_version": 99}')  # not one kiln wrote (or this kiln reads)
    with pytest.raises(
        ArtifactError,
        match=r"this holds manifest.json, notes.txt, sub/ with a manifest.json this kiln does not accept; nothing was "
        r"deleted",
    ):
        with staged_output(out, force=True):
            pass
    assert (out / "sub" / "data.bin").read_bytes() == b"\x00\x01"


def test_force_lists_a_long_directory_briefly(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for i in range(8):
        (out / f"f{i}.txt").write_text("x")
    assert listing(out) == "f0.txt, f1.txt, f2.txt, f3.txt, f4.txt (and 3 more)"
    with pytest.raises(
        ArtifactError, match=r"this holds f0.txt, f1.txt, f2.txt, f3.txt, f4.txt \(and 3 more\) with no manifest.json"
    ):
        require_replaceable(out, force=True)


def test_empty_directory_is_replaced_without_force(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with staged_output(out, force=False) as tmp:
        (tmp / "a.txt").write_text("x")
    assert _tree(out) == {"a.txt": b"x"}


def test_custom_owner_decides(tmp_path: Path) -> None:
    out = _unrelated(tmp_path / "out")
    with staged_output(out, force=True, owner=lambda d: None) as tmp:  # an owner that recognises it
        (tmp / "a.txt").write_text("x")
    assert _tree(out) == {"a.txt": b"x"}
    with pytest.raises(ArtifactError, match=r"^artifacts: .*out: not mine; nothing was deleted"):
        require_replaceable(out, force=True, owner=lambda d: "not mine")


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
