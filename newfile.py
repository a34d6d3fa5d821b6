"""Single files that are whole or absent, written through a temporary file that is kiln's own.

Every file kiln writes outside a staged directory (``staging.staged_output``) goes through
``new_output``: the bytes go to a temporary file beside the target, made new (``O_CREAT | O_EXCL |
O_NOFOLLOW``) under a random name, then renamed over the target. So a link planted at a temporary
name is never followed (a fixed ``.NAME.partial`` once made ``kiln adapter`` write through a user's
link into the file it pointed to), a user's file that happens to bear such a name is never
truncated or deleted (only the file this process made is removed on failure), and the target is
never found half written. ``os.replace`` renames over a link at the target itself, never into the
file it points to; callers that must not replace a link refuse it first.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

__all__ = ["new_output", "target_of_temporary"]

_SUFFIX = ".kiln-tmp"
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.[0-9a-f]{12}" + re.escape(_SUFFIX) + "$")


def _create_beside(path: Path, mode: int) -> Path:
    """A new empty file beside ``path`` under a random name (``.NAME.<12 hex>.kiln-tmp``); never an
    existing file or a link (``FileExistsError`` then: 48 random bits make that someone's doing)."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}{_SUFFIX}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    os.close(os.open(temporary, flags, mode))
    return temporary


@contextlib.contextmanager
def new_output(path: Path, *, executable: bool = False) -> Iterator[Path]:
    """Yield a new temporary file beside ``path`` for the caller to fill (by its path: ONNX Runtime
    and matplotlib write by name); when the block ends, rename it over ``path``. On any error or
    signal the temporary file (and only it) is removed and ``path`` is as it was. The file's mode is
    the usual 0o666 less the umask (0o777 with ``executable``), as ``open`` would give it."""
    temporary = _create_beside(path, 0o777 if executable else 0o666)
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


def target_of_temporary(name: str) -> str | None:
    """The file name a ``new_output`` temporary named ``name`` was for (a killed process leaves
    one behind), or None when ``name`` is not such a temporary: how an owner rule recognises them."""
    match = _TEMPORARY.match(name)
    return match.group("name") if match else None
