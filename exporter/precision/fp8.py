"""Pass: fp8 E4M3 Q/DQ before MatMul inputs, the form TensorRT builds on Ada (SM 8.9) and later
(docs/precisions.md, fp8), the placement of ``--int8``'s:

- weights per output channel: a FLOAT8E4M3FN ``[K, N]`` initializer and
  ``DequantizeLinear(axis=1, scale [N], zero point float8e4m3fn zeros)`` (one byte a weight, as
  ModelOpt's ``dq_only`` form), ``scale = amax / 448`` of each column;
- activations per tensor: ``QuantizeLinear -> DequantizeLinear`` with a scalar
  ``scale = amax / 448`` from calibration (the ranges ``--int8`` computes, ``--calib-method``),
  one pair per tensor, shared by the MatMuls that read it;
- zero points float8e4m3fn zeros (they also give QuantizeLinear its output type), scales fp16
  (the graph around them is fp16), opset >= 19.

A plain ``Gemm`` (GPT-2's Conv1D) is first written as ``MatMul`` + ``Add`` (``passes.gemm``).
The LM head and the attention-score MatMuls stay float (``--int8``'s default rules), and the
MatMuls ``--fp8-float`` names stay fp16 (the study's Llama: its first layer, measured). Written here,
not with ONNX Runtime's ``quantize_static``: its fp8 calibration takes only the ``Distribution``
method, matches a Gaussian's std instead of the range (large activations saturate) and puts Q/DQ
on MatMul outputs too (0.71 top-1 agreement on the demo, measured in issue 16).
ml_dtypes (onnx-ir's own dependency) rounds to E4M3; it does not saturate (NaN above 464), so
values are clipped to +-448 first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np
import onnx_ir as ir

from kiln.errors import ConfigError, ExportError
from kiln.exporter.passes.gemm import plain_gemms_as_matmuls
from kiln.exporter.passes.ir_utils import set_dtype
from kiln.exporter.passes.names import module_of
from kiln.exporter.passes.reports import Report
from kiln.exporter.precision.int8 import DEFAULT_INT8_FLOAT, int8_targets
from kiln.exporter.precision.kinds.base import Prepared, kind_options
from kiln.exporter.precision.lowbit_check import CheckLowBit
from kiln.exporter.precision.policy import KeepFloat, rule_matches
from kiln.exporter.precision.qdq_rules import MIN_FP8_OPSET
from kiln.exporter.precision.qdq_scales import FP8_MAX, QdqSink, fp8_numbers, fp8_scale

if TYPE_CHECKING:
    from kiln.exporter.contract.io import GraphKind
    from kiln.exporter.parity.qdq_numbers import QdqModule
    from kiln.exporter.precision.context import PrecisionContext
    from kiln.exporter.precision.kinds.base import GraphReports, Ranges
    from kiln.exporter.precision.kinds.fp8 import Fp8

__all__ = ["prepare", "QuantizeFp8", "FP8_MAX", "MIN_FP8_OPSET", "fp8_scale"]

_FP8 = ir.DataType.FLOAT8E4M3FN
_SCALE = ir.DataType.FLOAT16


def fp8_weight(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``weight [K, N]`` -> (E4M3 values [K, N], fp16 scale [N]): per output column, amax / 448."""
    w = np.asarray(weight, dtype=np.float32)
    scale = fp8_scale(np.abs(w).max(axis=0))
    return np.clip(w / scale.astype(np.float32), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn), scale


def _const(
    graph: ir.Graph, name: str, make: Callable[[], np.ndarray], dtype: ir.DataType, shape: tuple[int, ...]
) -> ir.Value:
    tensor = ir.LazyTensor(lambda: ir.tensor(make(), dtype=dtype), dtype, ir.Shape(shape), name=name)
    value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape), const_value=tensor)
    graph.register_initializer(value)
    return value


class QuantizeFp8(ir.passes.InPlacePass):
    """fp8 Q/DQ on the MatMuls ``policy`` does not keep float; activation ranges from ``calibrate``
    (run on the fp32 graph). ``quantized`` names the MatMuls."""

    def __init__(
        self,
        calibrate: Callable[[ir.Model], dict[str, tuple[float, float]]],
        policy: KeepFloat,
        required: tuple[str, ...] = (),
        keep: Callable[[dict[str, QdqModule] | None], None] | None = None,
    ) -> None:
        super().__init__()
        self.calibrate, self.policy = calibrate, policy
        self.required = required  # --fp8-float rules: each must name some MatMul (a typo would keep nothing)
        self.keep = keep  # given the scales kiln expects the Q/DQ to hold (``qdq_scales``), made before any is written
        self.quantized: list[str] = []
        self._ran = False

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if model.opset_imports.get("", 0) < MIN_FP8_OPSET:
            raise ExportError(f"--fp8 needs --opset {MIN_FP8_OPSET} or later, found {model.opset_imports.get('', 0)}")
        for rule in self.required:
            if not any(n.op_type == "MatMul" and rule_matches(rule, n) for n in graph):
                raise ConfigError(
                    f"--fp8-float {rule}: no MatMul of the {graph.name} graph matches it (modules look like "
                    "/layers.0.mlp.fc2/, or *.fc2 for every layer's)"
                )
        names = set(int8_targets(graph, self.policy))
        names |= plain_gemms_as_matmuls(graph, names)  # GPT-2's Conv1D: passes.gemm
        targets = []
        for node in graph:
            weight = (
                node.inputs[1]
                if node.op_type == "MatMul" and node.domain == "" and node.name in names and len(node.inputs) == 2
                else None
            )
            tensor = weight.const_value if weight is not None else None
            if (
                weight is not None
                and tensor is not None
                and weight.dtype == ir.DataType.FLOAT
                and len(tensor.shape) == 2
                and node.inputs[0] is not None
            ):
                targets.append(node)
        ranges = self.calibrate(model) if targets else {}
        if self.keep is not None:
            self.keep(fp8_numbers(graph, [n.name or "" for n in targets], ranges))
        activations: dict[int, ir.Value] = {}
        for node in targets:
            x = node.inputs[0]
            assert x is not None
            if id(x) not in activations:
                activations[id(x)] = self._activation(graph, node, x, ranges)
            node.replace_input_with(0, activations[id(x)])
            self._weight(graph, node)
        self.quantized = [n.name or "" for n in targets]
        self._ran = True
        return ir.passes.PassResult(model, modified=bool(targets))

    report_name = "fp8"

    @property
    def report(self) -> Report | None:
        """The manifest's ``passes.fp8``: the MatMuls with fp8 Q/DQ inputs."""
        return {"nodes": list(self.quantized)} if self._ran else None

    def _activation(
        self, graph: ir.Graph, node: ir.Node, x: ir.Value, ranges: dict[str, tuple[float, float]]
    ) -> ir.Value:
        if x.name not in ranges:
            raise ExportError(f"{node.name}: no calibrated range for its input {x.name}")
        lo, hi = ranges[x.name]
        base = f"fp8/{x.name}"
        scale = _const(graph, f"{base}.scale", lambda: fp8_scale(np.array(max(abs(lo), abs(hi)))), _SCALE, ())
        zero = _const(graph, f"{base}.zero_point", lambda: np.zeros((), dtype=ml_dtypes.float8_e4m3fn), _FP8, ())
        q = ir.node("QuantizeLinear", [x, scale, zero], name=f"{node.name}/input/QuantizeLinear")
        dq = ir.node("DequantizeLinear", [q.outputs[0], scale, zero], name=f"{node.name}/input/DequantizeLinear")
        set_dtype(q.outputs[0], _FP8)
        set_dtype(dq.outputs[0], _SCALE)
        q.outputs[0].shape = dq.outputs[0].shape = x.shape
        q.outputs[0].name, dq.outputs[0].name = f"{base}.q", f"{base}.dq"
        graph.insert_before(node, [q, dq])
        return dq.outputs[0]

    def _weight(self, graph: ir.Graph, node: ir.Node) -> None:
        weight = node.inputs[1]
        assert weight is not None and weight.const_value is not None
        tensor = weight.const_value
        k, n = tensor.shape.numpy()
        made: dict[str, tuple[np.ndarray, np.ndarray]] = {}

        def numbers() -> tuple[np.ndarray, np.ndarray]:
            if "w" not in made:
                made["w"] = fp8_weight(tensor.numpy())
            return made["w"]

        base = f"fp8/{module_of(node) or node.name}"
        q = _const(graph, f"{base}.weight", lambda: numbers()[0], _FP8, (k, n))
        scale = _const(graph, f"{base}.weight_scale", lambda: numbers()[1], _SCALE, (n,))
        zero = _const(
            graph, f"{base}.weight_zero_point", lambda: np.zeros(n, dtype=ml_dtypes.float8_e4m3fn), _FP8, (n,)
        )
        dq = ir.node("DequantizeLinear", [q, scale, zero], {"axis": 1}, name=f"{node.name}/weight/DequantizeLinear")
        set_dtype(dq.outputs[0], _SCALE)
        dq.outputs[0].shape, dq.outputs[0].name = ir.Shape([k, n]), f"{base}.weight_dq"
        graph.insert_before(node, dq)
        node.replace_input_with(1, dq.outputs[0])
        if (
            not weight.uses()
            and not weight.is_graph_output()
            and weight.name is not None
            and weight.name in graph.initializers
        ):
            graph.initializers.pop(weight.name)


_FORMAT = (
    "fp8 E4M3 Q/DQ: weights float8e4m3fn per output channel (DequantizeLinear axis 1), activations per tensor, "
    "scales amax/448 in fp16"
)


def prepare(kind: Fp8, context: PrecisionContext) -> Prepared:
    """The fp8 kind's machinery (``kinds.fp8``): int8's default float rules and ``--fp8-float``'s,
    and each graph's pass on that graph's calibrated ranges."""
    assert context.ranges is not None, "the pipeline calibrates every Needs.RANGES export"
    return _Fp8Prepared(
        KeepFloat(DEFAULT_INT8_FLOAT + kind.float_rules),
        kind.float_rules,
        context.ranges,
        context.options.calibration.method,
        QdqSink("fp8"),
        kind_options(kind),
    )


@dataclasses.dataclass(frozen=True)
class _Fp8Prepared(Prepared):
    policy: KeepFloat
    required: tuple[str, ...]  # --fp8-float rules: each must name a MatMul
    ranges: Callable[[GraphKind, ir.Model], Ranges]
    method: str  # --calib-method
    qdq: QdqSink  # each graph's scales as kiln made them: parity's Q/DQ proof (``pipeline``)
    options: dict[str, Any]  # the kind's own (``kind_options``): kiln check makes it again with them (``qdq_rerun``)

    def passes(self, kind: GraphKind) -> list[ir.passes.PassBase]:
        ranges = self.ranges
        return [
            QuantizeFp8(
                lambda model: ranges(kind, model),
                self.policy,
                self.required,
                lambda numbers: self.qdq.keep(kind.value, numbers),
            )
        ]

    def checks(self, kind: GraphKind) -> list[ir.passes.PassBase]:
        return [CheckLowBit()]

    def record(self, reports: GraphReports) -> dict[str, Any]:
        return {
            "quantization": {
                "format": _FORMAT,
                "method": self.method,
                "kept_float": {"rules": list(self.policy.keep_float), "nodes": {}},
                "options": self.options,
            }
        }
