"""The scales an int8 or fp8 Q/DQ graph is to hold, made by kiln from the calibrator's ranges and
the fp32 weights before the quantizer writes anything (``parity.qdq_numbers`` says what parity
does with them).

int8 (``precision.int8``, ONNX Runtime's ``QDQQuantizer``, symmetric): a tensor whose values reach
``amax`` gets ``scale = float32((2 * amax) / 254)`` computed in float64 (``[-amax, amax]`` onto
``[-127, 127]``), 1.0 where that is below float32's smallest normal; activations per tensor on a
quantized MatMul's input and output (its calibrated range), weights per output column (``amax``
of the column, with 0 in the range). fp8 (``precision.fp8``): ``fp16(amax / 448)``, 1.0 where 0,
on a quantized MatMul's input and per weight column; its output stays float.

Only MatMuls of an activation by a constant ``[K, N]`` weight are modelled (a plain Gemm is one
by then: ``int8.int8_matmuls``); an export that quantizes any other (the attention MatMuls or MoE
experts of ``--int8-all-matmuls``, two activations) gets no numbers (None), and parity judges it
against the checkpoint's model only, as before issue 40.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np
import onnx_ir as ir

from kiln.exporter.parity.qdq_numbers import QdqModule, QdqNumbers
from kiln.exporter.passes.names import module_of

__all__ = ["int8_scale", "int8_numbers", "fp8_numbers", "QdqSink", "qdq_sink", "fp8_scale", "FP8_MAX"]

_TINY = np.finfo(np.float32).tiny
FP8_MAX = 448.0  # E4M3's largest finite value


def fp8_scale(amax: np.ndarray) -> np.ndarray:
    """fp8 E4M3 scales of ``amax``: ``fp16(amax / 448)``, 1.0 where 0."""
    s = (np.asarray(amax, dtype=np.float32) / FP8_MAX).astype(np.float16)
    return np.where(s > 0, s, np.float16(1.0)).astype(np.float16)  # never 0; fp16's smallest normal is 6e-5


def int8_scale(amax: np.ndarray) -> np.ndarray:
    """Symmetric int8 scales of ``amax`` (float32, any shape), as ONNX Runtime's ``compute_scale_zp``."""
    a = np.asarray(amax, dtype=np.float32).astype(np.float64)
    scale = (a - -a) / 254.0
    return np.where(scale < _TINY, 1.0, scale).astype(np.float32)


def _int8_weight_scale(weight: np.ndarray) -> np.ndarray:
    w = np.asarray(weight, dtype=np.float32)
    lo, hi = np.minimum(w.min(axis=0), np.float32(0)), np.maximum(w.max(axis=0), np.float32(0))
    return int8_scale(np.maximum(np.abs(lo), np.abs(hi)))


def _amax(lo_hi: tuple[float, float]) -> np.ndarray:
    return np.asarray(max(abs(lo_hi[0]), abs(lo_hi[1])), dtype=np.float32)


def _numbers(
    graph: ir.Graph,
    targets: set[str],
    ranges: Mapping[str, tuple[float, float]],
    scale: Callable[[np.ndarray], np.ndarray],
    weight_scale: Callable[[np.ndarray], np.ndarray],
    outputs: bool,
) -> dict[str, QdqModule] | None:
    """Per target MatMul's module: its input's (and with ``outputs`` its output's) scale from its
    calibrated range, and its weight's column scales; None where a target is not modelled."""
    found: dict[str, QdqModule] = {}
    for node in graph:
        if node.name not in targets:
            continue
        x, w = (node.inputs[0], node.inputs[1]) if node.op_type == "MatMul" and len(node.inputs) == 2 else (None, None)
        tensor = w.const_value if w is not None else None
        module = module_of(node)
        name = x.name if x is not None else None
        if (
            name is None
            or tensor is None
            or len(tensor.shape) != 2
            or not module
            or module in found
            or name not in ranges
        ):
            return None
        out = node.outputs[0].name if outputs else None
        if out is not None and out not in ranges:
            return None
        made = scale(_amax(ranges[name])), scale(_amax(ranges[out])) if out is not None else None
        found[module] = QdqModule(module, node.name or "", *made, weight_scale(tensor.numpy()))
    return found


def int8_numbers(
    graph: ir.Graph, targets: list[str], ranges: Mapping[str, tuple[float, float]]
) -> dict[str, QdqModule] | None:
    """int8's numbers of ``graph`` (fp32, before quantization) for its ``targets``."""
    return _numbers(graph, set(targets), ranges, int8_scale, _int8_weight_scale, outputs=True)


def fp8_numbers(
    graph: ir.Graph, targets: list[str], ranges: Mapping[str, tuple[float, float]]
) -> dict[str, QdqModule] | None:
    """fp8's numbers of ``graph`` (fp32, before quantization) for its ``targets``."""
    return _numbers(
        graph,
        set(targets),
        ranges,
        fp8_scale,
        lambda w: fp8_scale(np.abs(np.asarray(w, dtype=np.float32)).max(axis=0)),
        outputs=False,
    )


class QdqSink:
    """Where an export's Q/DQ passes leave their numbers, graph by graph (a kind's ``Prepared``
    holds one: ``qdq_sink`` finds it); ``numbers`` is None unless every graph's were modelled."""

    def __init__(self, form: str) -> None:
        self.form = form
        self.graphs: dict[str, dict[str, QdqModule] | None] = {}

    def keep(self, graph: str, numbers: dict[str, QdqModule] | None) -> None:
        self.graphs[graph] = numbers

    def numbers(self) -> QdqNumbers | None:
        made = {graph: modules for graph, modules in self.graphs.items() if modules}
        return QdqNumbers(self.form, made) if made and len(made) == len(self.graphs) else None


def qdq_sink(prepared: Iterable[object]) -> QdqSink | None:
    """The Q/DQ numbers' sink among an export's prepared kinds (None: no int8 or fp8 Q/DQ)."""
    return next((sink for p in prepared if isinstance(sink := getattr(p, "qdq", None), QdqSink)), None)
