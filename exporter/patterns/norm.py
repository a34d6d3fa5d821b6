"""Rule: RMSNorm written out by the tracer -> ``SimplifiedLayerNormalization`` (``--target ort``)
or ONNX's ``RMSNormalization`` (``--target onnx``: the same inputs and attributes).

The tracer writes RMSNorm as ``x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2)) + eps)) [* weight]``.
ONNX Runtime 1.32 does not fuse that form itself (it looks for ``Div``), so the CPU runs seven
kernels per norm. These rules write the fused op (by default ONNX Runtime's kernel in the default
domain; ``targets/ort/skip_norm.py`` then merges the residual Add in front of it). A norm without a constant 1-D weight
(the native PLE sub-layer's, whose scale is a per-position table) gets a ones weight and keeps
its Mul: the weighted rule runs over the whole graph first, the unweighted one after it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, pattern

from kiln.exporter.passes.ir_utils import constant, producer, scalar_of
from kiln.exporter.patterns.rules import NotFused, apply_rules, explain, fail, rule_of

__all__ = ["RmsNorm", "fuse_rms_norm", "ones_weight"]


def _last_axis(mean: ir.Node, x: ir.Value) -> bool:
    """``mean`` (a ReduceMean) reduces the last axis of ``x`` only: axes input or attribute."""
    axes = scalar_of(mean.inputs[1]) if len(mean.inputs) > 1 else None
    if axes is None:
        listed = mean.attributes.get_ints("axes", None)
        axes = listed[0] if listed and len(listed) == 1 else None
    rank = len(x.shape) if x.shape is not None else None
    return axes is not None and (axes == -1 or (rank is not None and axes == rank - 1))


class RmsNorm(RewriteRuleClassBase):
    """``x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2), -1) + eps)) [* weight]`` -> SimplifiedLayerNormalization
    (ONNX Runtime's), or ``op_type`` RMSNormalization (ONNX's own, opset 23: the same inputs and
    attributes, what ``--target onnx`` writes)."""

    def __init__(self, weighted: bool, swapped: bool, op_type: str = "SimplifiedLayerNormalization") -> None:
        super().__init__(f"RmsNorm{'' if weighted else 'OnesWeight'}{'Swapped' if swapped else ''}")
        self.weighted, self.swapped = weighted, swapped  # swapped: the root Mul's operands (weight first; x second)
        self.op_type = op_type

    def pattern(self, op: Any, x: Any, squared: Any, exponent: Any, eps: Any, weight: Any) -> Any:
        # either operand order: an OrValue of both where one operand is computed (onnxscript 0.7's
        # commute() cannot copy an OrValue without a tag); the root's two orders are two rules
        mean = op.ReduceMean(op.Pow(squared, exponent), _allow_other_inputs=True, _outputs=["mean"])
        denominator = op.Reciprocal(
            op.Sqrt(pattern.OrValue([op.Add(mean, eps), op.Add(eps, mean)], tag_var="eps_second"))
        )
        if not self.weighted:
            return (
                op.Mul(denominator, x, _outputs=["normalized"])
                if self.swapped
                else op.Mul(x, denominator, _outputs=["normalized"])
            )
        normalized = pattern.OrValue(
            [op.Mul(x, denominator), op.Mul(denominator, x)], name="normalized", tag_var="x_second"
        )
        return op.Mul(weight, normalized) if self.swapped else op.Mul(normalized, weight)

    def check(self, op: Any, *_: Any, **bound: Any) -> MatchResult:  # op: the MatchContext (the base class names it so)
        x: ir.Value = bound["x"]
        exponent, eps, mean, weight = bound["exponent"], bound["eps"], bound["mean"], bound.get("weight")
        node = mean.producer()
        if bound["squared"] is not x:
            return fail("it squares another tensor than the one it scales (x - mean: a LayerNorm?)")
        if scalar_of(exponent) != 2.0:
            return fail("the power is not a constant 2")
        if scalar_of(eps) is None:
            return fail("epsilon is not a constant")
        if node is None or not _last_axis(node, x) or node.attributes.get_int("keepdims", 1) != 1:
            return fail("the mean is not over the last axis, kept")
        if self.weighted:
            tensor = weight.const_value if weight is not None else None
            if tensor is None or len(tensor.shape) != 1:
                return fail("the weight is not a 1-D constant")
        elif not isinstance(x.shape[-1] if x.shape is not None else None, int):
            return fail("the hidden size is not static (the ones weight needs it)")
        return MatchResult()

    def rewrite(
        self, op: Any, x: ir.Value, eps: ir.Value, normalized: ir.Value, weight: ir.Value | None = None, **_: Any
    ) -> ir.Value:
        gamma = weight if self.weighted and weight is not None else ones_weight(x)
        mul = normalized.producer()
        name = f"{((mul.name if mul is not None else None) or '').rsplit('/', 1)[0]}/{self.op_type}"
        attrs = {
            "axis": -1,
            "epsilon": float(scalar_of(eps) or 0.0),
            "stash_type": 1,
        }  # stash_type 1: computed in fp32 (TensorRT honours a fp16 stash and overflows)
        return getattr(op, self.op_type)(x, gamma, **attrs, _name=name)  # type: ignore[no-any-return]


def ones_weight(x: ir.Value, dtype: ir.DataType | None = None) -> ir.Value:
    """A ones weight as wide as ``x``'s last (static: the check saw it) axis, of ``dtype`` (default
    ``x``'s: the scale's type is the output's, an fp16 norm's must be fp16)."""
    last = x.shape[-1] if x.shape is not None else None
    width = last if isinstance(last, int) else 0
    half = (dtype or x.dtype) == ir.DataType.FLOAT16
    return constant(
        _graph(x), f"ort/ones{'16' if half else ''}_{width}", np.ones(width, dtype=np.float16 if half else np.float32)
    )


def _graph(value: ir.Value) -> ir.Graph:
    graph = value.graph
    assert isinstance(graph, ir.Graph), "a matched value belongs to the graph"
    return graph


def _name(node: ir.Node) -> str:
    return node.name or node.op_type


def _candidates(model: ir.Model) -> list[ir.Node]:
    """Every mean of a square left in the graph (what an RMSNorm starts with)."""
    return [
        n
        for n in model.graph
        if n.op_type == "ReduceMean" and n.domain == "" and producer(n.inputs[0], "Pow") is not None
    ]


def fuse_rms_norm(
    model: ir.Model, *, not_fused: NotFused | None = None, op_type: str = "SimplifiedLayerNormalization"
) -> int:
    """Fuse every RMSNorm in ``model`` into ``op_type`` (``RmsNorm``); returns how many.
    ``not_fused`` gets the reason of each mean of a square left (fusion ``rms_norm``, by node name)."""
    weighted = [rule_of(RmsNorm(True, swapped, op_type)) for swapped in (False, True)]
    ones = [rule_of(RmsNorm(False, swapped, op_type)) for swapped in (False, True)]
    count = apply_rules(model, weighted) + apply_rules(model, ones)
    if not_fused is not None:
        not_fused.add("rms_norm", explain(model, weighted + ones, _candidates(model), label=_name))
    return count
