"""Output directories that are whole or absent.

An export is written into a temporary directory beside the target and renamed into place at
the end; an error, Ctrl-C or SIGTERM (turned into ``SystemExit`` by the CLI) removes it. An
exclusive ``flock`` on ``.<name>.lock`` beside the target makes a second export into the same
directory fail at once instead of racing the first.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kiln.errors import ArtifactError

__all__ = ["staged_output", "sha256_file", "hash_tree"]


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_tree(root: Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of every file under ``root`` by POSIX relative path, in sorted order."""
    out: dict[str, str] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel not in exclude:
            out[rel] = sha256_file(path)
    return out


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
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
                os.replace(out, old / out.name)
                os.replace(tmp, out)
                shutil.rmtree(old)
            else:
                os.replace(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
