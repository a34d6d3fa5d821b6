"""Pass: a graph's large initializers moved into one external weights file shared by several graphs.

The graphs of a set are written one after another, and the same weight appears in each (under
the same or a different initializer name, e.g. a transposed Linear weight that the exporter
folded into ``val_N``). Tensors are deduplicated by content (dtype, shape and bytes): each
distinct tensor is written once and every graph's initializer points at its offset. Nothing is
embedded in a protobuf above a small threshold, so graphs over 2 GB of weights work the same way.
The file is streamed (``weights_stream``): a module weight is converted and
written a chunk at a time, the write overlapping the next conversion; a module weight already
written (same module tensor, same recipe) is not read again, and content is matched by a
fingerprint confirmed byte for byte.

Naming, by the writer's ``rename``:

- ``True`` (the portable graphs): each distinct content gets one name in every graph,
  ``weights/<first name seen>``, so a runtime can share one buffer per weight between the
  graphs' sessions, and identical initializers within a graph merge;
- ``False`` (the ``--target ort`` graphs, whose new tensors are named by the rewrite): names are
  kept, a name seen before must hold the same content, and tensors already in another weights
  file (the portable ``weights.bin``) stay where they are.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir

from kiln.errors import ExportError
from kiln.exporter.passes.bind import ModuleWeight
from kiln.exporter.passes.weights_stream import HASH_ALL_BYTES, ChunkFile, Fingerprint, tensor_chunks

__all__ = ["WEIGHTS_FILE", "SharedWeights", "WeightsWriter", "ExternalizeWeights"]

WEIGHTS_FILE = "weights.bin"
_ALIGN = 64  # bytes; keeps every tensor aligned for memory mapping
_INLINE_LIMIT = 1024  # bytes; smaller constants (shapes, scalars) stay inside the graph


@dataclasses.dataclass(frozen=True)
class SharedWeights:
    path: Path
    tensors: int  # distinct tensors in the file
    bytes: int  # size of the file
    references: int  # initializers, over all graphs, that point into it


@dataclasses.dataclass(frozen=True)
class _Stored:
    offset: int
    length: int
    name: str  # the canonical name (rename=True) or the first name stored under (rename=False)


class WeightsWriter(contextlib.AbstractContextManager["WeightsWriter"]):
    """Writes one weights file graph by graph (``externalize``), so that a graph's in-memory
    weight copies can be dropped before the next graph is made."""

    def __init__(self, path: Path, *, rename: bool, inline_limit: int = _INLINE_LIMIT) -> None:
        self.path = path
        self._rename = rename
        self._inline_limit = inline_limit
        self._by_content: dict[bytes, list[_Stored]] = {}  # fingerprint -> the contents stored under it
        self._by_name: dict[str, _Stored] = {}  # rename=False: the content each name was stored with
        self._computed: dict[tuple[object, ...], _Stored] = {}  # a module weight's identity -> its content
        self._taken: set[str] = set()
        self._references = 0
        self._end = 0  # the file's size once the queued writes are done
        self._file = ChunkFile(path)  # closed in close()/__exit__

    def pending(self, model: ir.Model) -> list[ir.Value]:
        """``model``'s initializers that ``externalize`` moves into the file."""
        return [value for value in model.graph.initializers.values() if self._moves(value.const_value)]

    def _moves(self, tensor: ir.TensorProtocol | None) -> bool:
        return tensor is not None and not isinstance(tensor, ir.ExternalTensor) and tensor.nbytes >= self._inline_limit

    def externalize(self, model: ir.Model, advance: Callable[[], None] | None = None) -> None:
        """Point ``model``'s large in-memory initializers into the file, writing new content
        (``advance`` is called after each: a progress bar's step)."""
        graph = model.graph
        in_graph: dict[str, ir.Value] = {}
        for value in self.pending(model):
            tensor = value.const_value
            assert tensor is not None
            if advance is not None:
                advance()
            stored = self._store(value, tensor)
            if self._rename and stored.name in in_graph:  # same content twice in this graph: use the first
                value.replace_all_uses_with(in_graph[stored.name])
                graph.initializers.pop(value.name or "")
                continue
            name = stored.name if self._rename else value.name or stored.name
            if self._rename:
                graph.initializers.pop(value.name or "")
                value.name = name
            value.const_value = ir.ExternalTensor(
                self.path.name,
                stored.offset,
                stored.length,
                tensor.dtype,
                shape=ir.Shape(tensor.shape.numpy()),
                name=name,
                base_dir=self.path.parent,
            )
            if self._rename:
                graph.register_initializer(value)
                in_graph[name] = value
            self._references += 1

    def _store(self, value: ir.Value, tensor: ir.TensorProtocol) -> _Stored:
        identity = tensor.identity if isinstance(tensor, ModuleWeight) else None
        if identity is not None and identity in self._computed:  # written before (another graph, a tied name)
            return self._known(value, self._computed[identity])
        if isinstance(tensor, ModuleWeight) and tensor.nbytes > HASH_ALL_BYTES:
            stored = self._stream(value, tensor)
        else:
            stored = self._put(value, tensor)
        if identity is not None:
            self._computed[identity] = stored
        return self._known(value, stored)

    def _put(self, value: ir.Value, tensor: ir.TensorProtocol) -> _Stored:
        """A tensor whose bytes are in memory: stored content it equals, or written now."""
        data = _payload(tensor)
        fingerprint = Fingerprint(tensor)
        fingerprint.update(data)
        key = fingerprint.key()
        for stored in self._by_content.get(key, []):
            if fingerprint.exact or self._file.holds(stored.offset, data):
                return stored
        offset = self._pad()
        self._file.write(offset, data)
        self._end = offset + data.nbytes
        return self._new(key, offset, data.nbytes, value)

    def _stream(self, value: ir.Value, tensor: ModuleWeight) -> _Stored:
        """A large module weight, computed and written a chunk at a time; if its content was stored
        before (confirmed byte for byte), the file is cut back and the earlier one is used."""
        start = self._end
        offset = self._pad()
        fingerprint, end = Fingerprint(tensor), offset
        for chunk in tensor_chunks(tensor):
            fingerprint.update(chunk)
            self._file.write(end, chunk)
            end += chunk.nbytes
        key = fingerprint.key()
        for stored in self._by_content.get(key, []):
            if self._file.same(stored.offset, offset, end - offset):
                self._file.truncate(start)
                self._end = start
                return stored
        self._end = end
        return self._new(key, offset, end - offset, value)

    def _pad(self) -> int:
        """The next tensor's offset: the file's end, padded with zeros to ``_ALIGN``."""
        pad = -self._end % _ALIGN
        if pad:
            self._file.write(self._end, memoryview(b"\0" * pad))
        return self._end + pad

    def _new(self, key: bytes, offset: int, length: int, value: ir.Value) -> _Stored:
        stored = _Stored(offset, length, self._canonical(_readable_name(value)) if self._rename else value.name or "")
        self._by_content.setdefault(key, []).append(stored)
        return stored

    def _known(self, value: ir.Value, stored: _Stored) -> _Stored:
        """``stored``, checking that a name kept (rename=False) always holds one content."""
        name = value.name or ""
        if not self._rename and self._by_name.setdefault(name, stored) != stored:
            raise ExportError(f"tensor {name} differs between graphs; cannot share {self.path.name}")
        return stored

    def _canonical(self, first: str) -> str:
        name, k = f"weights/{first}", 1
        while name in self._taken:  # another content was first seen under the same name
            name, k = f"weights/{first}.{k}", k + 1
        self._taken.add(name)
        return name

    def close(self) -> SharedWeights:
        self._file.close()
        tensors = sum(len(stored) for stored in self._by_content.values())
        return SharedWeights(self.path, tensors, self._end, self._references)

    def __exit__(self, *exc: object) -> None:
        self._file.close(check=False)


class ExternalizeWeights(ir.passes.InPlacePass):
    """``writer.externalize`` as the last pass of a graph."""

    def __init__(self, writer: WeightsWriter) -> None:
        super().__init__()
        self.writer = writer

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.writer.externalize(model)
        return ir.passes.PassResult(model, modified=True)


def _payload(tensor: ir.TensorProtocol) -> memoryview:
    """A tensor's bytes as stored: over a module weight's computed array itself (no second copy)."""
    if isinstance(tensor, ModuleWeight):
        return tensor.array().reshape(-1).view(np.uint8).data
    return memoryview(tensor.tobytes())


def _readable_name(value: ir.Value) -> str:
    """The exporter's name for a weight, or, for a constant it made up (``val_12``, e.g. a
    transposed Linear weight: ``passes.transposes``), the node that reads it:
    ``layers.0.attn.q_proj/MatMul:1``."""
    name = value.name or ""
    if not name.startswith("val_"):
        return name
    for node, index in value.uses():
        if node.name:
            return f"{node.name.lstrip('/')}:{index}"
    return name
