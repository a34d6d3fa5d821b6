"""Attention heads between their two forms, and a layer's mask as the scores take it: what the
attention core's pattern (``attention``), its rotary (``rotary``) and the values GQA is fed
(``graph_values``) share."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.exporter.passes.ir_utils import constant, producer

__all__ = ["Bias", "flatten_heads", "projection_of"]

Bias = tuple[str, ir.Value, float | None]  # ("add", mask, None) | ("where", cond, fill) | ("where_inv", cond, fill)


def projection_of(heads: ir.Value) -> ir.Value | None:
    """The packed ``[B, S, N*hd]`` value when ``heads = Transpose(Reshape(it), [0, 2, 1, 3])``.
    A Reshape of another rank's value is no packing: Falcon's 40B layout (transformers 5.25)
    flattens its queries from ``[B, S, kv, group, hd]`` slices of the fused projection."""
    transpose = producer(heads, "Transpose")
    if transpose is not None and list(transpose.attributes.get_ints("perm", [])) == [0, 2, 1, 3]:
        reshape = producer(transpose.inputs[0], "Reshape")
        packed = reshape.inputs[0] if reshape is not None else None
        if packed is not None and (packed.shape is None or len(packed.shape) == 3):
            return packed
    return None


def flatten_heads(op: Any, heads: ir.Value) -> ir.Value:
    """Heads ``[B, N, S, hd]`` -> packed ``[B, S, N*hd]``: ``projection_of`` when there is one, else
    (per-head ops between the projection and here, which stay) a new ``Reshape(Transpose(heads))``."""
    direct = projection_of(heads)
    if direct is not None:
        return direct
    graph = heads.graph
    assert isinstance(graph, ir.Graph), "matched heads belong to the graph"
    shape = constant(graph, "ort/flatten_heads", np.array([0, 0, -1], dtype=np.int64))
    name = f"/ort/heads/{heads.name}"
    bsnh = op.Transpose(heads, perm=[0, 2, 1, 3], _name=f"{name}/Transpose")
    flat: ir.Value = op.Reshape(bsnh, shape, _name=f"{name}/Reshape")
    dims = list(heads.shape) if heads.shape is not None and len(heads.shape) == 4 else None
    if dims is not None and isinstance(dims[1], int) and isinstance(dims[3], int):
        flat.shape = ir.Shape([dims[0], dims[2], dims[1] * dims[3]])
    flat.type = heads.type
    return flat
