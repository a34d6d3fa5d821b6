"""Per-graph values that every layer's GroupQueryAttention and RotaryEmbedding read, made once.

``seqlens_k = total - 1`` for every row and ``total_sequence_length`` (both from
``attention_mask``'s shape), the attention biases (the family's own mask, as a float bias), the
cos/sin caches (the graph's own cos/sin subgraph evaluated at every position, ``patterns.rotary_tables``;
one pair per distinct table) and ``position_ids``. Nodes are inserted where the graph stays in
topological order: the lengths at its start, a bias right after what it reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.exporter.passes.ir_utils import constant
from kiln.exporter.patterns.heads import Bias
from kiln.exporter.patterns.rotary_tables import TableFn

__all__ = ["GraphValues"]


class GraphValues:
    """What the fused layers of one graph share (module docstring)."""

    def __init__(self, graph: ir.Graph, tables: TableFn) -> None:
        self.graph = graph
        self._tables = tables
        self._count = 0
        self._lengths: tuple[ir.Value, ir.Value] | None = None
        self._bias: dict[tuple[str, int], ir.Value] = {}
        self._caches: dict[tuple[int, int], tuple[ir.Value, ir.Value] | None] = {}
        self._cache_ids: dict[bytes, tuple[ir.Value, ir.Value]] = {}
        self.position_ids = next(v for v in graph.inputs if v.name == "position_ids")

    def _node(
        self,
        op: str,
        inputs: list[ir.Value | None],
        attributes: Mapping[str, Any] | None = None,
        *,
        after: ir.Node | None = None,
    ) -> ir.Value:
        node = ir.node(op, inputs, attributes, name=f"/ort/{op}_{self._count}")
        self._count += 1
        if after is not None:
            self.graph.insert_after(after, node)
        else:
            self.graph.insert_before(next(iter(self.graph)), node)
        return node.outputs[0]

    def lengths(self) -> tuple[ir.Value, ir.Value]:
        """(seqlens_k [B] int32 = total - 1 on every row, total_sequence_length int32)."""
        if self._lengths is None:
            graph = self.graph
            mask = next(v for v in graph.inputs if v.name == "attention_mask")
            shape = self._node("Shape", [mask])
            total = self._node(
                "Gather",
                [shape, constant(graph, "ort/one_i64", np.array(1, dtype=np.int64))],
                {"axis": 0},
                after=shape.producer(),
            )
            total = self._node("Cast", [total], {"to": ir.DataType.INT32}, after=total.producer())
            batch = self._node(
                "Slice",
                [
                    shape,
                    constant(graph, "ort/zero_1d", np.array([0], dtype=np.int64)),
                    constant(graph, "ort/one_1d", np.array([1], dtype=np.int64)),
                ],
                after=total.producer(),
            )
            last = self._node(
                "Sub", [total, constant(graph, "ort/one_i32", np.array(1, dtype=np.int32))], after=batch.producer()
            )
            self._lengths = (self._node("Expand", [last, batch], after=last.producer()), total)
        return self._lengths

    def bias(self, bias: Bias) -> ir.Value:
        """The family's mask as GroupQueryAttention's float ``attention_bias`` (one per mask)."""
        kind, source, fill = bias
        key = (kind, id(source))
        if key not in self._bias:
            if kind == "add":
                self._bias[key] = source
            else:
                zero = constant(self.graph, "ort/zero_f32", np.array(0.0, dtype=np.float32))
                masked = constant(self.graph, f"ort/mask_fill_{len(self._bias)}", np.array(fill, dtype=np.float32))
                pair = [zero, masked] if kind == "where" else [masked, zero]
                self._bias[key] = self._node("Where", [source, *pair], after=source.producer())
        return self._bias[key]

    def caches(self, cos: ir.Value, sin: ir.Value) -> tuple[ir.Value, ir.Value] | None:
        """RotaryEmbedding's (cos_cache, sin_cache) for the graph's (cos, sin), or None when they
        cannot be evaluated per position."""
        key = (id(cos), id(sin))
        if key not in self._caches:
            tables = self._tables(cos, sin)
            if tables is None:
                self._caches[key] = None
            else:
                digest = tables[0].tobytes() + tables[1].tobytes()
                if digest not in self._cache_ids:
                    k = len(self._cache_ids)
                    self._cache_ids[digest] = (
                        constant(self.graph, f"ort/rotary.{k}.cos_cache", tables[0]),
                        constant(self.graph, f"ort/rotary.{k}.sin_cache", tables[1]),
                    )
                self._caches[key] = self._cache_ids[digest]
        return self._caches[key]
