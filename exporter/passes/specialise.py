"""Passes: the prefill and decode graphs derived from the traced unified graph.

kiln traces the model once, as the unified graph (``model.onnx``: seq >= 1, past_seq >= 0), and
derives the other two by fixing a dim and folding what it decides:

- ``SpecialiseDecode``: seq is 1. The graph computes the same function restricted to one new
  token, so this is exact by construction; folding removes the shape arithmetic it settles. (A family
  whose one-token step has a form of its own, ``LoadedModel.decode_traced``, has decode traced instead.)
- ``SpecialisePrefill``: past_seq is 0, a recurrent state (a past of fixed sizes) is zeros of
  its shape, and the past inputs are gone (the contract's prefill has
  none: TensorRT profiles with zero-length dims are fragile). Every ``Shape(past)`` becomes the
  shape the contract gives an empty past (``[batch, kv, 0, head_dim]``, batch read from
  ``input_ids``), each past input gets its static 0, and folding removes what reads it: a
  ``Concat`` drops its zero-length operand, shape arithmetic settles. The pass fails, naming the
  node, if anything still reads a past input afterwards.
- ``LastLogits`` (prefill with ``--logits last``): the LM head computes the last position only.
  The head's MatMul (the one producing the logits through position-wise ops only) reads the
  hidden state's last position (``Slice``), so the head costs one row, as the traced model's own
  ``last_logits_only`` would.

Parity checks the derived graphs exactly as it checks a traced one.
"""

from __future__ import annotations

import re

import numpy as np
import onnx_ir as ir

from kiln.errors import ExportError
from kiln.exporter.contract.io import PAST_SEQ, SEQ, GraphKind
from kiln.exporter.passes.fold import FoldConstants
from kiln.exporter.passes.ir_utils import set_dtype

__all__ = ["SpecialisePrefill", "SpecialiseDecode", "LastLogits", "specialise"]

_PAST = "past_key_values."
_POSITIONWISE = frozenset({"Add", "Sub", "Mul", "Div", "Tanh", "Cast", "Identity", "Softcap", "Neg"})


def _substitute(graph: ir.Graph, symbol: str, size: int) -> None:
    """Every dim the trace named ``symbol`` (alone or in a sum, ``past_seq + seq``) gets ``size``."""
    token = re.compile(rf"\b{re.escape(symbol)}\b")
    values = [*graph.inputs, *(o for n in graph for o in n.outputs)]
    for value in values:
        if value.shape is None or not any(
            isinstance(d, ir.SymbolicDim) and d.value and token.search(d.value) for d in value.shape
        ):
            continue
        value.shape = ir.Shape([_sized(d, token, size) for d in value.shape])


def _sized(dim: int | ir.SymbolicDim, token: re.Pattern[str], size: int) -> int | str | None:
    if not isinstance(dim, ir.SymbolicDim):
        return dim
    text = token.sub(str(size), dim.value or "")
    terms = [t.strip() for t in text.split("+")]
    numbers = sum(int(t) for t in terms if t.isdigit())
    names = [t for t in terms if not t.isdigit()]
    if not names:
        return numbers
    return " + ".join(names + ([str(numbers)] if numbers else []))


def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


def _empty_past_shape(graph: ir.Graph, node: ir.Node, ids: ir.Value, index: int) -> ir.Value:
    """What ``node`` (a Shape of a past input) computes for an empty past, from input_ids' batch."""
    past = node.inputs[0]
    assert past is not None and past.shape is not None
    _, kv, _, head_dim = past.shape
    if not isinstance(kv, int) or not isinstance(head_dim, int):
        raise ExportError(f"{past.name} has shape {past.shape}; the contract fixes its heads and head_dim")
    batch = ir.node("Shape", [ids], {"start": 0, "end": 1}, name=f"{node.name}/prefill/batch")
    rest = _const(graph, f"prefill.empty_past_shape.{index}", np.array([kv, 0, head_dim], dtype=np.int64))
    full = ir.node("Concat", [batch.outputs[0], rest], {"axis": 0}, name=f"{node.name}/prefill/Concat")
    new = [batch, full]
    start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", 4)
    if (start, end) != (0, 4):
        bounds = [
            _const(graph, f"prefill.empty_past_shape.{index}.{which}", np.array([b], dtype=np.int64))
            for which, b in (("start", start), ("end", end))
        ]
        new.append(ir.node("Slice", [full.outputs[0], *bounds], name=f"{node.name}/prefill/Slice"))
    graph.insert_before(node, new)
    return new[-1].outputs[0]


def _zero_states(graph: ir.Graph, ids: ir.Value) -> None:
    """Every recurrent state input (a past of fixed length, ``Span.STATE``) read as zeros of its
    shape, batch from ``input_ids``: prefill starts from the zero state."""
    states = [
        v
        for v in graph.inputs
        if (v.name or "").startswith(_PAST) and v.shape is not None and all(isinstance(d, int) for d in v.shape[1:])
    ]
    first = next(iter(graph), None)
    for index, state in enumerate(states):
        assert state.shape is not None and state.dtype is not None and first is not None
        batch = ir.node("Shape", [ids], {"start": 0, "end": 1}, name=f"prefill/zero_state.{index}/batch")
        rest = _const(graph, f"prefill.zero_state_shape.{index}", np.array(state.shape[1:], dtype=np.int64))
        full = ir.node("Concat", [batch.outputs[0], rest], {"axis": 0}, name=f"prefill/zero_state.{index}/Concat")
        zero = ir.tensor(np.zeros(1, dtype=state.dtype.numpy()))
        zeros = ir.node("ConstantOfShape", [full.outputs[0]], {"value": zero}, name=f"prefill/zero_state.{index}")
        set_dtype(zeros.outputs[0], state.dtype)
        zeros.outputs[0].shape = ir.Shape(state.shape)
        graph.insert_before(first, [batch, full, zeros])
        state.replace_all_uses_with(zeros.outputs[0])


class SpecialisePrefill(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        inputs = {v.name: v for v in graph.inputs}
        _zero_states(graph, inputs["input_ids"])
        for index, node in enumerate(
            [
                n
                for n in graph
                if n.op_type == "Shape" and n.inputs[0] is not None and (n.inputs[0].name or "").startswith(_PAST)
            ]
        ):
            node.outputs[0].replace_all_uses_with(_empty_past_shape(graph, node, inputs["input_ids"], index))
            graph.remove(node, safe=True)
        _substitute(graph, PAST_SEQ, 0)
        FoldConstants()(model)
        readers = [
            (v.name, use.node.name) for v in graph.inputs if (v.name or "").startswith(_PAST) for use in v.uses()
        ]
        if readers:
            raise ExportError(
                f"the past is empty at prefill but {readers[0][1]} still reads {readers[0][0]}; this model "
                "cannot be specialised"
            )
        kept = [v for v in graph.inputs if not (v.name or "").startswith(_PAST)]
        graph.inputs.clear()
        graph.inputs.extend(kept)
        return ir.passes.PassResult(model, modified=True)


class SpecialiseDecode(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        _substitute(model.graph, SEQ, 1)
        FoldConstants()(model)
        return ir.passes.PassResult(model, modified=True)


def _constant(value: ir.Value | None) -> bool:
    """A constant, or a ``Transpose`` of one (a tied embedding's LM head: ``passes.transposes``)."""
    node = value.producer() if value is not None else None
    if node is not None and node.op_type == "Transpose":
        value = node.inputs[0]
    return value is not None and value.const_value is not None


def _head_matmul(logits: ir.Value) -> ir.Node | None:
    """The MatMul (or Gemm) with a constant weight that produces ``logits`` through position-wise ops."""
    value = logits
    for _ in range(8):
        node = value.producer()
        if node is None:
            return None
        if node.op_type in ("MatMul", "Gemm") and len(node.inputs) >= 2 and _constant(node.inputs[1]):
            return node
        if node.op_type not in _POSITIONWISE:
            return None
        moving = [v for v in node.inputs if v is not None and not _constant(v)]
        if len(moving) != 1:
            return None
        value = moving[0]
    return None


class LastLogits(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        logits = next(v for v in graph.outputs if v.name == "logits")
        head = _head_matmul(logits)
        if head is None or head.inputs[0] is None:
            raise ExportError("--logits last: no LM head MatMul found behind the logits through position-wise ops")
        hidden = head.inputs[0]
        bounds = [
            _const(graph, f"last_logits.{which}", np.array([b], dtype=np.int64))
            for which, b in (("starts", -1), ("ends", np.iinfo(np.int64).max), ("axes", 1))
        ]
        last = ir.node("Slice", [hidden, *bounds], name=f"{head.name}/last_position/Slice")
        if hidden.dtype is not None:
            set_dtype(last.outputs[0], hidden.dtype)
        graph.insert_before(head, last)
        head.replace_input_with(0, last.outputs[0])
        declared = logits.shape
        value: ir.Value | None = logits
        while (
            value is not None and (node := value.producer()) is not None
        ):  # what the trace wrote of these shapes holds no longer
            value.shape = None
            value = None if node is head else next((v for v in node.inputs if v is not None and not _constant(v)), None)
        head.outputs[0].shape = None
        if declared is not None and len(declared) == 3:
            logits.shape = ir.Shape([declared[0], 1, declared[2]])
        return ir.passes.PassResult(model, modified=True)


def specialise(kind: GraphKind, last_logits_only: bool) -> list[ir.passes.PassBase]:
    """The passes that turn the unified graph into ``kind``'s."""
    if kind is GraphKind.PREFILL:
        return [SpecialisePrefill(), *([LastLogits(), FoldConstants()] if last_logits_only else [])]
    if kind is GraphKind.DECODE:
        return [SpecialiseDecode()]
    return []
