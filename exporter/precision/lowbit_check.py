"""The checks every low-bit graph passes before it is written (and again in the tests): kiln's
rules for what TensorRT builds (``int4.check_int4``, ``qdq_rules.check_qdq``) on the graph in memory,
then ``onnx.checker`` with its full check (shape and type inference) on the file written."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
from kiln.errors import ExportError

__all__ = ["CheckLowBit", "check_low_bit", "onnx_full_check"]


def check_low_bit(model: ir.Model) -> int:
    """Every int4, int8 and fp8 Q/DQ rule; the number of low-bit DQs checked."""
    from kiln.exporter.precision.int4 import check_int4
    from kiln.exporter.precision.qdq_rules import check_qdq

    return check_int4(model) + check_qdq(model)


class CheckLowBit(ir.passes.InPlacePass):
    """``check_low_bit`` as the last precision pass (postcondition only: it changes nothing)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        check_low_bit(model)
        return ir.passes.PassResult(model, modified=False)


def onnx_full_check(path: Path) -> None:
    """``onnx.checker.check_model(path, full_check=True)``, its failure as an ``ExportError``."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ExportError(f"{path.name}: onnx.checker rejects the graph: {str(exc).splitlines()[0]}") from None
