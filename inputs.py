"""The one way kiln opens a file it reads: a regular file, no larger than its reader allows, checked
before it is opened and again once it is open.

A FIFO named ``config.json`` hung every command (``open`` waits for a writer that never comes), and
a ``manifest.json`` linked to ``/dev/zero`` was read until ``MemoryError`` (issue 38, item 3); a
device may act on being opened at all (a tape rewinds). So ``os.stat`` comes first (``os.lstat``
under the no-link rule: ``links=False``), and anything but a regular file is refused by what it is,
unopened; so is a file larger than the reader's cap. The open is ``O_NONBLOCK`` (a FIFO put there
after the stat cannot block it) and, under the no-link rule, ``O_NOFOLLOW``; ``os.fstat`` of what
was opened is checked again. ``read_input`` never reads more than the cap (a file that grows, or
one of /proc's that say size 0).

Libraries that read by path (tokenizers, safetensors, numpy's memory maps, ONNX Runtime) get the
path checked with ``check_input`` first; where they take bytes, ``read_input`` gives them.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from kiln.errors import KilnError

__all__ = ["TOKENIZER_MAX_BYTES", "check_input", "describe", "open_input", "read_input", "size_text"]

# the cap of every reader of a tokenizer.json (a checkpoint's, an export's, calibration's): the Hub's
# decoders' largest are tens of MB (Gemma 3's: 33 MB)
TOKENIZER_MAX_BYTES = 1 << 28

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),
)


def describe(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, as a refusal names it: ``a FIFO``, ``a character device``..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a file kiln knows")


def size_text(count: int) -> str:
    """Bytes as a person reads them: ``812 KB``, ``12.3 GB`` (powers of 1000, as the CLI prints sizes)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} B"


def _named(path: Path, links: bool) -> str:
    """``path`` as a refusal names it: with where it leads when it is a link that was followed (a
    ``config.json`` that is a character device is one the user linked to ``/dev/zero``)."""
    if links and os.path.islink(path):
        return f"{path} (a link to {os.path.realpath(path)})"
    return str(path)


def _refuse(
    path: Path, found: os.stat_result, error: type[KilnError], limit: int | None, what: str, links: bool
) -> None:
    """Raise ``error`` unless ``found`` is a regular file of at most ``limit`` bytes."""
    if stat.S_ISLNK(found.st_mode):  # only under the no-link rule: os.lstat
        raise error(
            f"{path}: a symbolic link (to {os.readlink(path)}), which kiln does not follow here;"
            " put the file itself there"
        )
    name = _named(path, links)
    if not stat.S_ISREG(found.st_mode):
        raise error(f"{name}: {describe(found.st_mode)}, not a regular file; kiln reads only regular files")
    if limit is not None and found.st_size > limit:
        raise error(f"{name}: {size_text(found.st_size)}, more than {what} may be ({size_text(limit)}); not read")


def check_input(
    path: Path, error: type[KilnError], limit: int | None, *, what: str = "this file", links: bool = True
) -> None:
    """Raise ``error`` (one line naming the file and what it is) unless ``path`` is a regular file
    of at most ``limit`` bytes (any size: None), not a link when ``links`` is False. Nothing is
    opened. A missing file raises ``FileNotFoundError``, as ``open`` would: the caller names it."""
    _refuse(path, os.stat(path, follow_symlinks=links), error, limit, what, links)


def open_input(
    path: Path, error: type[KilnError], limit: int | None, *, what: str = "this file", links: bool = True
) -> BinaryIO:
    """``path`` opened for reading in binary, after ``check_input``'s refusals, which ``os.fstat``
    repeats on what was opened (a file swapped between the stat and the open). ``OSError`` (missing,
    no permission) is left to the caller, as ``open`` leaves it."""
    check_input(path, error, limit, what=what, links=links)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    flags |= 0 if links else getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not links:  # a link put there after the lstat
            _refuse(path, os.lstat(path), error, limit, what, links)
        raise
    try:
        _refuse(path, os.fstat(fd), error, limit, what, links)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_input(path: Path, error: type[KilnError], limit: int, *, what: str = "this file", links: bool = True) -> bytes:
    """The bytes of ``path`` (``open_input``'s rules), never more than ``limit`` of them read: a file
    that is larger by the time it is read is refused as one larger at the stat."""
    with open_input(path, error, limit, what=what, links=links) as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise error(f"{_named(path, links)}: more than {what} may be ({size_text(limit)}); not read")
    return data
