"""``kiln.inputs``: every file kiln reads is a regular file of a size its reader allows, checked before
it is opened (issue 38, item 3: a FIFO named config.json hung kiln, a link to /dev/zero read until
MemoryError). Refusals are one ``KilnError`` naming the file and what it is."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import numpy as np
import pytest

from kiln import inputs
from kiln.calibration.cache import read_cache
from kiln.calibration.data import load_calibration_data
from kiln.errors import ArtifactError, CalibrationError, ConfigError
from kiln.exporter.artifacts.hashing import sha256_file
from kiln.inputs import check_input, describe, open_input, read_input, size_text
from kiln_testing import exact

NOT_REGULAR = "not a regular file; kiln reads only regular files"
NOT_FOLLOWED = "which kiln does not follow here; put the file itself there"


@pytest.fixture(autouse=True)
def _no_hang() -> Iterator[None]:
    """A read that blocks (a FIFO opened without O_NONBLOCK) fails the test instead of hanging it."""

    def hung(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError("blocked on a special file")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def test_a_regular_file_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b'{"a": 1}')
    assert read_input(path, ConfigError, 8) == b'{"a": 1}'
    with open_input(path, ConfigError, None) as file:
        assert file.read() == b'{"a": 1}'
    check_input(path, ConfigError, 8)


def test_a_fifo_is_refused_unopened(tmp_path: Path) -> None:
    path = _fifo(tmp_path / "config.json")
    for call in (check_input, open_input, read_input):
        with pytest.raises(ConfigError, match=exact(f"config: {path}: a FIFO, {NOT_REGULAR}")):
            call(path, ConfigError, 1 << 20)


def test_a_device_a_socket_and_a_directory_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=exact(f"config: /dev/null: a character device, {NOT_REGULAR}")):
        read_input(Path("/dev/null"), ConfigError, 1 << 20)
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "s"))
        with pytest.raises(ConfigError, match=exact(f"config: {tmp_path / 's'}: a socket, {NOT_REGULAR}")):
            read_input(tmp_path / "s", ConfigError, 1 << 20)
    with pytest.raises(ConfigError, match=exact(f"config: {tmp_path}: a directory, {NOT_REGULAR}")):
        read_input(tmp_path, ConfigError, 1 << 20)


def test_a_link_is_followed_and_named_or_refused_under_the_no_link_rule(tmp_path: Path) -> None:
    device = tmp_path / "manifest.json"
    device.symlink_to("/dev/null")
    message = f"config: {device} (a link to /dev/null): a character device, {NOT_REGULAR}"
    with pytest.raises(ConfigError, match=exact(message)):
        read_input(device, ConfigError, 1 << 20)
    target = tmp_path / "real.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert read_input(link, ConfigError, 8) == b"{}"
    refusal = f"config: {link}: a symbolic link (to {target}), {NOT_FOLLOWED}"
    for call in (check_input, open_input, read_input):
        with pytest.raises(ConfigError, match=exact(refusal)):
            call(link, ConfigError, 8, links=False)


def test_a_file_over_the_cap_is_refused_by_its_size(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b" " * 2000)
    message = f"config: {path}: 2 KB, more than a config or manifest may be (1 KB); not read"
    with pytest.raises(ConfigError, match=exact(message)):
        read_input(path, ConfigError, 1000, what="a config or manifest")
    assert read_input(path, ConfigError, 2000) == b" " * 2000


def test_a_read_never_takes_more_than_the_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that grew after its stat (or one of /proc's, which say size 0) is read up to the cap only."""
    path = tmp_path / "grown.json"
    path.write_bytes(b"x" * 10)
    monkeypatch.setattr(inputs, "_refuse", lambda *args: None)  # what the stat and fstat saw: a small file
    with pytest.raises(ConfigError, match=exact(f"config: {path}: more than this file may be (5 B); not read")):
        read_input(path, ConfigError, 5)


def test_a_fifo_swapped_in_after_the_stat_is_refused_after_the_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stat saw a regular file; a FIFO is there by the open, which O_NONBLOCK keeps from waiting,
    and fstat refuses what was opened."""
    path = _fifo(tmp_path / "config.json")
    monkeypatch.setattr(inputs, "check_input", lambda *args, **kwargs: None)
    with pytest.raises(ConfigError, match=exact(f"config: {path}: a FIFO, {NOT_REGULAR}")):
        open_input(path, ConfigError, 1 << 20)


def test_a_link_swapped_in_after_the_lstat_is_refused_at_the_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lstat saw a regular file; a link is there by the open, which O_NOFOLLOW refuses (ELOOP)."""
    (tmp_path / "real.json").write_text("{}")
    link = tmp_path / "manifest.json"
    link.symlink_to(tmp_path / "real.json")
    monkeypatch.setattr(inputs, "check_input", lambda *args, **kwargs: None)
    refusal = f"config: {link}: a symbolic link (to {tmp_path / 'real.json'}), {NOT_FOLLOWED}"
    with pytest.raises(ConfigError, match=exact(refusal)):
        open_input(link, ConfigError, 8, links=False)


def test_a_missing_file_is_left_to_the_caller(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_input(tmp_path / "absent.json", ConfigError, 8)


def test_describe_and_size_text() -> None:
    assert describe(os.stat("/dev/null").st_mode) == "a character device"
    assert describe(os.stat(__file__).st_mode) == "a regular file"
    assert [size_text(n) for n in (12, 1000, 12_345_678, 9_700_000_000)] == ["12 B", "1 KB", "12.3 MB", "9.7 GB"]


@pytest.mark.parametrize("name", ["data.txt", "data.jsonl", "ids.npy", "ids.npz"])
def test_calibration_data_that_is_a_fifo(tmp_path: Path, name: str) -> None:
    path = _fifo(tmp_path / name)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}')
    with pytest.raises(CalibrationError, match=exact(f"calibration: {path}: a FIFO, {NOT_REGULAR}")):
        load_calibration_data(str(path), tokenizer=tokenizer, vocab_size=101, samples=1, window=4)


def test_calibration_data_still_reads(tmp_path: Path) -> None:
    ids = tmp_path / "ids.npz"
    np.savez(ids, np.arange(8))
    data = load_calibration_data(str(ids), tokenizer=None, vocab_size=101, samples=1, window=4)
    assert data.windows[0].tolist() == [0, 1, 2, 3]


def test_a_calibration_tokenizer_that_is_a_device(tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("a a a a")
    with pytest.raises(CalibrationError, match=exact(f"calibration: /dev/null: a character device, {NOT_REGULAR}")):
        load_calibration_data(str(data), tokenizer=Path("/dev/null"), vocab_size=101, samples=1, window=4)


def test_a_calibration_cache_file_that_is_a_fifo_is_a_miss(tmp_path: Path) -> None:
    _fifo(tmp_path / f"{'a' * 64}.json")
    assert read_cache(tmp_path, "a" * 64) is None


def test_hashing_a_fifo_is_refused(tmp_path: Path) -> None:
    path = _fifo(tmp_path / "weights.bin")
    with pytest.raises(ArtifactError, match=exact(f"artifacts: {path}: a FIFO, {NOT_REGULAR}")):
        sha256_file(path)


def test_a_tokenizer_linked_to_a_device_is_not_to_be_copied(tiny_ckpt: Path) -> None:
    """The refusal of a link out of the checkpoint says to copy the file in, unless it leads to
    something that is no file: ``cp /dev/zero tokenizer.json`` would fill the disk."""
    from kiln.errors import CheckpointError
    from kiln.plugins import load_model

    link = tiny_ckpt / "tokenizer.json"
    link.symlink_to("/dev/zero")
    message = (
        f"checkpoint: {link} links to /dev/zero, outside {tiny_ckpt}: kiln reads nothing from outside the checkpoint;"
        f" it leads to a character device, not a file: put the model's own tokenizer.json there instead (rm {link})"
    )
    with pytest.raises(CheckpointError, match=exact(message)):
        load_model(tiny_ckpt)


def test_a_tokenizer_that_is_a_fifo(tiny_ckpt: Path) -> None:
    from kiln.errors import CheckpointError
    from kiln.plugins import load_model

    path = _fifo(tiny_ckpt / "tokenizer.json")
    with pytest.raises(CheckpointError, match=exact(f"checkpoint: {path}: a FIFO, {NOT_REGULAR}")):
        load_model(tiny_ckpt)
