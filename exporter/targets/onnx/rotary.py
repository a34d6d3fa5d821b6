"""Pass: each layer's rotate-half rotary on the attention's q and k -> ONNX's ``RotaryEmbedding``
(opset 23, 4-D heads ``[B, N, S, hd]``, the graph's own ``position_ids``; ``rotary_embedding_dim``
for a partial rotary), before ``cache.StaticCache`` rewrites the attention that reads them.

The rotary is found as ``--target ort`` finds it (``patterns.rotary.find_rotary``) and its
cos/sin tables ``[max_context, rotary_dim / 2]`` are the graph's own cos/sin subgraph evaluated at
every position (``patterns.rotary_tables``), so no family's theta or scaling is re-derived.
A rotary that is not rotate-half (GPT-J's interleaved one), or whose tables cannot be evaluated
per position (longrope past its switch), stays as traced, and the graph's ``not_fused`` report
says why per layer. TensorRT's parser maps the op to ``IRotaryEmbeddingLayer`` (10.15+).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np
import onnx_ir as ir

from kiln.exporter.passes.ir_utils import constant, producer, replace_value
from kiln.exporter.patterns.attention import find_attention
from kiln.exporter.patterns.rotary import find_rotary
from kiln.exporter.patterns.rotary_tables import graph_tables
from kiln.exporter.patterns.rules import NotFused

__all__ = ["onnx_rotary"]


def _rotated(value: ir.Value) -> ir.Value:
    """The rotary's own output behind a Cast (an fp16 graph's island casts it back to fp16)."""
    cast = producer(value, "Cast")
    return cast.inputs[0] if cast is not None and cast.inputs[0] is not None else value


def onnx_rotary(model: ir.Model, *, base_dir: Path, max_context: int, head_dim: int, not_fused: NotFused) -> list[int]:
    """Rewrite the q and k rotaries of every attention core; the layers whose both were rewritten."""
    tables = functools.lru_cache(maxsize=None)(graph_tables(model, base_dir, max_context, head_dim))
    position_ids = next(v for v in model.graph.inputs if v.name == "position_ids")
    done, why = [], []
    for core in find_attention(model, head_dim, softmax_island=True):
        reasons = [
            r
            for r in (
                _rewrite(model, _rotated(v), tables, position_ids, f"{core.layer}.{'qk'[i]}")
                for i, v in enumerate((core.q, core.k))
            )
            if r
        ]
        if reasons:
            why.append(f"layer {core.layer}: {reasons[0]}")
        else:
            done.append(core.layer)
    not_fused.add("rotary", why)
    return done


def _rewrite(model: ir.Model, value: ir.Value, tables: object, position_ids: ir.Value, label: str) -> str | None:
    """``value`` (a rotated q or k) -> RotaryEmbedding of its heads; why not, or None."""
    found = find_rotary(model, value)
    if isinstance(found, str):
        return found
    got = tables(found.cos, found.sin)  # type: ignore[operator]
    if got is None:
        return (
            "its cos/sin tables cannot be evaluated per position (they read more than position_ids, or a row depends "
            "on the call's other positions)"
        )
    cos, sin = got
    dtype = found.x.dtype
    if dtype is None or dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
        return f"the heads are {dtype}, not float or float16"
    numpy_dtype = np.float16 if dtype == ir.DataType.FLOAT16 else np.float32
    graph = model.graph
    key = hashlib.sha256(cos.tobytes() + sin.tobytes()).hexdigest()[
        :12
    ]  # one pair of tables per distinct content, named alike in every export
    caches = [
        constant(graph, f"static/rotary/{which}_{key}", table.astype(numpy_dtype))
        for which, table in (("cos", cos), ("sin", sin))
    ]
    attributes = {"interleaved": 0, **({"rotary_embedding_dim": found.dim} if found.dim is not None else {})}
    node = ir.node(
        "RotaryEmbedding", [found.x, *caches, position_ids], attributes, name=f"/static/layers.{label}/RotaryEmbedding"
    )
    graph.append(node)
    out = node.outputs[0]
    out.type, out.shape = value.type, value.shape
    replace_value(value, out)  # a prefill present (the rotated keys themselves) keeps its name
    return None
