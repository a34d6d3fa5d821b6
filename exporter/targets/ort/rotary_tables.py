"""Rotary cos/sin caches taken from the traced graph itself.

``RotaryEmbedding`` wants ``cos_cache``/``sin_cache`` [max_positions, head_dim/2]. Rather than
re-deriving them from each family's formula (theta, scaling variants, dtype rounding), the
graph's own cos/sin subgraph is cut out and run on ``position_ids = 0 .. max_positions-1``: the
tables are then whatever the model computes, by construction. The cut is refused (None) when
the subgraph reads any input other than ``position_ids`` or the tables are not "rotate half"
duplicated halves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from kiln.exporter.passes.subgraph import cut_subgraph
from kiln.exporter.runners.ort_runner import ort_session
from kiln.exporter.targets.ort.attention import TableFn
from onnx import helper

__all__ = ["graph_tables"]


def graph_tables(model: ir.Model, base_dir: Path, max_positions: int, head_dim: int) -> TableFn:
    """A ``TableFn`` evaluating ``model``'s cos/sin values (external weights under ``base_dir``)."""
    proto = ir.to_proto(model)  # external tensors stay references: no weight is read here

    def tables(cos: ir.Value, sin: ir.Value) -> tuple[np.ndarray, np.ndarray] | None:
        sub_model = cut_subgraph(proto, [cos.name or "", sin.name or ""], base_dir, name="rotary_tables", allowed_inputs={"position_ids"})
        if sub_model is None:
            return None
        del sub_model.graph.input[:]  # the graph declares [batch, seq]; the tables are one long row
        sub_model.graph.input.append(helper.make_tensor_value_info("position_ids", onnx.TensorProto.INT64, [1, max_positions]))
        session = ort_session(sub_model.SerializeToString())
        positions = np.arange(max_positions, dtype=np.int64)[None, :]
        out = []
        for array in session.run(None, {"position_ids": positions}):
            if array.size != max_positions * head_dim:
                return None
            table = array.astype(np.float32).reshape(max_positions, head_dim)
            half = head_dim // 2
            if not np.array_equal(table[:, :half], table[:, half:]):
                return None  # not the "rotate half" layout RotaryEmbedding(interleaved=0) computes
            out.append(np.ascontiguousarray(table[:, :half]))
        return out[0], out[1]

    return tables
