"""The static cache's attention written out in plain ops, for a layer TensorRT's ``Attention``
cannot take: Gemma 2's soft-capped scores (``cap * tanh(scores / cap)``). ONNX's ``Attention`` has
a ``softcap`` attribute, but TensorRT's ONNX parser refuses it (its Attention importer takes no
softcap), so such a layer keeps its cache in place (``TensorScatter``, as every other layer) and reads it with::

    q5     = Reshape(q, [B, kv, H/kv, S, hd])                  grouped heads, no copy of the keys
    k5, v5 = Unsqueeze(keys, 2), Unsqueeze(values, 2)          [B, kv, 1, T, hd]
    scores = Cast(MatMul(q5, Transpose(k5)), float32) * scale  [B, kv, H/kv, S, T]
    capped = cap * Tanh(scores / cap)
    probs  = Softmax(Where(mask, capped, lowest float32))      mask [B, 1, 1, S, T]
    out    = Reshape(MatMul(Cast(probs, dtype), v5), [B, H, S, hd])

The scores run in float32 from the MatMul on (transformers' eager attention softmaxes in float32;
an fp16 graph's Tanh and mask in fp16 would round where the model does not need to). Over the
static buffer, ``T`` is ``max_context``: each step reads every slot, as ``Attention`` does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.exporter.passes.ir_utils import constant

__all__ = ["decomposed_attention", "DECOMPOSED_WHY"]

DECOMPOSED_WHY = (
    "soft-capped scores (cap * tanh(scores / cap)): TensorRT's parser refuses Attention's softcap, so these layers "
    "read the static cache with MatMul/Tanh/Softmax"
)


def decomposed_attention(
    graph: ir.Graph,
    q: ir.Value,
    keys: ir.Value,
    values: ir.Value,
    mask: ir.Value,
    *,
    scale: float,
    softcap: float | None,
    heads: tuple[int, int, int],
    prefix: str,
) -> ir.Value:
    """``[B, H, S, hd]`` attention of ``q`` over ``keys``/``values`` ``[B, kv, T, hd]`` under the
    bool ``mask`` ``[B, 1, S, T]`` (module docstring); ``heads`` = (H, kv, hd). Nodes appended to
    ``graph``, named under ``prefix``."""
    n_heads, kv_heads, head_dim = heads
    dtype = q.dtype or ir.DataType.FLOAT

    def op(op_type: str, *inputs: ir.Value, **attributes: Any) -> ir.Value:
        node = ir.node(op_type, list(inputs), attributes or None, name=f"{prefix}/{op_type}_{len(graph)}")
        graph.append(node)
        return node.outputs[0]

    def const(name: str, array: np.ndarray) -> ir.Value:
        return constant(graph, f"{prefix.strip('/')}/{name}", array)

    axis2 = const("axis2", np.array([2], np.int64))
    q5 = op("Reshape", q, const("grouped", np.array([0, kv_heads, n_heads // kv_heads, -1, head_dim], np.int64)))
    k5, v5 = op("Unsqueeze", keys, axis2), op("Unsqueeze", values, axis2)
    scores = op("Cast", op("MatMul", q5, op("Transpose", k5, perm=[0, 1, 2, 4, 3])), to=ir.DataType.FLOAT)
    scores = op("Mul", scores, const("scale", np.array(scale, np.float32)))
    if softcap is not None:
        cap = const("softcap", np.array(softcap, np.float32))
        scores = op("Mul", op("Tanh", op("Div", scores, cap)), cap)
    lowest = const("lowest", np.array(np.finfo(np.float32).min, np.float32))
    masked = op("Where", op("Unsqueeze", mask, const("axis1", np.array([1], np.int64))), scores, lowest)
    probs = op("Softmax", masked, axis=-1)
    if dtype != ir.DataType.FLOAT:
        probs = op("Cast", probs, to=dtype)
    out = op("Reshape", op("MatMul", probs, v5), const("heads", np.array([0, n_heads, -1, head_dim], np.int64)))
    out.type, out.shape = q.type, q.shape
    return out
