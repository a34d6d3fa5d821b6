"""The weight-level half of an int8 or fp8 Q/DQ export's proof: every graph's Q/DQ against the
numbers its quantization made (``parity.qdq_numbers``), bit for bit.

For each graph of each set and each module the numbers hold for that graph, its MatMul must read
``DequantizeLinear(QuantizeLinear(x))`` whose scale is the numbers' input scale, and a
``DequantizeLinear`` weight (axis 1) whose column scales are the numbers'; with an output scale
(int8), its output must go only into a ``QuantizeLinear -> DequantizeLinear`` pair of that scale.
Every zero point must be zero (of the form's quantized type), and no other MatMul may read a Q/DQ
activation. The first difference is named by set, graph, MatMul and what differs ("its input has
no QuantizeLinear -> DequantizeLinear pair", "input scale 0.0123 where the calibration made
0.0112"): a pair dropped from one MatMul, or a scale written wrong, is refused before any graph
runs, and never copied into parity's reference, which is built on the numbers too
(``parity.qdq_model``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir

from kiln.exporter.parity.qdq_numbers import QdqModule, QdqNumbers
from kiln.exporter.passes.names import module_of

__all__ = ["check_graph_qdq"]

_CODES = {"int8": ir.DataType.INT8, "fp8": ir.DataType.FLOAT8E4M3FN}


def _const(value: ir.Value | None) -> np.ndarray | None:
    tensor = value.const_value if value is not None else None
    return np.asarray(tensor.numpy()) if tensor is not None else None


def _differs(found: np.ndarray | None, want: np.ndarray, what: str) -> str | None:
    """How a graph's scale differs, bit for bit, from the numbers' (None: it does not)."""
    if found is None:
        return f"its {what} scale is not a constant"
    if found.dtype != want.dtype or found.shape != want.shape:
        return (
            f"its {what} scale is {found.dtype} {list(found.shape)} where the calibration made {want.dtype} "
            f"{list(want.shape)}"
        )
    bits = np.dtype(f"u{want.dtype.itemsize}")
    bad = np.flatnonzero(found.view(bits) != want.view(bits))
    if bad.size == 0:
        return None
    at, f, w = int(bad[0]), found.reshape(-1), want.reshape(-1)
    where = f" (column {at})" if want.ndim else ""
    return f"{what} scale {float(f[at]):.8g}{where} where the calibration made {float(w[at]):.8g}"


def _zero_point(node: ir.Node, form: str, what: str) -> str | None:
    """A zero point of zeros of the form's type, or none where the type is said otherwise
    (``precision.int8_form``: a QuantizeLinear's ``output_dtype``, a DequantizeLinear's input)."""
    zero, codes = node.inputs[2] if len(node.inputs) > 2 else None, _CODES[form]
    if zero is None:
        source = node.inputs[0]
        typed = (
            node.attributes.get_int("output_dtype", 0)
            if node.op_type == "QuantizeLinear"
            else (source.dtype if source is not None else None)
        )
        return (
            None if typed == codes else f"its {what} {node.op_type} has no zero point and is not of type {codes.name}"
        )
    value = _const(zero)
    if value is None or zero.dtype != codes:
        return f"its {what} {node.op_type} has no {codes.name} zero point"
    return None if not np.any(value.astype(np.float32)) else f"its {what} zero point is not zero"


def _pair(dq: ir.Node | None, form: str, want: np.ndarray, what: str) -> str | None:
    """``dq`` as the DequantizeLinear of a QuantizeLinear -> DequantizeLinear pair of scale ``want``."""
    q = (
        dq.inputs[0].producer()
        if dq is not None and dq.op_type == "DequantizeLinear" and dq.inputs[0] is not None
        else None
    )
    if dq is None or q is None or q.op_type != "QuantizeLinear":
        return f"its {what} has no QuantizeLinear -> DequantizeLinear pair, which the calibration made a scale for"
    for node in (q, dq):
        found = _differs(_const(node.inputs[1]), want, what) or _zero_point(node, form, what)
        if found is not None:
            return found
    return None


def _weight(node: ir.Node, form: str, want: np.ndarray) -> str | None:
    w = node.inputs[1]
    dq = w.producer() if w is not None else None
    source = dq.inputs[0] if dq is not None and dq.op_type == "DequantizeLinear" else None
    if dq is None or source is None or source.const_value is None or source.dtype != _CODES[form]:
        return f"its weight is not a {_CODES[form].name} DequantizeLinear constant"
    if dq.attributes.get_int("axis", 1) != 1:
        return "its weight's DequantizeLinear is not per output column (axis 1)"
    return _differs(_const(dq.inputs[1]), want, "weight") or _zero_point(dq, form, "weight")


def _output(node: ir.Node, form: str, want: np.ndarray) -> str | None:
    users = [u.node for u in node.outputs[0].uses()]
    if not users or any(u.op_type != "QuantizeLinear" for u in users):
        return (
            "its output does not go only into a QuantizeLinear -> DequantizeLinear pair, which the calibration made "
            "a scale for"
        )
    for q in users:
        dqs = [u.node for u in q.outputs[0].uses()]
        found = (
            next((f for dq in dqs if (f := _pair(dq, form, want, "output")) is not None), None)
            if dqs
            else "its output's QuantizeLinear feeds nothing"
        )
        if found is not None:
            return found
    return None


def _module(node: ir.Node, m: QdqModule, numbers: QdqNumbers) -> str | None:
    x, form, held = node.inputs[0], numbers.form, numbers.held
    return (
        _pair(x.producer() if x is not None else None, form, held(m.input), "input")
        or _weight(node, form, held(m.weight))
        or (_output(node, form, held(m.output)) if m.output is not None else None)
    )


def _graph(path: Path, modules: Mapping[str, QdqModule], numbers: QdqNumbers) -> str | None:
    """The first MatMul of the graph at ``path`` whose Q/DQ are not the numbers', or a module missing."""
    seen: set[str] = set()
    for node in ir.load(path).graph:
        if node.op_type != "MatMul" or node.domain != "":
            continue
        module, x = module_of(node), node.inputs[0]
        made = modules.get(module)
        if made is None:
            reads = x.producer() if x is not None else None
            if reads is not None and reads.op_type == "DequantizeLinear":
                return (
                    f"{node.name}: it reads a Q/DQ activation, where the calibration made no numbers for "
                    f"{module or 'its module'}"
                )
            continue
        found = _module(node, made, numbers)
        if found is not None:
            return f"{node.name}: {found}"
        seen.add(module)
    missing = [m for m in modules if m not in seen]
    return (
        f"holds no MatMul of {missing[:3]}{' and more' if len(missing) > 3 else ''}, which the calibration made "
        "numbers for"
        if missing
        else None
    )


def check_graph_qdq(numbers: QdqNumbers, sets: Sequence[tuple[str, Mapping[str, Path]]]) -> str | None:
    """The first graph, over every set (its label, its graphs' paths by graph kind), whose Q/DQ
    differ from ``numbers`` (None when every graph holds them)."""
    for label, paths in sets:
        for kind, path in paths.items():
            modules = numbers.graphs.get(kind)
            if modules is None:
                return f"{label} {path.name}: the calibration made no numbers for a {kind} graph"
            found = _graph(path, modules, numbers)
            if found is not None:
                return f"{label} {path.name}: {found}"
    return None
