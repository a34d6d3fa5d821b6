"""One external weights file shared by every graph.

The graphs are traced separately, so the same weight can appear in each (under the same or a
different initializer name, e.g. a transposed Linear weight that the exporter folded into
``val_N``). Tensors are deduplicated by content: each distinct tensor is written once to
``weights.bin`` and every graph's initializer points at its offset. Nothing is ever embedded in
a protobuf above a small threshold, so graphs over 2 GB of weights work the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from pathlib import Path

import onnx_ir as ir

__all__ = ["WEIGHTS_FILE", "SharedWeights", "SharedWeightsWriter"]

WEIGHTS_FILE = "weights.bin"
_ALIGN = 64  # bytes; keeps every tensor aligned for memory mapping
_INLINE_LIMIT = 1024  # bytes; smaller constants (shapes, scalars) stay inside the graph


@dataclasses.dataclass(frozen=True)
class SharedWeights:
    path: Path
    tensors: int  # distinct tensors in the file
    bytes: int  # size of the file
    references: int  # initializers, over all graphs, that point into it


class SharedWeightsWriter(contextlib.AbstractContextManager["SharedWeightsWriter"]):
    """Writes ``weights.bin`` graph by graph: ``externalize(model)`` moves a graph's large
    initializers into the file (each distinct content once) and points the graph at them, so a
    traced graph's in-memory weight copies can be dropped before the next graph is traced."""

    def __init__(self, directory: Path, *, inline_limit: int = _INLINE_LIMIT) -> None:
        self.directory = directory
        self.path = directory / WEIGHTS_FILE
        self._inline_limit = inline_limit
        self._offsets: dict[bytes, tuple[int, int, str]] = {}  # content -> offset, length, canonical name
        self._taken: set[str] = set()
        self._references = 0
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed in __exit__/close)

    def externalize(self, model: ir.Model) -> None:
        """Move ``model``'s large initializers into the file. Each distinct content gets one
        name in every graph (``weights/<first name seen>``), so a runtime can share one buffer
        per weight between the graphs' sessions; identical initializers within a graph merge."""
        graph = model.graph
        in_graph: dict[str, ir.Value] = {}
        for value in list(graph.initializers.values()):
            tensor = value.const_value
            if tensor is None or tensor.nbytes < self._inline_limit:
                continue
            data = tensor.tobytes()
            key = hashlib.sha256(f"{tensor.dtype}:{tuple(tensor.shape)}".encode() + data).digest()
            if key not in self._offsets:
                offset = self._file.tell()
                pad = -offset % _ALIGN
                self._file.write(b"\0" * pad)
                self._offsets[key] = (offset + pad, len(data), self._canonical(_readable_name(value)))
                self._file.write(data)
            offset, length, name = self._offsets[key]
            del data
            if name in in_graph:  # same content twice in this graph: use the first
                value.replace_all_uses_with(in_graph[name])
                graph.initializers.pop(value.name)  # type: ignore[arg-type]
                continue
            graph.initializers.pop(value.name)  # type: ignore[arg-type]
            value.name = name
            value.const_value = ir.ExternalTensor(
                WEIGHTS_FILE, offset, length, tensor.dtype, shape=ir.Shape(tensor.shape), name=name, base_dir=self.directory
            )
            graph.register_initializer(value)
            in_graph[name] = value
            self._references += 1

    def _canonical(self, first: str) -> str:
        name, k = f"weights/{first}", 1
        while name in self._taken:  # another content was first seen under the same name
            name, k = f"weights/{first}.{k}", k + 1
        self._taken.add(name)
        return name

    def close(self) -> SharedWeights:
        size = self._file.tell()
        self._file.close()
        return SharedWeights(self.path, len(self._offsets), size, self._references)

    def __exit__(self, *exc: object) -> None:
        if not self._file.closed:
            self._file.close()


def _readable_name(value: ir.Value) -> str:
    """The exporter's name for a weight, or, for a constant it made up (``val_12``, e.g. a
    transposed Linear weight), the node that reads it: ``layers.0.attn.q_proj/MatMul:1``."""
    name = value.name or ""
    if not name.startswith("val_"):
        return name
    for node, index in value.uses():
        if node.name:
            return f"{node.name.lstrip('/')}:{index}"
    return name
