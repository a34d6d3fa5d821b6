"""Pass: RMSNorm written out by the tracer -> ``SimplifiedLayerNormalization``.

The tracer writes RMSNorm as ``x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2)) + eps)) [* weight]``.
ONNX Runtime 1.32 does not fuse that form itself (it looks for ``Div``), so the CPU runs seven
kernels per norm. This pass writes the fused op (ONNX Runtime's kernel in the default domain),
and ``fuse_skip_rms_norm`` merges the residual Add in front of it into
``SkipSimplifiedLayerNormalization``. A norm without a constant 1-D weight (the native PLE
sub-layer's, whose scale is a per-position table) gets a ones weight and keeps its Mul.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from kiln.exporter.passes.ir_utils import (
    MS_DOMAIN,
    constant,
    copy_type,
    producer,
    replace_value,
    scalar_of,
    use_ms_domain,
)

__all__ = ["fuse_rms_norm", "fuse_skip_rms_norm"]


def _match(mul: ir.Node) -> tuple[ir.Value, float, ir.Value] | None:
    """``Mul(x, Reciprocal(Sqrt(ReduceMean(Pow(x, 2), -1) + eps)))`` -> (x, eps, its output)."""
    for x, r in (mul.inputs, mul.inputs[::-1]):
        recip = producer(r, "Reciprocal")
        sqrt = producer(recip.inputs[0], "Sqrt") if recip is not None else None
        add = producer(sqrt.inputs[0], "Add") if sqrt is not None else None
        if add is None:
            continue
        for mean_v, eps_v in (add.inputs, add.inputs[::-1]):
            eps = scalar_of(eps_v)
            mean = producer(mean_v, "ReduceMean")
            if eps is None or mean is None:
                continue
            axes = scalar_of(mean.inputs[1]) if len(mean.inputs) > 1 else None
            if axes is None:
                axes_attr = mean.attributes.get_ints("axes", None)
                axes = axes_attr[0] if axes_attr and len(axes_attr) == 1 else None
            rank = len(x.shape) if x is not None and x.shape is not None else None
            if axes is None or not (axes == -1 or (rank is not None and axes == rank - 1)) or mean.attributes.get_int("keepdims", 1) != 1:
                continue
            pow_ = producer(mean.inputs[0], "Pow")
            if x is None or pow_ is None or pow_.inputs[0] is not x or scalar_of(pow_.inputs[1]) != 2.0:
                continue
            return x, eps, mul.outputs[0]
    return None


def _weight(normalized: ir.Value) -> tuple[ir.Node, ir.Value] | None:
    """The ``Mul(normalized, w)`` after the norm, when w is a 1-D constant."""
    uses = list(normalized.uses())
    if len(uses) != 1 or normalized.is_graph_output():
        return None
    node = uses[0].node
    if node.op_type != "Mul" or node.domain != "":
        return None
    other = node.inputs[1 - uses[0].idx]
    if other is None or other.const_value is None or len(other.const_value.shape) != 1:
        return None
    return node, other


def fuse_rms_norm(model: ir.Model) -> int:
    """Fuse every RMSNorm in ``model``; returns how many."""
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "Mul" or node.domain != "" or node.graph is None:
            continue
        match = _match(node)
        if match is None:
            continue
        x, eps, normalized = match
        weighted = _weight(normalized)
        if weighted is not None:
            target, gamma = weighted[0].outputs[0], weighted[1]
        else:
            width = x.shape[-1] if x.shape is not None else None
            if not isinstance(width, int):
                continue
            target, gamma = normalized, constant(graph, f"ort/ones_{width}", np.ones(width, dtype=np.float32))
        fused = ir.node(
            "SimplifiedLayerNormalization",
            [x, gamma],
            {"axis": -1, "epsilon": float(eps), "stash_type": 1},
            name=f"{(node.name or '').rsplit('/', 1)[0]}/SimplifiedLayerNormalization",
        )
        out = fused.outputs[0]
        copy_type(out, target)
        graph.insert_before(node, fused)
        replace_value(target, out)
        count += 1
    return count


def fuse_skip_rms_norm(model: ir.Model) -> int:
    """``SimplifiedLayerNormalization(Add(a, b))`` with a and b of one [B, S, D] shape ->
    ``com.microsoft.SkipSimplifiedLayerNormalization(a, b)``, whose fourth output (the sum)
    feeds what read the Add (the residual stream). ONNX Runtime 1.32's own fusion does not fire
    on kiln's graphs (it wants shapes it cannot prove), so it is written here."""
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "SimplifiedLayerNormalization" or node.domain != "" or node.graph is None:
            continue
        add = producer(node.inputs[0], "Add")
        if add is None or len(node.inputs) < 2:
            continue
        a, b = add.inputs
        if a is None or b is None or a.shape is None or b.shape is None or len(a.shape) != 3 or a.shape != b.shape or a.dtype != b.dtype:
            continue
        fused = ir.node(
            "SkipSimplifiedLayerNormalization",
            [a, b, node.inputs[1]],
            {"epsilon": node.attributes.get_float("epsilon", 1e-5)},
            domain=MS_DOMAIN,
            num_outputs=4,
            name=(node.name or "").replace("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"),
        )
        y, _, _, total = fused.outputs
        copy_type(y, node.outputs[0])
        copy_type(total, add.outputs[0])
        graph.insert_before(node, fused)
        replace_value(node.outputs[0], y)
        replace_value(add.outputs[0], total)
        count += 1
    if count:
        use_ms_domain(model)
    return count
