"""Rule: an fp16 graph's RMSNorm island -> ``Cast16(RMSNormalization(Cast32(x), Cast32(weight)))``.

The fp16 pass (``precision.fp16``) keeps an RMSNorm's statistics in fp32 and writes it as
``x16 * Cast16(Reciprocal(Sqrt(ReduceMean(Pow(Cast32(x16), 2)) + eps))) [* weight16]``, which
``patterns.norm``'s rule does not see (it squares a Cast, not what it scales). This rule writes
one ONNX ``RMSNormalization`` (``stash_type=1``) over the island's fp32 input and an fp32 view of
the weight (a Cast of the fp16 initializer, which runtimes fold), and casts its output to fp16.

Why fp32 input and scale rather than fp16 ones with ``stash_type=1``: ONNX's RMSNormalization-23
allows both (X of type T, scale and Y of type V; stash_type 1 computes the statistics and
``X / RMS`` in fp32) and ONNX Runtime 1.32's CPU kernel computes either in fp32, but TensorRT's
Normalization layer takes its input, scale and output in one type with a separate compute
precision, and whether its 10.15 ONNX importer sets that precision from ``stash_type`` could not be
read here (the importer's source was not found; no engine is built on these machines). With fp32
tensors the statistics are fp32 by type in a strongly typed build, whatever the importer does with
the attribute: the island's own guarantee, kept. Numbers (ONNX Runtime, unit tests): one rounding
to fp16 at the end instead of three in the island, closer to the exact norm, finite where fp16
squares overflow. A norm without a constant weight (the native PLE's) gets fp32 ones and keeps its Mul.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, pattern

from kiln.exporter.passes.ir_utils import scalar_of
from kiln.exporter.patterns.norm import RmsNorm, ones_weight
from kiln.exporter.patterns.rules import apply_rules, fail, rule_of

__all__ = ["RmsNormFp16Island", "fuse_fp16_rms_norm"]

_FLOAT, _FLOAT16 = int(ir.DataType.FLOAT), int(ir.DataType.FLOAT16)


class RmsNormFp16Island(RmsNorm):
    """``RmsNorm`` over the fp16 pass's island (module docstring), writing ``RMSNormalization``."""

    def __init__(self, weighted: bool, swapped: bool) -> None:
        super().__init__(weighted, swapped, op_type="RMSNormalization")
        self.name = f"{self.name}Fp16Island"

    def pattern(self, op: Any, x: Any, exponent: Any, eps: Any, weight: Any) -> Any:  # type: ignore[override]
        mean = op.ReduceMean(op.Pow(op.Cast(x, to=_FLOAT), exponent), _allow_other_inputs=True, _outputs=["mean"])
        denominator = op.Cast(
            op.Reciprocal(op.Sqrt(pattern.OrValue([op.Add(mean, eps), op.Add(eps, mean)], tag_var="eps_second"))),
            to=_FLOAT16,
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

    def check(self, op: Any, *args: Any, **bound: Any) -> MatchResult:
        x, weight = bound["x"], bound.get("weight")
        if x.dtype != ir.DataType.FLOAT16:
            return fail("the island's input is not fp16")
        if self.weighted and (weight is None or weight.dtype != ir.DataType.FLOAT16):
            return fail("the weight is not an fp16 constant")
        return super().check(op, *args, squared=x, **bound)  # what it squares is x, through the Cast

    def rewrite(
        self, op: Any, x: ir.Value, eps: ir.Value, normalized: ir.Value, weight: ir.Value | None = None, **_: Any
    ) -> ir.Value:
        scale = (
            op.Cast(weight, to=_FLOAT) if self.weighted and weight is not None else ones_weight(x, ir.DataType.FLOAT)
        )
        mul = normalized.producer()
        name = f"{((mul.name if mul is not None else None) or '').rsplit('/', 1)[0]}/RMSNormalization"
        norm = op.RMSNormalization(
            op.Cast(x, to=_FLOAT), scale, axis=-1, epsilon=float(scalar_of(eps) or 0.0), stash_type=1, _name=name
        )
        return op.Cast(norm, to=_FLOAT16)  # type: ignore[no-any-return]


def fuse_fp16_rms_norm(model: ir.Model) -> int:
    """Fuse every fp16 RMSNorm island of ``model`` (``RmsNormFp16Island``); returns how many. What
    it leaves is explained by ``patterns.norm.fuse_rms_norm``, which runs after it."""
    weighted = [rule_of(RmsNormFp16Island(True, swapped)) for swapped in (False, True)]
    ones = [rule_of(RmsNormFp16Island(False, swapped)) for swapped in (False, True)]
    return apply_rules(model, weighted) + apply_rules(model, ones)
