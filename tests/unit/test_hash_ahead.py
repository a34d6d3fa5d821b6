"""``HashAhead``: the export hashes its checkpoint and its written graphs on a background thread while its
stages go on (issue 40: 0.8 s of checkpoint and 1.5 s of output hashing at the 0.5B shape, on one core while
the other waited). A digest is always of the file as it is when asked: a file replaced, rewritten or removed
since it was queued is hashed again (or fails as ``sha256_file`` fails), never answered from the
background's stale read."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from unittest import mock

import pytest

from kiln.errors import ArtifactError
from kiln.exporter.artifacts.hashing import HashAhead, hash_tree, sha256_file
from kiln_testing import exact


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hash_thread() -> threading.Thread | None:
    return next((t for t in threading.enumerate() if t.name == "kiln-hash-ahead"), None)


def test_queued_files_hash_to_what_sha256_file_gives(tmp_path: Path) -> None:
    files = {tmp_path / f"f{i}.bin": os.urandom(3 << 20) for i in range(3)}
    for path, data in files.items():
        path.write_bytes(data)
    with HashAhead() as hashes:
        hashes.queue(files)
        assert {p: hashes.digest(p) for p in files} == {p: _sha(d) for p, d in files.items()}
        assert hashes.digests(files) == {p.name: _sha(d) for p, d in files.items()}


def test_a_file_rewritten_after_it_was_queued_is_hashed_as_it_is_now(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * (1 << 20))
    with HashAhead() as hashes:
        hashes.queue([path])
        assert hashes.digest(path) == _sha(b"a" * (1 << 20))  # the background's digest, done
        path.write_bytes(b"b" * (1 << 20) + b"!")  # another size and time: not the file queued
        assert hashes.digest(path) == _sha(b"b" * (1 << 20) + b"!")
        os.replace(_written(tmp_path / "other", b"c"), path)  # another inode
        assert hashes.digest(path) == _sha(b"c")


def test_a_file_rewritten_at_its_size_with_its_old_time_set_back_is_hashed_again(tmp_path: Path) -> None:
    """``cp -p``, ``touch -r``, ``rsync -t --inplace``: same inode, size and mtime; the status-change time moved."""
    path = _written(tmp_path / "model.safetensors", b"a" * 4096)
    with HashAhead() as hashes:
        hashes.queue([path])
        assert hashes.digest(path) == _sha(b"a" * 4096)
        before = path.stat()
        with path.open("r+b") as f:
            f.write(b"b" * 4096)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
        assert hashes.digest(path) == _sha(b"b" * 4096)


def test_a_failure_in_the_background_is_read_again_in_the_caller(tmp_path: Path) -> None:
    """A read that failed once (EIO, EMFILE, a permission since fixed) is not the export's failure."""
    path = _written(tmp_path / "weights.bin", b"w" * 1024)
    with HashAhead() as hashes:
        with mock.patch(
            "kiln.exporter.artifacts.hashing.open_input", side_effect=OSError(5, "Input/output error")
        ) as failing:
            hashes.queue([path])
            thread = _hash_thread()
            assert thread is not None
            while not hashes._queued[path.absolute()][1].done():
                thread.join(timeout=0.01)
        assert failing.called
        assert hashes.digest(path) == _sha(b"w" * 1024)


def _written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_a_file_removed_after_it_was_queued_fails_as_sha256_file_fails(tmp_path: Path) -> None:
    path = _written(tmp_path / "prefill.onnx", b"graph")
    with HashAhead() as hashes:
        hashes.queue([path])
        path.unlink()
        with pytest.raises(OSError) as raised:
            hashes.digest(path)
    with pytest.raises(OSError) as direct:
        sha256_file(path)
    assert (type(raised.value), str(raised.value)) == (type(direct.value), str(direct.value))


def test_a_fifo_queued_is_refused_not_read(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    os.mkfifo(path)
    with HashAhead() as hashes:
        hashes.queue([path])
        with pytest.raises(
            ArtifactError, match=exact(f"artifacts: {path}: a FIFO, not a regular file; kiln reads only regular files")
        ):
            hashes.digest(path)


def test_leaving_the_block_stops_the_background_and_digests_still_answer(tmp_path: Path) -> None:
    big = _written(tmp_path / "big.bin", b"\0" * (64 << 20))
    with HashAhead() as hashes:
        hashes.queue([big])
        thread = _hash_thread()
        assert thread is not None and thread.daemon  # an interrupted export never waits on it
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert hashes.digest(big) == _sha(b"\0" * (64 << 20))  # computed now
    hashes.queue([big])  # after the block: nothing queued, nothing started
    assert _hash_thread() is None


def test_hash_tree_takes_the_digests_computed_ahead(tmp_path: Path) -> None:
    (tmp_path / "onnx").mkdir()
    graph = _written(tmp_path / "onnx" / "model.onnx", b"graph")
    report = _written(tmp_path / "parity.md", b"report")
    asked: list[Path] = []
    with HashAhead() as hashes:
        hashes.queue([graph])

        def digest(path: Path) -> str:
            asked.append(path)
            return hashes.digest(path)

        assert hash_tree(tmp_path, digest=digest) == {"onnx/model.onnx": _sha(b"graph"), "parity.md": _sha(b"report")}
    assert asked == [graph, report]
