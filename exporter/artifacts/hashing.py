"""sha256 of files and of directory trees (the manifest's ``files`` and ``checkpoint.files``)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Collection
from pathlib import Path

from kiln.errors import ArtifactError
from kiln.inputs import open_input

__all__ = ["sha256_file", "hash_tree", "links", "rehash_subtree"]


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """The file's sha256, read in ``chunk``-byte blocks (any size); a FIFO or a device is refused
    (``inputs.open_input``), not read forever."""
    h = hashlib.sha256()
    with open_input(path, ArtifactError, None) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _walk(root: Path, skip: Collection[str]) -> list[Path]:
    """Everything under ``root``, sorted, less the top-level names in ``skip`` and all they hold."""
    return sorted(p for p in root.rglob("*") if p.relative_to(root).parts[0] not in skip)


def hash_tree(root: Path, exclude: tuple[str, ...] = (), skip: Collection[str] = ()) -> dict[str, str]:
    """sha256 of every regular file under ``root`` by POSIX relative path, in sorted order.
    Symbolic links are not followed and not hashed (``links`` lists them): what a link points to
    lies outside what kiln wrote. ``skip``: top-level names passed over, unread (kiln's own
    leftovers in an export, ``lockfile.own_leftovers``: a copy of a repository's weights)."""
    out: dict[str, str] = {}
    for path in (p for p in _walk(root, skip) if p.is_file() and not p.is_symlink()):
        rel = path.relative_to(root).as_posix()
        if rel not in exclude:
            out[rel] = sha256_file(path)
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
