"""Pass: a LoRA slot on every planned Linear (``exporter.lora.slots``).

Each slot's ``MatMul(x, W)`` (or GPT-2's ``Gemm(x, W, b)``), found by its module name
(``/model.<module>/MatMul``, ``passes.names``), gets

    xa = MatMul(x, A);  d = MatMul(xa, B);  y' = Add(y, d)

with ``A``/``B`` new graph inputs that are also initializers of rank 0 (``[in, 0]``, ``[0, out]``):
ONNX Runtime runs such a graph with nothing fed as the base model, and overrides them with an
adapter's tensors. A and B take ``x``'s dtype (fp16 in fp16 graphs). Every slot must be found
exactly once in every graph, and its weight must have the slot's sizes; anything else is a graph
kiln does not understand and is refused by name.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.errors import ExportError
from kiln.exporter.contract.lora import GRAPH_PREFIX, LoraSlot, LoraSlots

__all__ = ["AddLoraSlots"]

_OPS = ("MatMul", "Gemm")


class AddLoraSlots(ir.passes.InPlacePass):
    def __init__(self, slots: LoraSlots) -> None:
        super().__init__()
        self.slots = slots

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        wanted = {f"/{GRAPH_PREFIX}{slot.module}/{op}": slot for slot in self.slots.slots for op in _OPS}
        found: dict[str, list[ir.Node]] = {}
        for node in graph:
            if node.name in wanted:
                found.setdefault(wanted[node.name].module, []).append(node)
        if missing := [s.module for s in self.slots.slots if len(found.get(s.module, ())) != 1]:
            raise ExportError(
                f"--lora-slots: the MatMul of {missing[0]} is not found exactly once "
                f"({len(found.get(missing[0], ()))} times; and {len(missing) - 1} more modules)"
            )
        for slot in self.slots.slots:  # the inputs in the slots' order, as the manifest lists them
            _wire(graph, found[slot.module][0], slot, self.slots.dtype)
        return ir.passes.PassResult(model, modified=True)


def _wire(graph: ir.Graph, node: ir.Node, slot: LoraSlot, slots_dtype: str) -> None:
    x, weight, y = node.inputs[0], node.inputs[1], node.outputs[0]
    assert x is not None and weight is not None
    shape = tuple(weight.shape or ())
    transposed = node.op_type == "Gemm" and node.attributes.get_int("transB", 0) == 1
    if (shape[::-1] if transposed else shape) != (slot.in_features, slot.out_features) or (
        node.op_type == "Gemm" and node.attributes.get_int("transA", 0) != 0
    ):
        raise ExportError(
            f"--lora-slots: {node.name} multiplies by a {list(shape)} weight, not {slot.module}'s "
            f"[{slot.in_features}, {slot.out_features}]"
        )
    dtype = x.dtype
    if dtype is None or dtype.numpy().name != slots_dtype:
        raise ExportError(
            f"--lora-slots: {node.name} computes in {dtype}, not the slots' {slots_dtype} (a Linear kept in "
            "another precision)"
        )
    uses = list(y.uses())  # before the Add below becomes one
    a = _empty_input(graph, slot.a, (slot.in_features, 0), (slot.in_features, slot.rank_dim), dtype)
    b = _empty_input(graph, slot.b, (0, slot.out_features), (slot.rank_dim, slot.out_features), dtype)
    name = node.name or ""
    base = name[: name.rfind("/")]
    down = ir.node("MatMul", [x, a], name=f"{base}/lora_A/MatMul")
    up = ir.node("MatMul", [down.outputs[0], b], name=f"{base}/lora_B/MatMul")
    add = ir.node("Add", [y, up.outputs[0]], name=f"{base}/lora/Add")
    add.outputs[0].type, add.outputs[0].shape = y.type, y.shape
    for use in uses:
        use.node.replace_input_with(use.idx, add.outputs[0])
    graph.insert_after(node, [down, up, add])


def _empty_input(
    graph: ir.Graph, name: str, empty: tuple[int, int], dims: tuple[int | str, int | str], dtype: ir.DataType
) -> ir.Value:
    array = np.zeros(empty, dtype=dtype.numpy())
    value = ir.Value(
        name=name, shape=ir.Shape(dims), type=ir.TensorType(dtype), const_value=ir.tensor(array, name=name)
    )
    graph.inputs.append(value)
    graph.register_initializer(value)
    return value
