"""Output directories that are whole or absent, and replaced only when kiln wrote them.

An export (or a part rewritten later: ``kiln triton``'s repository) is written into a temporary
directory beside the target and renamed into place at the end; an error, Ctrl-C or SIGTERM (turned into ``SystemExit`` by the CLI) removes it. An
exclusive ``flock`` on ``.<name>.lock`` beside the target makes a second export into the same
directory fail at once instead of racing the first.

The replacement rule (``--force``): a non-empty target is replaced only when kiln wrote it. What
that means is the caller's ``Owner``: for an export directory, that ``manifest.read`` accepts its
``manifest.json`` (``earlier_export``); for ``kiln triton``'s ``triton/`` inside an export, that
the export's manifest lists every file in it (``exporter.serving.triton``); ``kiln build`` writes
files into ``engines/`` in place and applies the same rule to that folder (``exporter.engine``).
Anything else is refused in one line naming what is there, and nothing is deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from kiln.errors import ArtifactError
from kiln.interrupts import raise_if_interrupted

__all__ = ["Owner", "earlier_export", "listing", "require_replaceable", "staged_output"]

Owner = Callable[[Path], str | None]  # a non-empty directory -> None when kiln wrote it, else why not (one line)


@contextlib.contextmanager
def _lock(out: Path) -> Iterator[None]:
    lock_path = out.parent / f".{out.name}.lock"
    fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ArtifactError(f"{out}: another kiln process is writing this directory (lock {lock_path}); wait for it or choose another --out") from None
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock_path.unlink()
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def listing(directory: Path, limit: int = 5) -> str:
    """What a directory holds, for a message: ``notes.txt, sub/ (and 3 more)``."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def earlier_export(out: Path) -> str | None:
    """The export's ``Owner``: None when ``out`` holds a manifest.json that kiln wrote (one that
    ``manifest.read`` accepts), else what is there instead."""
    from kiln.exporter.artifacts import manifest

    try:
        manifest.read(out)
    except ArtifactError:
        has = "a manifest.json this kiln does not accept" if (out / manifest.MANIFEST).is_file() else "no manifest.json"
        return f"--force replaces only an empty directory or an earlier kiln export, and this holds {listing(out)} with {has}"
    return None


def require_replaceable(out: Path, force: bool, owner: Owner = earlier_export) -> None:
    """Refuse (one ``ArtifactError``, nothing touched) to write ``out`` unless it is absent or
    empty, or ``force`` is given and ``owner`` says kiln wrote it."""
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{out}: exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise ArtifactError(f"{out}: output directory exists and is not empty; pass --force to replace it")
    reason = owner(out)
    if reason is not None:
        raise ArtifactError(f"{out}: {reason}; nothing was deleted: move or remove it yourself")


@contextlib.contextmanager
def staged_output(out: Path, force: bool, owner: Owner = earlier_export) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes ``out`` when the block succeeds (an ``out``
    already there must pass ``require_replaceable``)."""
    out = out.absolute()
    require_replaceable(out, force, owner)  # before making anything
    out.parent.mkdir(parents=True, exist_ok=True)
    with _lock(out):
        require_replaceable(out, force, owner)  # again, now that no other kiln can be writing it
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the export is an ordinary directory
        try:
            yield tmp
            raise_if_interrupted()  # a signal whose exception a finalizer swallowed
            _commit(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def _commit(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an ``out`` already there is moved aside first and deleted only
    once the new one is in place (if the rename fails, it is put back)."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, old / out.name)
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(old / out.name, out)
        raise
    finally:
        if out.is_dir():  # else the previous directory is only in `old`: keep it
            shutil.rmtree(old, ignore_errors=True)
