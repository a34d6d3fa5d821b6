"""sha256 of files and of directory trees (the manifest's ``files`` and ``checkpoint.files``)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import threading
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future
from pathlib import Path

from kiln.errors import ArtifactError
from kiln.inputs import open_input

__all__ = ["HashAhead", "sha256_file", "hash_tree", "links", "rehash_subtree"]


def sha256_file(path: Path, chunk: int = 1 << 22, stop: threading.Event | None = None) -> str:
    """The file's sha256, read in ``chunk``-byte blocks (any size); a FIFO or a device is refused
    (``inputs.open_input``), not read forever. ``stop``: set, the reading ends (``_Stopped``)."""
    h = hashlib.sha256()
    with open_input(path, ArtifactError, None) as f:
        while block := f.read(chunk):
            if stop is not None and stop.is_set():
                raise _Stopped(path)
            h.update(block)
    return h.hexdigest()


class _Stopped(Exception):
    """A hash ``HashAhead`` no longer needs, cut short."""


def _identity(path: Path) -> tuple[int, ...] | None:
    """What changes when a file is replaced or written: device, inode, size, modification time and
    status-change time (which a write moves, and which ``os.utime`` setting the old mtime back moves too);
    None where the file cannot be stat'ed."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class HashAhead(contextlib.AbstractContextManager["HashAhead"]):
    """sha256 of files computed ahead, on one background thread, while the export goes on: ``hashlib``
    releases the GIL while it hashes, so a queued file is read and hashed on another core beside a
    stage's Python (the checkpoint beside the trace and the graphs, the written graphs beside parity).
    ``digest`` returns a queued file's hash once it is done, or hashes the file itself when the file
    is not the one queued any more (``_identity``: replaced or written since), so
    a digest is always of the file as it is when asked. Leaving the block stops what is still queued
    (the thread is a daemon: an interrupted export never waits on it)."""

    def __init__(self) -> None:
        self._queued: dict[Path, tuple[tuple[int, ...], Future[str]]] = {}
        self._work: queue.SimpleQueue[tuple[Path, Future[str]] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def queue(self, paths: Iterable[Path]) -> None:
        """Hash each of ``paths`` (regular files, finished) in the background, in order."""
        for path in paths:
            key, identity = path.absolute(), _identity(path)
            if key in self._queued or identity is None or self._stop.is_set():
                continue  # a file that cannot be read is hashed (and refused) when its digest is asked for
            future: Future[str] = Future()
            self._queued[key] = (identity, future)
            self._work.put((key, future))
        if self._thread is None and self._queued:
            self._thread = threading.Thread(target=self._run, name="kiln-hash-ahead", daemon=True)
            self._thread.start()

    def digest(self, path: Path) -> str:
        """``path``'s sha256: the background's when it hashed this very file, else computed now."""
        queued = self._queued.get(path.absolute())
        if queued is not None and not self._stop.is_set() and queued[0] == _identity(path):
            future = queued[1]
            if future.exception() is None:  # waits for it
                return future.result()
        return sha256_file(path)  # read again: a failure in the background may not happen twice (or is raised here)

    def digests(self, paths: Iterable[Path]) -> dict[str, str]:
        """Each path's ``digest`` by file name (a checkpoint's ``files``)."""
        return {path.name: self.digest(path) for path in paths}

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            path, future = item
            try:
                future.set_result(sha256_file(path, stop=self._stop))
            except BaseException as exc:  # ``digest`` reads the file again and meets the error itself, if any
                future.set_exception(exc)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._work.put(None)


def _walk(root: Path, skip: Collection[str]) -> list[Path]:
    """Everything under ``root``, sorted, less the top-level names in ``skip`` and all they hold."""
    return sorted(p for p in root.rglob("*") if p.relative_to(root).parts[0] not in skip)


def hash_tree(
    root: Path,
    exclude: tuple[str, ...] = (),
    skip: Collection[str] = (),
    digest: Callable[[Path], str] = sha256_file,
) -> dict[str, str]:
    """sha256 of every regular file under ``root`` by POSIX relative path, in sorted order.
    Symbolic links are not followed and not hashed (``links`` lists them): what a link points to
    lies outside what kiln wrote. ``skip``: top-level names passed over, unread (kiln's own
    leftovers in an export, ``lockfile.own_leftovers``: a copy of a repository's weights).
    ``digest``: a file's sha256 (``HashAhead.digest``: computed ahead)."""
    out: dict[str, str] = {}
    for path in (p for p in _walk(root, skip) if p.is_file() and not p.is_symlink()):
        rel = path.relative_to(root).as_posix()
        if rel not in exclude:
            out[rel] = digest(path)
    return out


def links(root: Path, skip: Collection[str] = ()) -> dict[str, str]:
    """Every symbolic link under ``root`` (to a file or a directory; never followed), by POSIX
    relative path, with what it points to (``skip``: as ``hash_tree``'s)."""
    return {p.relative_to(root).as_posix(): os.readlink(p) for p in _walk(root, skip) if p.is_symlink()}


def rehash_subtree(files: dict[str, str], root: Path, sub: str, staged: Path | None = None) -> dict[str, str]:
    """``files`` (a manifest's) with the entries under ``sub/`` replaced by what is there now,
    or by what ``staged`` holds (the folder about to be renamed to ``root/sub``): a command that
    rewrites one folder of an export hashes only that folder."""
    prefix = f"{sub}/"
    kept = {k: v for k, v in files.items() if not k.startswith(prefix)}
    folder = staged if staged is not None else root / sub
    if folder.is_dir():
        kept.update({prefix + rel: digest for rel, digest in hash_tree(folder).items()})
    return dict(sorted(kept.items()))
