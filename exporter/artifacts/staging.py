"""Output directories that are whole or absent, and replaced only when kiln wrote them.

An export (or a part rewritten later: ``kiln triton``'s repository) is written into a temporary
directory beside the target and renamed into place at the end; an error, Ctrl-C or SIGTERM (turned
into ``SystemExit`` by the CLI) removes it. An exclusive ``flock`` on ``.<name>.lock`` beside the
target makes a second export into the same directory fail at once instead of racing the first;
the lock file names the PID holding it, then each directory it makes beside the target. What a
killed process (SIGKILL, a power cut) leaves there, its ``.<name>.tmp-*`` staging and a
``.<name>.old-*`` copy set aside during the final rename, is cleaned up by the next process that
takes the lock (which proves the other one is gone), and one line says so; a copy set aside while
no new directory took its place is put back. Only the directories the lock file names are touched:
a user's ``.<name>.old-backup`` beside them is not kiln's (an adversarial pass had one deleted).
Where the target lies inside an export (``kiln triton``'s ``triton/``), verification passes over the
lock file and what it names (``artifacts.lockfile``): kiln's own, until the next kiln triton.

The final renames run with SIGINT and SIGTERM deferred (``interrupts.deferred``): a Ctrl-C there
lands after them, so the target is never found missing, half replaced, or replaced while the
command says nothing was written. Just before them, the target is checked again
(``require_replaceable``): a directory someone put there while the export ran is not kiln's to
replace (the finished output is kept beside it as ``<name>.new-*``, and the message says so).

The replacement rule (``--force``): a non-empty target is replaced only when kiln wrote it. What
that means is the caller's ``Owner``: for an export directory, that ``manifest.read`` accepts its
``manifest.json`` and that manifest lists every file in it (``earlier_export``); for ``kiln
triton``'s ``triton/`` inside an export, that the export's manifest lists every file in it
(``exporter.serving.triton``); ``kiln build`` writes files into ``engines/`` in place and applies
the same rule to that folder (``exporter.engine``). A target that is, or holds, one of the inputs
being read (the checkpoint, the calibration data) is never replaced, whatever its owner says.
Anything else is refused in one line naming what is there, and nothing is deleted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import stat
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kiln.errors import ArtifactError, ConfigError
from kiln.exporter.artifacts.lockfile import lock_path, lock_record, ours
from kiln.interrupts import deferred, raise_if_interrupted, wrote

__all__ = [
    "Owner",
    "Note",
    "brief",
    "cannot_write",
    "earlier_export",
    "listing",
    "refuse_held",
    "require_new_file",
    "require_replaceable",
    "staged_output",
]

Owner = Callable[[Path], str | None]  # a non-empty directory -> None when kiln wrote it, else why not (one line)
Note = Callable[[str], None]  # where a line about cleaned-up leftovers goes


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def cannot_write(path: Path, exc: OSError) -> str:
    """One line for an ``OSError`` met while creating or writing ``path``: what it means, what to do."""
    where = exc.filename or path
    reasons = {
        errno.ENAMETOOLONG: (
            f"a name in this path is longer than the file system allows ({where}); choose a shorter --out"
        ),
        errno.EROFS: f"the file system is read-only ({where}); choose an --out on a writable one",
        errno.EACCES: f"permission denied ({where}); choose an --out you can write",
        errno.EPERM: f"permission denied ({where}); choose an --out you can write",
        errno.ENOTDIR: f"{where} is a file, not a directory; choose another --out",
        errno.EEXIST: f"{where} is a file, not a directory; choose another --out",
        errno.ENOSPC: f"no space left on the device holding {where}; free some space or choose another --out",
        errno.EDQUOT: f"disk quota exceeded on {where}; free some space or choose another --out",
    }
    return f"{path}: cannot write here: " + reasons.get(exc.errno or 0, f"{exc.strerror or exc} ({where})")


MakeDir = Callable[[str], Path]  # a new directory beside the target, named by prefix + random, recorded first


def _lock_record(fd: int) -> tuple[int | None, list[str]]:
    """The PID a lock file names (whoever took the lock last) and the directories it made."""
    return lock_record(os.pread(fd, os.fstat(fd).st_size, 0))


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
    os.fsync(fd)  # on disk before the directory it names exists: a power cut leaves it named


@contextlib.contextmanager
def _lock(out: Path, note: Note) -> Iterator[MakeDir]:
    lock = lock_path(out)
    try:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as exc:
        raise ArtifactError(cannot_write(out, exc)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_record(fd)[0]
        os.close(fd)
        raise ArtifactError(_held(out, holder)) from None
    try:
        previous, made = _lock_record(fd)  # we hold the lock: whoever wrote this PID is gone
        _clean_leftovers(out, previous, made, note)  # interrupted, the file still names them
        left = _still_there(out, made)  # could not be removed: named again
        os.ftruncate(fd, 0)
        _write_all(fd, f"{os.getpid()}\n".encode() + b"".join(os.fsencode(name) + b"\n" for name in left), 0)
        yield lambda prefix: _make_dir(out.parent, prefix, fd)
    finally:
        if not _still_there(out, _lock_record(fd)[1]):
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()  # else it stays, naming what the next process removes
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _held(out: Path, holder: int | None) -> str:
    pid = f"pid {holder}, " if holder else ""
    return (
        f"{out}: another kiln process is writing this directory ({pid}lock {lock_path(out)}); wait for it or choose "
        "another --out"
    )


def refuse_held(out: Path) -> None:
    """Refuse ``out`` at once when another kiln process holds its lock (a non-blocking probe that
    takes nothing and creates nothing): an export asks this before it loads the checkpoint, which
    the lock itself (``staged_output``) would refuse only after the load. A lock file that is not
    a regular file, or cannot be opened, is left to ``staged_output`` to name."""
    try:
        fd = os.open(lock_path(out), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return  # no lock file: nobody holds it
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts with a writer's LOCK_EX
        except BlockingIOError:
            raise ArtifactError(_held(out, _lock_record(fd)[0])) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _make_dir(parent: Path, prefix: str, fd: int) -> Path:
    """``parent/prefix<random>``, named in the lock file before it is made (killed in between,
    the next process finds nothing to remove: never a directory nobody named)."""
    path = parent / f"{prefix}{secrets.token_hex(4)}"
    _write_all(fd, os.fsencode(path.name) + b"\n", os.fstat(fd).st_size)
    os.mkdir(path)  # an ordinary directory (the umask's mode), like the export it becomes
    return path


def _still_there(out: Path, named: list[str]) -> list[str]:
    """The directories a lock file names that are kiln's (``lockfile.ours``) and still beside ``out``."""
    return [name for name in named if ours(out, name) and os.path.lexists(out.parent / name)]


def _clean_leftovers(out: Path, previous: int | None, made: list[str], note: Note) -> None:
    """Remove what a killed kiln process left beside ``out`` (called under the lock): the
    directories its lock file names, nothing else; a directory it had moved aside is put back
    when nothing replaced it."""
    who = f"an earlier kiln process (pid {previous})" if previous else "an earlier kiln process"
    kilns = [out.parent / name for name in made if ours(out, name)]
    for old in (p for p in kilns if p.name.startswith(f".{out.name}.old-") and p.is_dir() and not p.is_symlink()):
        kept = old / out.name
        if kept.is_dir() and not os.path.lexists(out):
            os.replace(kept, out)
            note(f"restored {out} from {old.name}: {who} was killed while replacing it")
        shutil.rmtree(old, ignore_errors=True)
    for tmp in (p for p in kilns if p.name.startswith(f".{out.name}.tmp-") and p.is_dir() and not p.is_symlink()):
        shutil.rmtree(tmp, ignore_errors=True)
        note(f"removed {tmp}: the unfinished output of {who} that was killed")


def brief(names: Sequence[str], limit: int = 5) -> str:
    """``a, b, c (and 3 more)``, for a message."""
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def listing(directory: Path, limit: int = 5) -> str:
    """What a directory holds, for a message: ``notes.txt, sub/ (and 3 more)``."""
    return brief(sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir()), limit)


def earlier_export(out: Path) -> str | None:
    """The export's ``Owner``: None when ``out`` holds a manifest.json that kiln wrote (one that
    ``manifest.read`` accepts) and that lists every file in ``out``, else what is there instead."""
    from kiln.exporter.artifacts import manifest
    from kiln.exporter.artifacts.verify import unlisted

    try:
        found = manifest.read(out)
    except ArtifactError:
        has = "a manifest.json this kiln does not accept" if (out / manifest.MANIFEST).is_file() else "no manifest.json"
        return (
            f"--force replaces only an empty directory or an earlier kiln export, and this holds {listing(out)} with "
            f"{has}"
        )
    foreign = unlisted(out, found)
    if foreign:
        return (
            "--force replaces only an earlier kiln export whose manifest.json lists every file in it, and it does "
            f"not list {brief(foreign)}"
        )
    return None


def _refuse_inputs(out: Path, inputs: Sequence[Path]) -> None:
    """``out`` must not be, or hold, anything the command reads."""
    target = out.resolve()
    for path in inputs:
        if not os.path.lexists(path):  # nothing to lose (a tiny test model's made-up source)
            continue
        source = Path(path).resolve()
        if source == target or source.is_relative_to(target):
            raise ArtifactError(
                f"{out}: this is where the input {path} lives, and kiln never replaces a directory it reads "
                "from; choose another --out"
            )


def require_new_file(path: Path, force: bool, inputs: Sequence[Path], hint: str) -> None:
    """The file rule beside ``require_replaceable``'s directory one (``kiln adapter``'s and
    ``kiln bench``'s ``--out``): never inside anything the command reads, an existing file only
    with ``force``; one ``ConfigError`` ending in ``hint`` (what to name instead) otherwise."""
    target = path.absolute().resolve()
    for source in inputs:
        if target.is_relative_to(Path(source).absolute().resolve()):
            raise ConfigError(f"{path}: inside {source}, which this command reads; {hint}")
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory; --out names a file")
    if os.path.lexists(path) and not force:
        raise ConfigError(f"{path}: already exists; pass --force to replace it")


def _creatable(out: Path) -> None:
    """Raise the ``OSError`` that creating ``out`` would meet when a file stands where one of its
    folders would go (before anything heavy runs)."""
    for ancestor in out.parents:
        if os.path.lexists(ancestor):
            if not ancestor.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(ancestor))
            return


def require_replaceable(out: Path, force: bool, owner: Owner = earlier_export, inputs: Sequence[Path] = ()) -> None:
    """Refuse (one ``ArtifactError``, nothing touched) to write ``out`` unless it is absent or
    empty, or ``force`` is given and ``owner`` says kiln wrote it; and never when ``out`` is or
    holds one of ``inputs`` (the checkpoint and data the command reads)."""
    try:
        _refuse_inputs(out, inputs)
        if os.path.lexists(out) and (out.is_symlink() or not out.is_dir()):
            raise ArtifactError(
                f"{out}: exists and is not a directory" + (" (a symbolic link)" if out.is_symlink() else "")
            )
        if not out.is_dir():
            _creatable(out)
            return
        if not any(out.iterdir()):
            return
    except OSError as exc:
        raise ArtifactError(cannot_write(out, exc)) from None
    if not force:
        raise ArtifactError(f"{out}: output directory exists and is not empty; pass --force to replace it")
    reason = owner(out)
    if reason is not None:
        raise ArtifactError(f"{out}: {reason}; nothing was deleted: move or remove it yourself")


def _gb(size: float) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def _require_space(out: Path, needs: int) -> None:
    free = shutil.disk_usage(out.parent).free
    if free < needs:
        raise ArtifactError(
            f"{out}: the export needs at least {_gb(needs)} for its weights, and {_gb(free)} are free on "
            f"{out.parent}; free some space or choose another --out"
        )


@contextlib.contextmanager
def staged_output(
    out: Path,
    force: bool,
    owner: Owner = earlier_export,
    inputs: Sequence[Path] = (),
    note: Note = _stderr,
    needs: int = 0,
    committed: Callable[[], None] = lambda: None,
) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes ``out`` when the block succeeds (an ``out``
    already there must pass ``require_replaceable``, at the start and again just before the
    rename). ``needs``: the bytes the block will write at least, refused up front when the disk
    has less free; a full disk inside the block is one ``ArtifactError`` all the same.
    ``committed``: what must happen together with the rename (a manifest naming the new files),
    run right after it, signals deferred as for the rename. The temporary directory is removed
    whatever happens."""
    out = out.absolute()
    require_replaceable(out, force, owner, inputs)  # before making anything
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ArtifactError(cannot_write(out, exc)) from None
    with _lock(out, note) as make_dir:
        require_replaceable(out, force, owner, inputs)  # again, now that no other kiln can be writing it
        _require_space(out, needs)  # after the leftovers of a killed export are gone
        tmp = _staging_dir(out, make_dir)
        old: Path | None = None
        try:
            yield tmp
            raise_if_interrupted()  # a signal whose exception a finalizer swallowed
            with deferred():
                _recheck(out, force, owner, inputs, tmp)  # what appeared there while the block ran
                raise_if_interrupted()  # a signal during the check: nothing is replaced
                old = _commit(tmp, out, make_dir)
                committed()
                wrote(out)  # a signal from here on says so, not that nothing was written
            if old is not None:
                _note_gone(old / out.name, out, note)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            size = f" (the export needs at least {_gb(needs)})" if needs else ""
            raise ArtifactError(cannot_write(out, exc) + f"{size}; nothing was written") from None
        finally:
            for leftover in (tmp, old):  # the previous output is deleted outside `deferred`: Ctrl-C stops that
                if leftover is not None and leftover.exists():
                    shutil.rmtree(leftover, ignore_errors=True)


def _staging_dir(out: Path, make_dir: MakeDir) -> Path:
    try:
        return make_dir(f".{out.name}.tmp-")
    except OSError as exc:
        raise ArtifactError(cannot_write(out, exc)) from None


def _recheck(out: Path, force: bool, owner: Owner, inputs: Sequence[Path], tmp: Path) -> None:
    """``require_replaceable`` just before the rename; refused, the finished output is kept
    under a name no kiln removes, and the message says where (it may have taken hours)."""
    try:
        require_replaceable(out, force, owner, inputs)
    except ArtifactError as exc:
        kept = out.with_name(f"{out.name}.new-{secrets.token_hex(4)}")
        os.replace(tmp, kept)
        raise ArtifactError(f"{exc.args[0]}; what this run made is kept in {kept}") from None


def _gone(previous: Path, out: Path) -> list[str]:
    """What the previous output held that the new one lacks: a folder the new one has no trace of by its
    name (``triton/``), a file of a folder it keeps by its path (``engines/trtexec.sh``)."""
    gone: set[str] = set()
    for path in previous.rglob("*"):
        relative = path.relative_to(previous)
        if path.is_dir() or os.path.lexists(out / relative):
            continue
        top = relative.parts[0]
        gone.add(f"{top}/" if len(relative.parts) > 1 and not os.path.lexists(out / top) else relative.as_posix())
    return sorted(gone)


def _note_gone(previous: Path, out: Path, note: Note) -> None:
    """One line when ``--force`` replaced files the new output does not write again (kiln triton's
    repository, kiln build's script and engines): they went without a word before."""
    with contextlib.suppress(OSError):
        gone = _gone(previous, out)
        if gone:
            note(f"{out}: replaced the earlier output; not in the new one: {brief(gone)}")


def _commit(tmp: Path, out: Path, make_dir: MakeDir) -> Path | None:
    """Rename ``tmp`` to ``out``; an ``out`` already there is moved aside first (if the rename
    fails, it is put back; if the process dies in between, the next one puts it back:
    ``_clean_leftovers``). Returns the directory holding the previous output, to delete."""
    if not out.exists():
        os.replace(tmp, out)
        return None
    old = make_dir(f".{out.name}.old-")
    os.replace(out, old / out.name)
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(old / out.name, out)
        os.rmdir(old)
        raise
    return old
