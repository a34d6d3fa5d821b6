"""What an adversarial pass found around ``artifacts.staging`` (stop 36), each now refused or
made whole: leftovers are the directories a killed kiln recorded in its lock file, never a
user's look-alike beside them (nor a glob's match); a directory put at ``--out`` while the
export ran is not replaced; a signal during the final renames lands after them."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln import interrupts
from kiln.errors import ArtifactError
from kiln.exporter.artifacts import staging
from kiln.exporter.artifacts.staging import staged_output


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", ["r", "run[1]"])
def test_only_what_the_lock_file_names_is_cleaned_up(tmp_path: Path, name: str) -> None:
    """A user's ``.r.old-mybackup/`` and ``.r.tmp-keep.txt`` beside ``--out`` stay, unreported;
    so does ``.run1.tmp-x``, which the glob ``.run[1].tmp-*`` matched (another export's staging)."""
    out = tmp_path / name
    kept = {
        f".{name}.old-mybackup/notes.txt": b"mine",
        f".{name}.tmp-keep.txt": b"mine too",
        ".run1.tmp-live/half.bin": b"x",
    }
    for rel, data in kept.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    killed = tmp_path / f".{name}.tmp-abcd1234"
    (killed / "half.bin").parent.mkdir()
    (killed / "half.bin").write_bytes(b"x")
    (tmp_path / f".{name}.lock").write_text(f"999999999\n.{name}.tmp-abcd1234\n../escape\n")
    notes: list[str] = []
    with staged_output(out, force=False, note=notes.append) as tmp:
        (tmp / "a.txt").write_text("new")
    assert notes == [
        f"removed {killed}: the unfinished output of an earlier kiln process (pid 999999999) that was killed"
    ]
    assert not killed.exists() and _tree(out) == {"a.txt": b"new"}
    assert {rel: (tmp_path / rel).read_bytes() for rel in kept} == kept


def test_a_directory_put_at_out_while_the_export_ran_is_not_replaced(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(ArtifactError) as refused:
        with staged_output(out, force=True, note=lambda line: None) as tmp:
            (tmp / "a.txt").write_text("new")
            out.mkdir()
            (out / "user.txt").write_text("precious")
    kept = [p for p in tmp_path.iterdir() if p.name != "out"]
    assert (
        len(kept) == 1 and kept[0].name.startswith("out.new-") and _tree(kept[0]) == {"a.txt": b"new"}
    )  # the finished work, under a name no kiln removes
    assert str(refused.value) == (
        f"artifacts: {out}: --force replaces only an empty directory or an earlier kiln export, and this holds "
        "user.txt with no manifest.json;"
        f" nothing was deleted: move or remove it yourself; what this run made is kept in {kept[0]}"
    )
    assert _tree(out) == {"user.txt": b"precious"}


@pytest.fixture
def cli_signals() -> Iterator[None]:
    """The CLI's SIGINT/SIGTERM handlers for one test, pytest's own put back after."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    interrupts.install()
    yield
    interrupts.install()  # forgets the recorded signal: a later staged_output in this worker must not see it
    for sig, handler in before.items():
        signal.signal(sig, handler)


def test_a_signal_during_the_final_renames_lands_after_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli_signals: None
) -> None:
    """SIGINT between moving the old export aside and renaming the new one in: both renames
    complete (the target was found missing, or the old one gone while the CLI said nothing was
    written); the signal is recorded for whoever looks next."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    real = os.replace
    calls: list[str] = []

    def interrupting(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        real(src, dst)
        calls.append(Path(dst).name)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # delivered here, at once, to this (the main) thread

    monkeypatch.setattr(staging.os, "replace", interrupting)
    with staged_output(out, force=True, owner=lambda d: None, note=lambda line: None) as tmp:
        (tmp / "new.txt").write_text("new")
    assert calls == ["out", "out"] and _tree(out) == {"new.txt": b"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(interrupts.Interrupted):
        interrupts.raise_if_interrupted()


def test_a_signal_during_the_check_before_the_renames_replaces_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli_signals: None
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    real = staging.require_replaceable
    checks: list[Path] = []

    def interrupted_check(*args: object, **kwargs: object) -> None:
        real(*args, **kwargs)  # type: ignore[arg-type]
        checks.append(out)
        if len(checks) == 3:  # the third: just before the renames
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(staging, "require_replaceable", interrupted_check)
    with pytest.raises(interrupts.Interrupted):
        with staged_output(out, force=True, owner=lambda d: None, note=lambda line: None) as tmp:
            (tmp / "new.txt").write_text("new")
    assert _tree(out) == {"old.txt": b"old"} and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_lock_file_stays_while_a_directory_it_names_is_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leftover the next process could not remove (here: rmtree made to fail) stays named in
    the lock file, for the one after it; the lock file goes only with the last of them."""
    out = tmp_path / "out"
    stuck = tmp_path / ".out.tmp-stuck000"
    stuck.mkdir()
    (tmp_path / ".out.lock").write_text("999999999\n.out.tmp-stuck000\n")
    monkeypatch.setattr(staging.shutil, "rmtree", lambda path, ignore_errors=False: None)
    with pytest.raises(ArtifactError):
        with staged_output(out, force=False, note=lambda line: None):
            raise ArtifactError("stopped")
    named = (
        (tmp_path / ".out.lock").read_text().splitlines()[1:]
    )  # the stuck one, then this run's own staging (not removed either)
    assert stuck.is_dir() and named[0] == ".out.tmp-stuck000" and len(named) == 2 and (tmp_path / named[1]).is_dir()
    monkeypatch.undo()
    notes: list[str] = []
    with staged_output(out, force=False, note=notes.append):
        pass
    assert (
        not stuck.exists()
        and not (tmp_path / named[1]).exists()
        and not (tmp_path / ".out.lock").exists()
        and len(notes) == 2
    )
