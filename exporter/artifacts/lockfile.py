"""The lock file ``artifacts.staging`` keeps beside an output, and the directories it records there.

``.<name>.lock`` names the PID that holds it, then each directory made beside ``<name>``: its
``.<name>.tmp-*`` staging and a ``.<name>.old-*`` copy set aside during the final rename. Only
those (by their prefix, ``ours``) are kiln's; a user's look-alike the file does not name is not.

``kiln triton`` stages ``triton/`` inside an export, so its lock file and what it records lie in
the export itself while it runs, and stay there when it is killed (or interrupted while deleting
the earlier repository). They are kiln's, not files the manifest forgot: verification passes
over them (``own_leftovers``) and the next ``kiln triton`` removes them under its lock. Before,
every command refused the export ("unexpected: .triton.lock"), kiln triton included, since it
verifies before it takes the lock that would clean them up.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["STAGED_INSIDE", "lock_path", "lock_record", "ours", "own_leftovers", "staging_pids"]

STAGED_INSIDE = ("triton",)  # the parts of an export staged inside it: kiln triton's repository (serving.TRITON_DIR)


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


def lock_record(data: bytes) -> tuple[int | None, list[str]]:
    """The PID a lock file's bytes name (whoever took the lock last) and the directories it made."""
    lines = data.split(b"\n")
    pid = lines[0].strip()
    return (int(pid) if pid.isdigit() else None), [os.fsdecode(line) for line in lines[1:] if line]


def ours(out: Path, name: str) -> bool:
    """Whether ``name``, recorded in ``out``'s lock file, is a directory kiln makes beside ``out``."""
    return "/" not in name and name.startswith((f".{out.name}.old-", f".{out.name}.tmp-"))


Record = tuple[int | None, list[str]]  # a lock file's PID and the directories it names


def _records(directory: Path) -> list[tuple[Path, Record]]:
    """Each staged part of ``directory`` whose lock file is there (a file), with what it records
    (nothing when it cannot be read: verification then names the file itself)."""
    found: list[tuple[Path, Record]] = []
    for part in (directory / name for name in STAGED_INSIDE):
        lock = lock_path(part)
        if lock.is_symlink() or not lock.is_file():
            continue
        try:
            found.append((part, lock_record(lock.read_bytes())))
        except OSError:
            found.append((part, (None, [])))
    return found


def staging_pids(directory: Path) -> set[int]:
    """The processes the lock files in ``directory`` name: the one staging a part now, or the last
    one, which was killed or interrupted."""
    return {pid for _, (pid, _) in _records(directory) if pid is not None}


def own_leftovers(directory: Path) -> list[str]:
    """The names in the export ``directory`` that are kiln's own staging of a part of it
    (``STAGED_INSIDE``): each part's lock file, when it is a file, and the directories it records
    that are there, whether a kiln triton is running, was killed, or was interrupted."""
    found: list[str] = []
    for part, (_, named) in _records(directory):
        found += [lock_path(part).name, *(n for n in named if ours(part, n) and os.path.lexists(directory / n))]
    return sorted(set(found))
