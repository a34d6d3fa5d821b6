"""Rule: ``SimplifiedLayerNormalization(a + b)`` -> ``com.microsoft.SkipSimplifiedLayerNormalization(a, b)``.

The residual Add in front of a fused RMSNorm (``patterns.norm``) goes into the kernel, whose fourth
output (the sum) feeds what read the Add (the residual stream). ONNX Runtime 1.32's own fusion
does not fire on kiln's graphs (it wants shapes it cannot prove), so it is written here, for
a and b of one ``[B, S, D]`` shape (named dims included) and dtype.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase

from kiln.exporter.passes.ir_utils import MS_DOMAIN, producer, use_ms_domain
from kiln.exporter.patterns.rules import NotFused, apply_rules, explain, fail, rule_of

__all__ = ["SkipRmsNorm", "fuse_skip_rms_norm"]


class SkipRmsNorm(RewriteRuleClassBase):
    """``SimplifiedLayerNormalization(Add(a, b), gamma)`` -> SkipSimplifiedLayerNormalization(a, b, gamma)."""

    def __init__(self) -> None:
        super().__init__("SkipRmsNorm")

    def pattern(self, op: Any, a: Any, b: Any, gamma: Any) -> Any:
        total = op.Add(a, b, _outputs=["total"])
        return op.SimplifiedLayerNormalization(total, gamma, _outputs=["normalized"]), total

    def check(self, op: Any, *_: Any, **bound: Any) -> MatchResult:  # op: the MatchContext (the base class names it so)
        a: ir.Value = bound["a"]
        b: ir.Value = bound["b"]
        if a.shape is None or b.shape is None or len(a.shape) != 3 or a.shape != b.shape:
            return fail(f"the residual Add does not add two tensors of one [B, S, D] shape ({a.shape} + {b.shape})")
        if a.dtype != b.dtype:
            return fail("the residual Add's inputs differ in type")
        return MatchResult()

    def rewrite(
        self, op: Any, a: ir.Value, b: ir.Value, gamma: ir.Value, normalized: ir.Value, **_: Any
    ) -> tuple[ir.Value, ir.Value]:
        norm = normalized.producer()
        assert norm is not None
        y, _mean, _inv_std, total = op.SkipSimplifiedLayerNormalization(
            a,
            b,
            gamma,
            epsilon=norm.attributes.get_float("epsilon", 1e-5),
            _domain=MS_DOMAIN,
            _outputs=4,
            _name=(norm.name or "").replace("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"),
        )
        return y, total


def fuse_skip_rms_norm(model: ir.Model, *, not_fused: NotFused | None = None) -> int:
    """Fuse the residual Add into every SimplifiedLayerNormalization after one; returns how many.
    ``not_fused`` gets the reason of each one left after an Add (fusion ``skip_rms_norm``)."""
    rules = [rule_of(SkipRmsNorm())]
    count = apply_rules(model, rules)
    if count:
        use_ms_domain(model)
    if not_fused is not None:
        left = [
            n
            for n in model.graph
            if n.op_type == "SimplifiedLayerNormalization"
            and n.domain == ""
            and producer(n.inputs[0], "Add") is not None
        ]
        not_fused.add("skip_rms_norm", explain(model, rules, left, label=lambda n: n.name or n.op_type))
    return count
