"""Output directories that are whole or absent.

An export (or a part rewritten later: ``kiln triton``'s repository) is written into a temporary
directory beside the target and renamed into place at the end; an error, Ctrl-C or SIGTERM (turned into ``SystemExit`` by the CLI) removes it. An
exclusive ``flock`` on ``.<name>.lock`` beside the target makes a second export into the same
directory fail at once instead of racing the first.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kiln.errors import ArtifactError
from kiln.interrupts import raise_if_interrupted

__all__ = ["staged_output"]


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


@contextlib.contextmanager
def staged_output(out: Path, force: bool) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes ``out`` when the block succeeds."""
    out = out.absolute()
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{out}: exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    with _lock(out):
        if out.is_dir() and any(out.iterdir()) and not force:
            raise ArtifactError(f"{out}: output directory exists and is not empty; pass --force to replace it")
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
