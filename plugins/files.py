"""What a checkpoint directory may hand kiln, checked before any family reads it (torch-free).

- Links: an entry of the directory that is a symlink must stay inside it, so an export never
  reads (and copies into its output) a file from elsewhere. The Hugging Face cache is symlinks
  by design (``models--ORG--NAME/snapshots/<rev>/config.json -> ../../blobs/<sha>``): there the
  links may reach anywhere inside the repo's cache folder (``hub_cache.cache_repo_root``).
- The tokenizer: a ``tokenizer.json`` beside the weights is loaded with the ``tokenizers``
  library when the checkpoint loads, so a malformed one is named there, not after the export.
- The config: ``read_config``, the ``config.json`` every family's claim reads.
"""

from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path
from typing import Any

from kiln.errors import CheckpointError
from kiln.inputs import TOKENIZER_MAX_BYTES, describe, read_input
from kiln.jsonfile import read_json_object
from kiln.plugins.hub_cache import cache_repo_root

__all__ = ["TOKENIZER", "checkpoint_dir", "checkpoint_tokenizer", "read_config", "refuse_outside_links"]

TOKENIZER = "tokenizer.json"


def checkpoint_dir(path: Path) -> Path:
    """The directory of a checkpoint given as a directory or as one of its files."""
    return path if path.is_dir() else path.parent


def refuse_outside_links(path: Path) -> None:
    """Raise ``CheckpointError`` for the first entry of the checkpoint directory that is a link
    leading outside it (outside the repo's cache folder for a Hugging Face cache snapshot)."""
    directory = checkpoint_dir(path)
    inside = cache_repo_root(directory) or directory
    root = inside.resolve()
    try:
        entries = sorted(directory.iterdir())
    except OSError as exc:
        raise CheckpointError(f"{directory}: cannot list the checkpoint directory ({exc.strerror})") from None
    for entry in entries:
        if not entry.is_symlink():
            continue
        target = entry.resolve()
        if target != root and not target.is_relative_to(root):
            raise CheckpointError(
                f"{entry} links to {target}, outside {inside}: kiln reads nothing from outside the checkpoint;"
                f" {_instead(entry, target)}"
            )


def _instead(entry: Path, target: Path) -> str:
    """What to do about a link out of the checkpoint: copy the file in when it is a regular file;
    anything else (``tokenizer.json -> /dev/zero``) is no file to copy, and a command that copies a
    device would fill the disk."""
    link = shlex.quote(str(entry))
    try:
        mode = os.stat(target).st_mode
    except OSError:
        return f"it leads to nothing kiln can read: put the model's own {entry.name} there instead (rm {link})"
    if stat.S_ISREG(mode):
        return f"copy the file in (rm {link} && cp {shlex.quote(str(target))} {link})"
    return f"it leads to {describe(mode)}, not a file: put the model's own {entry.name} there instead (rm {link})"


def checkpoint_tokenizer(directory: Path) -> Path | None:
    """The directory's ``tokenizer.json`` when it has one, loaded once with ``tokenizers`` to
    prove it is a tokenizer; ``CheckpointError`` naming the file when it is not."""
    path = directory / TOKENIZER
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    text = read_input(path, CheckpointError, TOKENIZER_MAX_BYTES, what="a tokenizer.json")  # a FIFO, a device: refused
    try:
        Tokenizer.from_str(text.decode("utf-8"))
    except Exception as exc:  # tokenizers raises a bare Exception for every way a file is not a tokenizer
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise CheckpointError(
            f"{path}: not a tokenizer the tokenizers library loads ({reason}); replace it with the model's own "
            "tokenizer.json, or remove it to export without one"
        ) from None
    return path


def read_config(path: Path) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint directory (or beside a checkpoint file)."""
    cfg_path = (path if path.is_dir() else path.parent) / "config.json"
    missing = f"{cfg_path}: config.json not found; a checkpoint is a directory with config.json and model.safetensors"
    return read_json_object(cfg_path, CheckpointError, missing)
