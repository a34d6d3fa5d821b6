"""``artifacts.newfile.new_output``: every single file kiln writes goes through a temporary file that is
new, kiln's own and under a random name (issue 38, item 1: a fixed temporary name was written through a
planted link, and a user's file of that name deleted)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kiln import newfile
from kiln.newfile import new_output, target_of_temporary


def test_the_temporary_is_new_beside_the_target_and_renamed_over_it(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    target.write_text("old")
    with new_output(target) as temporary:
        assert temporary.parent == tmp_path and temporary.read_bytes() == b"" and temporary != target
        assert target_of_temporary(temporary.name) == "out.json"
        temporary.write_text("new")
        assert target.read_text() == "old"
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_a_failure_leaves_the_target_as_it_was_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="disk full"), new_output(target) as temporary:
        temporary.write_text("half")
        raise RuntimeError("disk full")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_a_link_at_the_target_is_replaced_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's")
    target = tmp_path / "out.json"
    target.symlink_to(victim)
    with new_output(target) as temporary:
        temporary.write_text("new")
    assert victim.read_text() == "the user's"
    assert not target.is_symlink() and target.read_text() == "new"


def test_a_planted_temporary_name_is_refused_untouched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Were the random name guessed, the exclusive, no-follow create refuses it: neither a link nor a
    user's file is opened, truncated or deleted."""
    monkeypatch.setattr(newfile.secrets, "token_hex", lambda n: "0123456789ab")
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's")
    planted = tmp_path / ".out.json.0123456789ab.kiln-tmp"
    planted.symlink_to(victim)
    with pytest.raises(FileExistsError), new_output(tmp_path / "out.json"):
        pass
    assert victim.read_text() == "the user's" and planted.is_symlink()
    planted.unlink()
    planted.write_text("mine")
    with pytest.raises(FileExistsError), new_output(tmp_path / "out.json"):
        pass
    assert planted.read_text() == "mine" and not (tmp_path / "out.json").exists()


def test_the_mode_is_open_s_less_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        with new_output(tmp_path / "a.json") as temporary:
            temporary.write_text("{}")
        with new_output(tmp_path / "run.sh", executable=True) as temporary:
            temporary.write_text("#!/bin/sh\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "run.sh").stat().st_mode) == 0o750


def test_only_its_own_temporary_names_are_recognised() -> None:
    assert target_of_temporary(".decode.plan.0123456789ab.kiln-tmp") == "decode.plan"
    for name in (
        ".decode.plan.tmp",
        "decode.plan.0123456789ab.kiln-tmp",
        ".decode.plan.0123456789.kiln-tmp",
        ".x.partial",
    ):
        assert target_of_temporary(name) is None
