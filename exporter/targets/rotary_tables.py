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
from onnx import external_data_helper, helper

from kiln.exporter.targets.ort_attention import TableFn

__all__ = ["graph_tables"]


def graph_tables(model: ir.Model, base_dir: Path, max_positions: int, head_dim: int) -> TableFn:
    """A ``TableFn`` evaluating ``model``'s cos/sin values (external weights under ``base_dir``)."""
    proto = ir.to_proto(model)  # external tensors stay references: no weight is read here
    producers = {out: node for node in proto.graph.node for out in node.output}
    initializers = {t.name: t for t in proto.graph.initializer}
    graph_inputs = {v.name for v in proto.graph.input}

    def tables(cos: ir.Value, sin: ir.Value) -> tuple[np.ndarray, np.ndarray] | None:
        nodes: dict[int, onnx.NodeProto] = {}
        inits: dict[str, onnx.TensorProto] = {}
        stack = [cos.name, sin.name]
        seen: set[str] = set()
        while stack:
            name = stack.pop()
            if not name or name in seen:
                continue
            seen.add(name)
            if name in graph_inputs:
                if name != "position_ids":
                    return None
            elif name in initializers:
                inits[name] = initializers[name]
            elif name in producers:
                node = producers[name]
                if node.domain not in ("", "ai.onnx") or any(a.type == onnx.AttributeProto.GRAPH for a in node.attribute):
                    return None
                nodes[id(node)] = node
                stack.extend(node.input)
            else:
                return None
        ordered = [n for n in proto.graph.node if id(n) in nodes]
        tensors = []
        for tensor in inits.values():
            copy = onnx.TensorProto()
            copy.CopyFrom(tensor)
            if external_data_helper.uses_external_data(copy):
                external_data_helper.load_external_data_for_tensor(copy, str(base_dir))
                copy.data_location = onnx.TensorProto.DEFAULT
                del copy.external_data[:]
            tensors.append(copy)
        sub = helper.make_graph(
            ordered,
            "rotary_tables",
            [helper.make_tensor_value_info("position_ids", onnx.TensorProto.INT64, [1, max_positions])],
            [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in (cos.name or "", sin.name or "")],
            tensors,
        )
        sub_model = helper.make_model(sub, opset_imports=list(proto.opset_import), ir_version=proto.ir_version)
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        session = ort.InferenceSession(sub_model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
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
