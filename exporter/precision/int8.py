"""Pass: explicit int8 quantization (QuantizeLinear/DequantizeLinear) of MatMul inputs in
the form TensorRT's explicit quantization accepts (docs/precisions.md, int8):

- weights symmetric per output channel (a MatMul's B is ``[K, N]``: axis 1), activations
  symmetric per tensor;
- int8 zero points that are all zero, strictly positive scales;
- a plain Gemm (GPT-2's Conv1D) quantized as MatMul + a float bias Add, any other Gemm kept in
  float (``int8_matmuls`` says why);
- the LM head, the attention-score MatMuls (QK^T and PV) and fused MoE experts stay in float by
  default.

The Q/DQ insertion is ONNX Runtime's ``QDQQuantizer``, fed with ranges kiln calibrated (and
cached) itself; ``check_qdq`` then proves the rules on the result, so a quantizer version that
wrote something else fails the export instead of a TensorRT build.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnx_ir as ir

from kiln.errors import ExportError
from kiln.exporter.passes.gemm import plain_gemms_as_matmuls
from kiln.exporter.passes.reports import Report
from kiln.exporter.precision.kinds.base import Prepared, kind_options
from kiln.exporter.precision.policy import KeepFloat, rule_matches
from kiln.exporter.precision.qdq_rules import MIN_INT8_OPSET, check_qdq
from kiln.exporter.precision.qdq_scales import QdqSink, int8_numbers
from kiln.exporter.precision.via_proto import via_proto

if TYPE_CHECKING:
    from kiln.exporter.contract.io import GraphKind
    from kiln.exporter.parity.qdq_numbers import QdqModule
    from kiln.exporter.precision.context import PrecisionContext
    from kiln.exporter.precision.kinds.base import GraphReports, Ranges
    from kiln.exporter.precision.kinds.int8 import Int8

__all__ = [
    "prepare",
    "QuantizeInt8",
    "Int8Policy",
    "DEFAULT_INT8_FLOAT",
    "int8_targets",
    "int8_matmuls",
    "quantize_int8",
    "check_qdq",
    "MIN_INT8_OPSET",
]

# module-suffix rules, so that they hold for every family: kiln's `lm_head`/`layers.N.attn`,
# Hugging Face's `model.lm_head`/`model.layers.N.self_attn` (Llama, Qwen2, Mistral) and
# `transformer.h.N.attn` (GPT-2); only MatMuls of these modules themselves (QK^T, PV, the
# head), not of their projections (`...attn.q_proj` is another module)
DEFAULT_INT8_FLOAT: tuple[str, ...] = ("*.lm_head", "*.attn", "*.self_attn", "*.cross_attn")
# an MoE's experts held as one fused parameter (transformers' Qwen3-MoE, Mixtral, Llama 4): each expert's
# MatMul reads its weight through a Gather, not a constant, so int8 would quantize that weight as an
# activation (per tensor, at run time) and calibrate on the tokens routed to the expert, which a decode
# sample may not reach; they stay float, as under --fp8 and --int4 (constant weights only), and the
# Q/DQ proof (``qdq_scales``) then models every quantized MatMul. --int8-all-matmuls quantizes them.
INT8_EXPERTS_FLOAT: tuple[str, ...] = ("*.experts",)


@dataclasses.dataclass(frozen=True)
class Int8Policy(KeepFloat):
    """int8's keep-float policy: the LM head and attention scores by default."""

    keep_float: tuple[str, ...] = DEFAULT_INT8_FLOAT


def int8_targets(graph: ir.Graph, policy: KeepFloat) -> list[str]:
    """Names of the MatMul/Gemm nodes the policy quantizes, in graph order."""
    return [
        n.name
        for n in graph
        if n.op_type in ("MatMul", "Gemm") and n.name and not any(rule_matches(r, n) for r in policy.keep_float)
    ]


def int8_matmuls(graph: ir.Graph, policy: KeepFloat) -> list[str]:
    """The MatMuls --int8 quantizes, in graph order: the policy's targets, each plain ``Gemm`` among
    them first written in place as MatMul + Add (``passes.gemm``; GPT-2's Conv1D), as --fp8 and
    --int4 do; any other Gemm (a Qwen3-MoE router's, ``transB=1``) stays float.

    Why the bias stays a float Add: ONNX Runtime's quantizer would quantize a Gemm's constant bias
    to int32 (a ``DequantizeLinear`` with scale input scale x weight scale and no zero point),
    which ONNX allows but TensorRT cannot build: its parser's DequantizeLinear takes INT8, FP8, INT4
    or FP4 only (onnx-tensorrt docs/operators.md; an int32 one fails "only activation types allowed
    as input to this layer"), and TensorRT fuses a float bias Add into the int8 GEMM itself. A
    transposed Gemm's weight would get its per-channel scale on axis 0, not the output channels of
    ``[K, N]`` that ``check_qdq`` holds TensorRT's rule to; an MoE router picks experts by the order
    of its logits, which a quantized router would change."""
    names = set(int8_targets(graph, policy))
    names |= plain_gemms_as_matmuls(graph, names)
    return [n.name for n in graph if n.op_type == "MatMul" and n.name in names]


def quantize_int8(
    model: ir.Model, ranges: dict[str, tuple[float, float]], policy: KeepFloat
) -> tuple[ir.Model, list[str]]:
    """A new model with Q/DQ before the inputs of every MatMul the policy does not keep in float
    (``int8_matmuls``: a plain Gemm as MatMul + Add), and the names of the quantized nodes."""
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.calibrate import (
        CalibrationMethod,
        TensorData,
        TensorsData,
    )
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer

    if model.opset_imports.get("", 0) < MIN_INT8_OPSET:
        raise ExportError(f"--int8 needs --opset {MIN_INT8_OPSET} or later, found {model.opset_imports.get('', 0)}")
    targets = int8_matmuls(model.graph, policy)
    data = {name: TensorData(lowest=np.float32(lo), highest=np.float32(hi)) for name, (lo, hi) in ranges.items()}

    def quantize(proto: onnx.ModelProto) -> onnx.ModelProto:
        quantizer = QDQQuantizer(
            proto,
            True,  # per_channel
            False,  # reduce_range
            QuantType.QInt8,
            QuantType.QInt8,
            TensorsData(CalibrationMethod.MinMax, data),
            targets,
            [],
            ["MatMul"],
            {
                "ActivationSymmetric": True,
                "WeightSymmetric": True,
                "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1},
                "DedicatedQDQPair": False,
            },
        )
        out: onnx.ModelProto = quantizer.quantize_model()
        return out

    quantized = via_proto(model, quantize)
    check_qdq(quantized)
    return quantized, targets


class QuantizeInt8(ir.passes.FunctionalPass):
    """``quantize_int8`` as a pass, on the ranges ``calibrate`` computes for the graph it is
    given (calibration runs the fp32 graph itself); ``quantized`` names the quantized nodes."""

    def __init__(
        self,
        calibrate: Callable[[ir.Model], dict[str, tuple[float, float]]],
        policy: KeepFloat,
        keep: Callable[[dict[str, QdqModule] | None], None] | None = None,
    ) -> None:
        super().__init__()
        self.calibrate, self.policy = calibrate, policy
        self.keep = (
            keep  # given the scales kiln expects the Q/DQ to hold (``qdq_scales``), made before the quantizer runs
        )
        self.quantized: list[str] = []
        self._ran = False

    report_name = "int8"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        targets = int8_matmuls(model.graph, self.policy)  # before calibration: the Gemms' new MatMul outputs get ranges
        ranges = self.calibrate(model)
        if self.keep is not None:
            self.keep(int8_numbers(model.graph, targets, ranges))
        quantized, self.quantized = quantize_int8(model, ranges, self.policy)
        self._ran = True
        return ir.passes.PassResult(quantized, modified=True)

    @property
    def report(self) -> Report | None:
        """The manifest's ``passes.int8``: the quantized MatMul nodes."""
        return {"nodes": list(self.quantized)} if self._ran else None


_FORMAT = (
    "int8 Q/DQ (ONNX Runtime's QDQQuantizer): weights int8 per output channel (DequantizeLinear axis 1), "
    "activations per tensor on a quantized MatMul's input and output, symmetric, float32 scales"
)


def prepare(kind: Int8, context: PrecisionContext) -> Prepared:
    """The int8 kind's machinery (``kinds.int8``): its policy, and each graph's pass on that
    graph's calibrated ranges."""
    assert context.ranges is not None, "the pipeline calibrates every Needs.RANGES export"
    return _Int8Prepared(
        Int8Policy(() if kind.all_matmuls else DEFAULT_INT8_FLOAT + INT8_EXPERTS_FLOAT + kind.float_rules),
        context.ranges,
        QdqSink("int8"),
        context.options.calibration.method,
        kind_options(kind),
    )


@dataclasses.dataclass(frozen=True)
class _Int8Prepared(Prepared):
    policy: KeepFloat
    ranges: Callable[[GraphKind, ir.Model], Ranges]
    qdq: QdqSink  # each graph's scales as kiln made them: parity's Q/DQ proof (``pipeline``)
    method: str  # --calib-method
    options: dict[str, Any]  # the kind's own (``kind_options``): kiln check makes it again with them (``qdq_rerun``)

    def passes(self, kind: GraphKind) -> list[ir.passes.PassBase]:
        ranges = self.ranges
        return [
            QuantizeInt8(
                lambda model: ranges(kind, model), self.policy, lambda numbers: self.qdq.keep(kind.value, numbers)
            )
        ]

    def record(self, reports: GraphReports) -> dict[str, Any]:
        return {
            "quantization": {
                "format": _FORMAT,
                "method": self.method,
                "kept_float": {"rules": list(self.policy.keep_float), "nodes": {}},
                "options": self.options,
            }
        }

    def extras(self, reports: GraphReports) -> dict[str, Any]:
        return {"int8_nodes": {kind.value: r.get("int8", {}).get("nodes", []) for kind, r in reports.items()}}
