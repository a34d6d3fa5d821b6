"""``kiln adapter DIR --export OUT``: a PEFT LoRA adapter converted for an export's LoRA slots,
proved against PEFT's own model of base + adapter, and written as an ONNX Runtime adapter file.

The order keeps a failure from leaving anything: the adapter is read and refused by name
(``plugins.hf.adapter``: DoRA, other PEFT types...) and against the export's manifest (its base's
name, a slot per module, the sizes, the rank); parity runs the export's graphs fed its tensors
against PEFT's model (``kiln check OUT --adapter DIR`` runs the same); only then is the file
written (read back bit for bit before it is renamed into place).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.errors import ArtifactError, ConfigError, ParityError
from kiln.exporter.lora.adapter_file import SUFFIX, swapped_adapter, write_adapter_file
from kiln.exporter.parity.summary import shown_failures

if TYPE_CHECKING:
    import numpy as np

    from kiln.exporter.parity import ParityResult
    from kiln.exporter.progress import Progress

__all__ = ["AdapterResult", "convert_adapter", "default_path"]


@dataclasses.dataclass(frozen=True)
class AdapterResult:
    path: Path  # the adapter file written
    modules: tuple[str, ...]  # the slots it fills
    rank: int
    parity: ParityResult | None  # None: --no-check


def default_path(adapter_dir: Path) -> Path:
    """Beside the adapter directory: ``build/lora/adapter`` -> ``build/lora/adapter.onnx_adapter``."""
    absolute = adapter_dir.absolute()
    return absolute.with_name(absolute.name + SUFFIX)


def convert_adapter(
    directory: Path, adapter_dir: Path, out: Path | None, *, force: bool, check: bool, progress: Progress
) -> AdapterResult:
    from kiln.exporter.artifacts.verify import require_verified
    from kiln.exporter.check import check_dir

    manifest = require_verified(directory)
    adapter, tensors = swapped_adapter(
        directory, manifest.lora, (manifest.checkpoint.reference, manifest.checkpoint.resolved), adapter_dir
    )
    path = out if out is not None else default_path(adapter_dir)
    _require_writable(
        path,
        force,
        inputs=(directory, adapter_dir, *_checkpoint(manifest.checkpoint.reference, manifest.checkpoint.resolved)),
    )
    parity = check_dir(directory, progress=progress, adapter=adapter_dir) if check else None
    if parity is not None and not parity.passed:
        raise ParityError(
            f"{adapter_dir}: the export's graphs fed this adapter differ from PEFT's model: "
            + "; ".join(shown_failures(parity.failure_records()))
        )
    _write(tensors, path)
    return AdapterResult(path, tuple(sorted(adapter.tensors)), adapter.rank, parity)


def _write(tensors: dict[str, np.ndarray], path: Path) -> None:
    """``write_adapter_file``, whose ``OSError`` (a full disk) is one line: the file is as it was."""
    from kiln.exporter.artifacts.staging import cannot_write

    try:
        write_adapter_file(tensors, path)
    except OSError as exc:  # its file name is new_output's temporary: the message names the file asked for
        raise ArtifactError(cannot_write(path, OSError(exc.errno, exc.strerror)) + "; nothing was written") from None


def _checkpoint(*named: str | None) -> tuple[Path, ...]:
    """The export's checkpoint directory, as the manifest names it, where it still is (a base
    model ``--out`` must not touch)."""
    return tuple(Path(n) for n in named if n and Path(n).is_dir())


def _require_writable(path: Path, force: bool, inputs: tuple[Path, ...]) -> None:
    """``path`` may take the adapter file: not inside anything the command reads (the export,
    the PEFT adapter, the base checkpoint), and, when a file is there, ``--force`` given and that
    file an ONNX Runtime adapter file by name (``*.onnx_adapter``: never a user's other file)."""
    from kiln.exporter.artifacts.staging import require_new_file

    require_new_file(path, force, inputs, "--out names a file outside it")
    if os.path.lexists(path) and (path.is_symlink() or not path.name.endswith(SUFFIX)):
        raise ConfigError(
            f"{path}: --force replaces only an ONNX Runtime adapter file (*{SUFFIX}) kiln wrote, and this is "
            f"{'a link' if path.is_symlink() else 'another file'}; nothing was replaced"
        )
    if not path.parent.is_dir():
        raise ConfigError(f"{path}: its directory {path.parent} does not exist")
