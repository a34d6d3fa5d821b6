"""A PEFT LoRA adapter as the tensors of an export's LoRA slots, and as an ONNX Runtime adapter file.

For each module the adapter changes, its slot's inputs are (``slots``: ``y = x @ W + (x @ A') @ B'``)

    A' = A.T                 [in, r]      (PEFT's lora_A is [r, in])
    B' = (s * B).T           [r, out]     (lora_B is [out, r]; s = lora_alpha / r, or / sqrt(r))

in the export's slot dtype. Modules the adapter leaves out are not written: their slots keep
their rank-0 defaults. The file is ONNX Runtime's adapter format (``onnxruntime.AdapterFormat``,
by convention ``.onnx_adapter``): ``onnxruntime.LoraAdapter`` loads it and
``RunOptions.add_active_adapter`` feeds it, which is also what ONNX Runtime GenAI's
``og.Adapters`` does. ``read_adapter_file`` checks a file against an export before it is used.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.errors import ArtifactError, ConfigError, ExportError
from kiln.exporter.contract.lora import LoraSlots
from kiln.newfile import new_output
from kiln.plugins.hub_cache import HF_EXTRA

if TYPE_CHECKING:
    from kiln.plugins.hf.adapter import LoraAdapter

__all__ = ["SUFFIX", "slot_tensors", "swapped_adapter", "write_adapter_file", "read_adapter_file"]

SUFFIX = ".onnx_adapter"


def slot_tensors(adapter: LoraAdapter, lora: LoraSlots, where: str) -> dict[str, np.ndarray]:
    """The slot inputs that carry ``adapter`` (scaled by its weight and scaling), refused by name
    where the export has no slot for a module, a slot of other sizes, or a smaller --lora-slots."""
    if adapter.rank > lora.max_rank:
        raise ConfigError(
            f"{where}: its rank {adapter.rank} exceeds the export's --lora-slots {lora.max_rank}; export again "
            f"with --lora-slots {adapter.rank} or more"
        )
    slots, dtype = lora.by_module(), np.dtype(lora.dtype)
    out: dict[str, np.ndarray] = {}
    for module, (a, b) in adapter.tensors.items():
        slot = slots.get(module)
        if slot is None:
            raise ConfigError(
                f"{where}: the export has no LoRA slot for {module} (slots: every Linear but the output head, or "
                "those --lora-targets names); merge this adapter with kiln export --adapter"
            )
        if (a.shape[1], b.shape[0]) != (slot.in_features, slot.out_features):
            raise ConfigError(
                f"{where}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; the export's slot "
                f"takes [r, {slot.in_features}] and [{slot.out_features}, r] (an adapter of another base?)"
            )
        scale = adapter.weight * adapter.scaling
        out[slot.a] = np.ascontiguousarray(a.float().T.numpy()).astype(dtype)
        out[slot.b] = np.ascontiguousarray((b.float() * scale).T.numpy()).astype(dtype)
        if not (np.isfinite(out[slot.a]).all() and np.isfinite(out[slot.b]).all()):  # an fp16 slot overflows first
            raise ConfigError(
                f"{where}: {module}'s tensors, scaled by weight x scaling, overflow the export's {lora.dtype} slots"
            )
    return out


def swapped_adapter(
    directory: Path, lora: LoraSlots | None, base: tuple[str | None, str | None], path: Path
) -> tuple[LoraAdapter, dict[str, np.ndarray]]:
    """The PEFT adapter in ``path`` and its slot tensors for the export in ``directory`` (its
    manifest's ``lora`` and its checkpoint's reference and resolved path, ``base``)."""
    where = f"--adapter {path}"
    if lora is None:
        raise ConfigError(
            f"{where}: {directory} has no LoRA slots (export it with --lora-slots RANK, or merge the adapter "
            "with kiln export --adapter)"
        )
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(f"{where}: needs peft (parity's reference is PEFT's own model of base + adapter): {HF_EXTRA}")
    from kiln.plugins.hf.adapter import base_names, check_base_name, read_adapter

    adapter = read_adapter(path, 1.0)
    ref = base[0] or ""
    check_base_name(adapter, base_names(ref, Path(base[1] or ref)), where)
    return adapter, slot_tensors(adapter, lora, where)


def write_adapter_file(tensors: Mapping[str, np.ndarray], path: Path) -> None:
    """``tensors`` as an ONNX Runtime adapter file at ``path``: written beside it, read back and
    compared bit for bit, then renamed into place (a failure leaves nothing behind)."""
    import onnxruntime as ort

    adapter = ort.AdapterFormat()
    adapter.set_adapter_version(1)
    adapter.set_model_version(1)
    adapter.set_parameters({name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in tensors.items()})
    with new_output(path) as partial:  # an OSError (a full disk) leaves nothing: the caller says it in one line
        _export_adapter(adapter, partial, path, sum(a.nbytes for a in tensors.values()))
        back = _arrays(ort.AdapterFormat.read_adapter(str(partial)))
        if set(back) != set(tensors) or any(
            not np.array_equal(back[n], tensors[n], equal_nan=True) or back[n].dtype != tensors[n].dtype
            for n in tensors
        ):
            raise ExportError(f"{path}: the adapter file ONNX Runtime wrote does not read back as the tensors given")


def _export_adapter(adapter: Any, partial: Path, path: Path, needs: int) -> None:
    """ONNX Runtime's ``export_adapter``, whose failure to write is a bare ``RuntimeError`` ("Failed
    to write :N bytes to ..."): with fewer than ``needs`` bytes free beside the file, it is the full
    disk it is, an ``OSError`` (ENOSPC); else one ``ArtifactError`` with ONNX Runtime's words."""
    try:
        adapter.export_adapter(str(partial))
    except RuntimeError as exc:
        said = re.search(r"Failed to write[^\n]*", str(exc))
        if said is None:
            raise
        if shutil.disk_usage(partial.parent).free < needs:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from None
        why = f"ONNX Runtime could not write the adapter file ({said.group(0)})"
        raise ArtifactError(f"{path}: {why}; nothing was written") from None


def read_adapter_file(path: Path, lora: LoraSlots | None, where: str) -> dict[str, np.ndarray]:
    """The slot tensors in the adapter file ``path``, checked against the export's slots: names,
    shapes (A and B of one rank, at most --lora-slots) and dtype."""
    import onnxruntime as ort

    if lora is None:
        raise ConfigError(f"{where}: the export has no LoRA slots (export it with --lora-slots RANK)")
    if not path.is_file():
        raise ConfigError(f"{where}: no such file (kiln adapter writes one from a PEFT adapter)")
    try:
        read = ort.AdapterFormat.read_adapter(str(path))
    except Exception as exc:  # onnxruntime raises its own untyped errors for a file it cannot parse
        raise ConfigError(
            f"{where}: not an ONNX Runtime adapter file "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        ) from None
    tensors = _arrays(read)
    inputs = lora.inputs()
    if unknown := sorted(set(tensors) - set(inputs)):
        raise ConfigError(f"{where}: {unknown[0]} is no LoRA slot input of the export ({len(unknown)} unknown)")
    for slot in lora.slots:
        if (slot.a in tensors) != (slot.b in tensors):
            raise ConfigError(f"{where}: {slot.module} has only one of {slot.a} and {slot.b}")
        if slot.a in tensors:
            _check_pair(
                tensors[slot.a], tensors[slot.b], (slot.in_features, slot.out_features), lora, f"{where}: {slot.module}"
            )
    if not tensors:
        raise ConfigError(f"{where}: holds no tensors")
    return tensors


def _arrays(adapter: Any) -> dict[str, np.ndarray]:
    """Copies of an ``AdapterFormat``'s tensors: ``OrtValue.numpy()`` of its parameters is a view of
    memory the adapter object owns (garbage once it is freed: NaN logits, found in testing)."""
    return {name: np.array(value.numpy(), copy=True) for name, value in adapter.get_parameters().items()}


def _check_pair(a: np.ndarray, b: np.ndarray, sizes: tuple[int, int], lora: LoraSlots, where: str) -> None:
    if a.dtype != np.dtype(lora.dtype) or b.dtype != a.dtype:
        raise ConfigError(f"{where}: its tensors are {a.dtype}/{b.dtype}, the export's slots {lora.dtype}")
    if a.ndim != 2 or b.ndim != 2 or (a.shape[0], b.shape[1]) != sizes or a.shape[1] != b.shape[0]:
        raise ConfigError(
            f"{where}: A {list(a.shape)} and B {list(b.shape)} are not [{sizes[0]}, r] and [r, {sizes[1]}]"
        )
    if a.shape[1] > lora.max_rank:
        raise ConfigError(f"{where}: rank {a.shape[1]} exceeds the export's --lora-slots {lora.max_rank}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):  # generate printed "0 0 0 ..." and exited 0
        raise ConfigError(f"{where}: holds NaN or infinite values")
