"""The checks every low-bit graph passes before it is written (and again in the tests): kiln's
rules for what TensorRT builds (``check_int4`` here, ``qdq_rules.check_qdq``) on the graph in memory,
then ``onnx.checker`` with its full check (shape and type inference) on the file written.

TensorRT's int4 block sizes are a rule apart (``tensorrt_int4_blocks``): a graph with other blocks
is a valid ONNX Runtime graph, so the export writes it and says so; ``kiln build`` and the
trtexec.sh it writes refuse it (``require_tensorrt_int4``), reading the graph files."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from kiln.errors import EngineError, ExportError
from kiln.exporter.precision.kinds.int4 import MIN_INT4_OPSET, TENSORRT_INT4_BLOCKS
from kiln.exporter.precision.qdq_rules import check_qdq

__all__ = [
    "CheckLowBit",
    "check_int4",
    "check_low_bit",
    "onnx_full_check",
    "outside_tensorrt_int4",
    "tensorrt_int4_blocks",
    "tensorrt_int4_reason",
    "require_tensorrt_int4",
]

_INT4 = (ir.DataType.INT4, ir.DataType.UINT4)


def check_low_bit(model: ir.Model) -> int:
    """Every int4, int8 and fp8 Q/DQ rule; the number of low-bit DQs checked."""
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


def check_int4(model: ir.Model) -> int:
    """TensorRT's rules for int4 block dequantization (and ONNX's), or an ``ExportError`` naming
    the node; returns how many int4 DQs it checked. Reads the scales (small), never the weights."""
    opset = model.opset_imports.get("", 0)
    checked = 0
    for node in model.graph:
        if node.op_type == "QuantizeLinear" and node.inputs[0] is not None and node.inputs[0].const_value is not None:
            raise ExportError(
                f"{node.name}: a QuantizeLinear on a constant weight; int4 weights are stored quantized "
                "(DequantizeLinear only)"
            )
        if (
            node.op_type != "DequantizeLinear"
            or node.inputs[0] is None
            or node.inputs[0].dtype not in (ir.DataType.INT4, ir.DataType.UINT4)
        ):
            continue
        checked += 1
        if opset < MIN_INT4_OPSET:
            raise ExportError(
                f"{node.name}: int4 block DequantizeLinear needs opset {MIN_INT4_OPSET}, the graph has {opset}"
            )
        weight, scale = node.inputs[0], node.inputs[1]
        zero = node.inputs[2] if len(node.inputs) > 2 else None
        if weight.dtype != ir.DataType.INT4 or weight.const_value is None or len(weight.const_value.shape) != 2:
            raise ExportError(
                f"{node.name}: the weight must be a constant signed INT4 [K, N] (TensorRT: symmetric only)"
            )
        if scale is None or scale.const_value is None:
            raise ExportError(f"{node.name}: the scale is not a constant")
        k, n = weight.const_value.shape.numpy()
        block = node.attributes.get_int("block_size", 0)
        axis = node.attributes.get_int("axis", 1)
        values = scale.const_value.numpy().astype(np.float32)
        if axis != 0 or block <= 0 or k % block or tuple(values.shape) != (k // block, n):
            raise ExportError(
                f"{node.name}: expected axis 0, a block_size dividing K={k} and scale [K/B, N]; found axis "
                f"{axis}, block_size {block}, scale {tuple(values.shape)}"
            )
        if not (np.isfinite(values).all() and (values > 0).all()):
            raise ExportError(f"{node.name}: scales must be finite and > 0, found min {values.min()}")
        if zero is not None and (zero.const_value is None or zero.const_value.numpy().astype(np.int8).any()):
            raise ExportError(
                f"{node.name}: the zero point must be absent or a constant of zeros (TensorRT: symmetric only)"
            )
        uses = list(node.outputs[0].uses())
        if not uses or any(u.node.op_type != "MatMul" or u.idx != 1 for u in uses):
            raise ExportError(f"{node.name}: an int4 weight must feed MatMul input B only")
        for use in uses:
            other = use.node.inputs[0]
            if other is not None and other.dtype is not None and other.dtype != scale.dtype:
                raise ExportError(
                    f"{node.name}: scale type {scale.dtype} differs from the MatMul's activation type "
                    f"{other.dtype} (the DQ outputs the scale's type)"
                )
    return checked


def outside_tensorrt_int4(blocks: Iterable[int]) -> tuple[int, ...]:
    """The int4 block sizes among ``blocks`` that TensorRT does not build (``TENSORRT_INT4_BLOCKS``),
    sorted, each once: the one rule the export's note and kiln build's refusal share."""
    return tuple(sorted({block for block in blocks if block not in TENSORRT_INT4_BLOCKS}))


def tensorrt_int4_blocks(model: ir.Model) -> tuple[int, ...]:
    """The ``block_size`` of ``model``'s int4 DequantizeLinear nodes that TensorRT does not build
    (``outside_tensorrt_int4``). It reads the nodes' attributes, never a manifest field (the manifest
    is a claim; the graph is what TensorRT parses) and never a tensor's data (a graph's weights can
    be gigabytes)."""
    return outside_tensorrt_int4(
        node.attributes.get_int("block_size", 0)
        for node in model.graph
        if node.op_type == "DequantizeLinear" and node.inputs[0] is not None and node.inputs[0].dtype in _INT4
    )


def tensorrt_int4_reason(blocks: Sequence[int]) -> str:
    """Why graphs with int4 ``blocks`` outside TensorRT's are for ONNX Runtime only, in the words the
    export's note, its manifest record and kiln build's refusal all use."""
    found, allowed = ", ".join(map(str, blocks)), ", ".join(map(str, TENSORRT_INT4_BLOCKS))
    outside = f"int4 DequantizeLinear block_size {found}, outside TensorRT's int4 block sizes ({allowed})"
    return f"{outside}: for ONNX Runtime only, not TensorRT"


def require_tensorrt_int4(directory: Path, graphs: Iterable[str]) -> None:
    """Refuse, in one ``EngineError`` naming it, the first of ``graphs`` (paths relative to
    ``directory``) whose int4 blocks TensorRT does not build: before kiln build builds or writes
    trtexec.sh, rather than a parser error on the GPU machine."""
    sizes, smallest = " or ".join(map(str, TENSORRT_INT4_BLOCKS)), min(TENSORRT_INT4_BLOCKS)
    fix = f"re-export with --int4-block {sizes} (and --int4-float for a weight whose K {smallest} does not divide)"
    for graph in dict.fromkeys(graphs):
        blocks = tensorrt_int4_blocks(ir.load(directory / graph))
        if blocks:
            raise EngineError(f"{graph}: {tensorrt_int4_reason(blocks)}; for engines, {fix}")
