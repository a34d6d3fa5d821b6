"""One external weights file shared by every graph.

The graphs are traced separately, so the same weight can appear in each (under the same or a
different initializer name, e.g. a transposed Linear weight that the exporter folded into
``val_N``). Tensors are deduplicated by content: each distinct tensor is written once to
``weights.bin`` and every graph's initializer points at its offset. Nothing is ever embedded in
a protobuf above a small threshold, so graphs over 2 GB of weights work the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from pathlib import Path

import onnx_ir as ir

__all__ = ["WEIGHTS_FILE", "SharedWeights", "write_shared_weights"]

WEIGHTS_FILE = "weights.bin"
_ALIGN = 64  # bytes; keeps every tensor aligned for memory mapping
_INLINE_LIMIT = 1024  # bytes; smaller constants (shapes, scalars) stay inside the graph


@dataclasses.dataclass(frozen=True)
class SharedWeights:
    path: Path
    tensors: int  # distinct tensors in the file
    bytes: int  # size of the file
    references: int  # initializers, over all graphs, that point into it


def write_shared_weights(
    models: Mapping[str, ir.Model], directory: Path, *, inline_limit: int = _INLINE_LIMIT
) -> SharedWeights:
    """Move every initializer of ``models`` larger than ``inline_limit`` bytes into one file in
    ``directory``, written once per distinct content; each graph then references it."""
    path = directory / WEIGHTS_FILE
    offsets: dict[bytes, tuple[int, int]] = {}
    references = 0
    with open(path, "wb") as f:
        for name in sorted(models):
            for value in models[name].graph.initializers.values():
                tensor = value.const_value
                if tensor is None or tensor.nbytes < inline_limit:
                    continue
                data = tensor.tobytes()
                key = hashlib.sha256(f"{tensor.dtype}:{tuple(tensor.shape)}".encode() + data).digest()
                if key not in offsets:
                    offset = f.tell()
                    pad = -offset % _ALIGN
                    f.write(b"\0" * pad)
                    offsets[key] = (offset + pad, len(data))
                    f.write(data)
                offset, length = offsets[key]
                value.const_value = ir.ExternalTensor(
                    WEIGHTS_FILE, offset, length, tensor.dtype, shape=ir.Shape(tensor.shape), name=value.name or "", base_dir=directory
                )
                references += 1
        size = f.tell()
    return SharedWeights(path, len(offsets), size, references)
