"""Nothing of the user's is lost: ``--force`` never replaces a directory holding files its manifest
does not list, nor one that is (or holds) the checkpoint being read; what a killed export leaves
is cleaned up by the next one; a path that cannot be written is one line (issue 25)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.errors import ArtifactError
from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.artifacts.staging import require_replaceable, staged_output
from kiln.plugins import resolve_checkpoint
from kiln_testing import typed_manifest


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _one_line(args: list[str]) -> str:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, (result.stdout, result.stderr, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def _listed_manifest(directory: Path, files: dict[str, str]) -> None:
    manifest_mod.write(directory, typed_manifest({"files": files}))


def test_force_never_deletes_the_checkpoint_it_reads(tmp_path: Path) -> None:
    """Issue 25, item 1: the checkpoint directory with a kiln manifest.json in it, as --out."""
    ckpt = tmp_path / "X"
    shutil.copytree(resolve_checkpoint("demo"), ckpt)
    _listed_manifest(ckpt, {name: "0" * 64 for name in os.listdir(ckpt)})  # even a manifest listing every file
    before = _tree(ckpt)
    line = _one_line(["export", "--model", str(ckpt), "--out", str(ckpt), "--force"])
    assert (
        line
        == f"error: artifacts: {ckpt}: this is where the input {ckpt} lives, and kiln never replaces a directory it "
        "reads from; choose another --out"
    )
    assert _tree(ckpt) == before
    parent = _one_line(["export", "--model", str(ckpt), "--out", str(tmp_path), "--force"])  # a folder that holds it
    assert f"this is where the input {ckpt} lives" in parent and _tree(ckpt) == before


def test_force_never_deletes_the_calibration_data(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "calib.txt").write_text("def f():\n    return 1\n" * 50)
    _listed_manifest(out, {"calib.txt": "0" * 64})
    line = _one_line(
        ["export", "--model", "demo", "--out", str(out), "--force", "--int8", "--calib-data", str(out / "calib.txt")]
    )
    assert f"this is where the input {out / 'calib.txt'} lives" in line and (out / "calib.txt").is_file()


def test_force_refuses_files_the_manifest_does_not_list(tmp_path: Path) -> None:
    """Issue 25, item 2: a kiln manifest beside the user's notes.txt and mystuff/keep.txt."""
    out = tmp_path / "out"
    (out / "onnx").mkdir(parents=True)
    (out / "onnx" / "model.onnx").write_text("graph")
    (out / "mystuff").mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "mystuff" / "keep.txt").write_text("mine too")
    _listed_manifest(out, {"onnx/model.onnx": "0" * 64})
    before = _tree(out)
    with pytest.raises(ArtifactError) as err:
        require_replaceable(out, force=True)
    assert str(err.value) == (
        f"artifacts: {out}: --force replaces only an earlier kiln export whose manifest.json lists every file in "
        "it, and it does not list"
        " mystuff/keep.txt, notes.txt; nothing was deleted: move or remove it yourself"
    )
    line = _one_line(["export", "--model", "demo", "--out", str(out), "--force"])
    assert "it does not list mystuff/keep.txt, notes.txt; nothing was deleted" in line
    assert _tree(out) == before


def test_force_refuses_links_and_empty_folders_it_did_not_write(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "empty").mkdir(parents=True)
    (out / "onnx").mkdir()
    (out / "onnx" / "model.onnx").write_text("graph")
    os.symlink(tmp_path / "elsewhere", out / "link")
    _listed_manifest(out, {"onnx/model.onnx": "0" * 64})
    with pytest.raises(ArtifactError, match=r"it does not list empty/, link \(a symbolic link\); nothing was deleted"):
        require_replaceable(out, force=True)
    with pytest.raises(ArtifactError, match=r"exists and is not a directory \(a symbolic link\)"):
        require_replaceable(out / "link", force=True)


def test_force_replaces_an_export_whose_manifest_lists_everything(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "onnx").mkdir(parents=True)
    (out / "onnx" / "model.onnx").write_text("graph")
    _listed_manifest(out, {"onnx/model.onnx": "0" * 64})
    notes: list[str] = []
    with staged_output(out, force=True, note=notes.append) as tmp:
        (tmp / "new.txt").write_text("new")
    assert _tree(out) == {"new.txt": b"new"}
    assert notes == [f"{out}: replaced the earlier output; not in the new one: manifest.json, onnx/"]


def test_force_says_what_the_new_output_does_not_write_again(tmp_path: Path) -> None:
    """kiln triton's repository and kiln build's script went with an export replaced by --force, without
    a word (issue 39, item 7): one line names them (a folder the new output lacks, else the file)."""
    out = tmp_path / "out"
    files = {
        "onnx/model.onnx": "graph",
        "engines/trtexec.sh": "#!",
        "engines/timing.cache": "c",
        "triton/demo/config.pbtxt": "x",
    }
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    _listed_manifest(out, {name: "0" * 64 for name in files})
    notes: list[str] = []
    with staged_output(out, force=True, note=notes.append) as tmp:
        (tmp / "onnx").mkdir()
        (tmp / "onnx" / "model.onnx").write_text("new graph")
        (tmp / "engines").mkdir()
        (tmp / "engines" / "timing.cache").write_text("c")
        (tmp / "manifest.json").write_text("{}")
    assert notes == [f"{out}: replaced the earlier output; not in the new one: engines/trtexec.sh, triton/"]
    with staged_output(out, force=True, owner=lambda d: None, note=notes.append) as tmp:
        for name in ("onnx/model.onnx", "engines/timing.cache", "manifest.json"):
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_text("again")
    assert len(notes) == 1  # nothing went: nothing said


_KILLED = """
import sys, time
from pathlib import Path
from kiln.exporter.artifacts.staging import staged_output
with staged_output(Path(sys.argv[1]), force=True, owner=lambda d: None) as tmp:
    (tmp / "half.bin").write_bytes(b"x" * 1000)
    print("staged", flush=True)
    time.sleep(60)
"""


def _kill_while_staging(out: Path) -> int:
    child = subprocess.Popen([sys.executable, "-c", _KILLED, str(out)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "staged"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    return child.pid


def _litter(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def test_a_killed_export_is_cleaned_up_by_the_next(tmp_path: Path) -> None:
    """Issue 25, item 9: SIGKILL while staging leaves .out.tmp-*/ and .out.lock (naming the PID)."""
    out = tmp_path / "out"
    pid = _kill_while_staging(out)
    litter = _litter(out)
    assert len(litter) == 2 and litter[0] == ".out.lock" and litter[1].startswith(".out.tmp-")
    assert (tmp_path / ".out.lock").read_text().splitlines() == [str(pid), litter[1]]  # the PID, then what it made
    notes: list[str] = []
    with staged_output(out, force=False, note=notes.append) as tmp:
        (tmp / "a.txt").write_text("x")
    assert notes == [
        f"removed {tmp_path / litter[1]}: the unfinished output of an earlier kiln process (pid {pid}) that was killed"
    ]
    assert _litter(out) == [] and _tree(out) == {"a.txt": b"x"}


def test_a_directory_set_aside_by_a_killed_commit_is_put_back(tmp_path: Path) -> None:
    """Killed between moving the old export aside and renaming the new one in: the old one returns."""
    out = tmp_path / "out"
    aside = tmp_path / ".out.old-abc123"
    (aside / "out").mkdir(parents=True)
    (aside / "out" / "kept.txt").write_text("previous export")
    (tmp_path / ".out.lock").write_text("999999999\n.out.old-abc123\n")  # what the killed process recorded making
    notes: list[str] = []
    with pytest.raises(
        ArtifactError, match="output directory exists and is not empty"
    ):  # the restored one is there again
        with staged_output(out, force=False, note=notes.append):
            pass
    assert notes == [
        f"restored {out} from .out.old-abc123: an earlier kiln process (pid 999999999) was killed while replacing it"
    ]
    assert _tree(out) == {"kept.txt": b"previous export"} and _litter(out) == []


def test_out_under_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    line = _one_line(["export", "--model", "demo", "--out", str(tmp_path / "file" / "out")])
    assert (
        line
        == f"error: artifacts: {tmp_path / 'file' / 'out'}: cannot write here: {tmp_path / 'file'} is a file, not a "
        "directory; choose another --out"
    )
    assert (tmp_path / "file").read_text() == "x"


def test_out_name_too_long(tmp_path: Path) -> None:
    out = tmp_path / ("n" * 300)
    line = _one_line(["export", "--model", "demo", "--out", str(out)])
    assert (
        "cannot write here: a name in this path is longer than the file system allows" in line
        and "choose a shorter --out" in line
    )


def test_read_only_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """errno 30 on the lock (a read-only mount; root ignores permission bits, so os.open is made to fail)."""
    real = os.open

    def read_only(path: str | os.PathLike[str], flags: int, mode: int = 0o777, **kw: object) -> int:
        if str(path).endswith(".lock"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, flags, mode)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(
        ArtifactError,
        match=r"cannot write here: the file system is read-only \(.*\.out\.lock\); choose an --out on a writable one",
    ):
        with staged_output(tmp_path / "out", force=False):
            pass


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(
        ArtifactError,
        match=r"cannot write here: no space left on the device holding .*; free some space or choose another --out; "
        r"nothing was written",
    ):
        with staged_output(out, force=False) as tmp:
            (tmp / "part.bin").write_bytes(b"x")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "part.bin"))
    assert not out.exists() and _litter(out) == []


def test_second_writer_names_the_first(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with staged_output(out, force=False):
        with pytest.raises(
            ArtifactError, match=rf"another kiln process is writing this directory \(pid {os.getpid()}, lock "
        ):
            with staged_output(out, force=False):
                pass


def test_lock_file_names_the_writer(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with staged_output(out, force=False):
        assert json.loads((tmp_path / ".out.lock").read_text().splitlines()[0]) == os.getpid()
    time.sleep(0)  # released: the lock file is gone with it
    assert not (tmp_path / ".out.lock").exists()


def test_a_disk_too_small_is_refused_before_the_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights' size is known once the checkpoint loads: a disk with less free is one line
    before anything is traced or written, naming both sizes."""
    from types import SimpleNamespace

    from kiln.exporter.artifacts import staging

    monkeypatch.setattr(
        staging.shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, used=10**9 - 1000, free=1000)
    )
    out = tmp_path / "out"
    line = _one_line(["export", "--model", "demo", "--out", str(out), "--fp16", "--json"])
    assert (
        line == f"error: artifacts: {out}: the export needs at least 2.2 MB for its weights, and 0.0 MB are free on "
        f"{tmp_path}; free some space or choose another --out"
    )
    assert not out.exists() and _litter(out) == []
