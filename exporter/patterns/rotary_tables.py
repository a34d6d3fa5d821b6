"""Rotary cos/sin caches taken from the traced graph itself.

``RotaryEmbedding`` wants ``cos_cache``/``sin_cache`` [max_positions, rotary_dim/2] (rotary_dim:
head_dim, or the rotated part of a head with partial rotary). Rather than
re-deriving them from each family's formula (theta, scaling variants, dtype rounding), the
graph's own cos/sin subgraph is cut out and run on ``position_ids = 0 .. max_positions-1``: the
tables are then whatever the model computes, by construction. The cut is refused (None) when
the subgraph reads any input other than ``position_ids``, the tables are not "rotate half"
duplicated halves, or a position's row depends on the other positions of the call (longrope's
switch at ``original_max_position_embeddings`` reads ``max(position_ids)``: a table per position
cannot hold it), which is found by evaluating a short prefix of the positions too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from kiln.exporter.passes.subgraph import cut_subgraph, proto_for_cuts
from kiln.exporter.runners.ort_runner import ort_session

__all__ = ["TableFn", "graph_tables"]

# (cos value, sin value) -> (cos_cache, sin_cache) [max_positions, rotary_dim/2], or None when the
# tables cannot be evaluated (the subgraph reads more than position_ids, ...)
TableFn = Callable[[ir.Value, ir.Value], tuple[np.ndarray, np.ndarray] | None]

_PREFIX = 4  # positions of the short call (below any context a length-dependent rope switches at)


def graph_tables(model: ir.Model, base_dir: Path, max_positions: int, head_dim: int) -> TableFn:
    """A ``TableFn`` evaluating ``model``'s cos/sin values (external weights under ``base_dir``)."""
    proto = proto_for_cuts(model)

    def tables(cos: ir.Value, sin: ir.Value) -> tuple[np.ndarray, np.ndarray] | None:
        sub_model = cut_subgraph(
            proto, [cos.name or "", sin.name or ""], base_dir, name="rotary_tables", allowed_inputs={"position_ids"}
        )
        if sub_model is None:
            return None
        del sub_model.graph.input[:]  # the tables are one row of positions
        sub_model.graph.input.append(
            helper.make_tensor_value_info("position_ids", onnx.TensorProto.INT64, [1, "positions"])
        )
        session = ort_session(sub_model.SerializeToString())

        def run(count: int) -> list[np.ndarray] | None:
            arrays = session.run(None, {"position_ids": np.arange(count, dtype=np.int64)[None, :]})
            width = arrays[0].size // count  # the rotated channels (head_dim, or fewer: partial rotary)
            if any(a.size != count * width for a in arrays) or width > head_dim or width % 2:
                return None
            return [a.astype(np.float32).reshape(count, width) for a in arrays]

        full, prefix = run(max_positions), run(min(_PREFIX, max_positions))
        if (
            full is None
            or prefix is None
            or any(not np.array_equal(f[: len(p)], p) for f, p in zip(full, prefix, strict=True))
        ):
            return None  # a row that depends on the call's other positions
        half = full[0].shape[1] // 2
        if any(not np.array_equal(t[:, :half], t[:, half:]) for t in full):
            return None  # not the "rotate half" layout RotaryEmbedding(interleaved=0) computes
        return np.ascontiguousarray(full[0][:, :half]), np.ascontiguousarray(full[1][:, :half])

    return tables
