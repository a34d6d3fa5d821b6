"""The LoRA slots of ``kiln export --lora-slots`` (``passes.lora_slots``) as the ORT target's
rewrites meet them.

A slot's ``A`` and ``B`` are graph inputs that are also initializers (overridable: an adapter
replaces them at run time), so their ``const_value`` is only the rank-0 default. A rewrite that
reads a weight (packing, int8) must not take them for constants: it would bake rank 0 into the
graph, and an adapter fed later would change nothing (``fixed_weight``). And a slotted
projection reads ``Add(MatMul(x, W), MatMul(MatMul(x, A), B))``: the q/k/v packing of a fused
layer carries the three deltas into the packed QKV (``carry_deltas``), so that GroupQueryAttention
still reads one packed value and, at decode, still rotates it itself (``gqa_rotary``).
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.exporter.passes.ir_utils import copy_type, producer

__all__ = ["SlotDelta", "carry_deltas", "fixed_weight", "slot_delta"]

SlotDelta = tuple[ir.Node, ir.Value, ir.Node]  # (the projection's MatMul, its LoRA delta, the Add of both)


def fixed_weight(value: ir.Value | None) -> ir.TensorProtocol | None:
    """``value``'s constant tensor, or None when it has none or is a graph input (an overridable
    initializer: a LoRA slot's A or B, whose default is not what runs)."""
    if value is None or value.is_graph_input():
        return None
    return value.const_value


def slot_delta(value: ir.Value | None) -> SlotDelta | None:
    """``value = Add(MatMul(x, W), MatMul(MatMul(x, A), B))`` with A and B graph inputs (a LoRA
    slot's path, as ``passes.lora_slots`` writes it): its MatMul, delta and Add; else None."""
    add = producer(value, "Add")
    if add is None or len(add.inputs) != 2:
        return None
    base, up = producer(add.inputs[0], "MatMul"), producer(add.inputs[1], "MatMul")
    down = producer(up.inputs[0], "MatMul") if up is not None else None
    if base is None or up is None or down is None or base.inputs[0] is None or down.inputs[0] is not base.inputs[0]:
        return None
    if not all(w is not None and w.is_graph_input() for w in (down.inputs[1], up.inputs[1])):
        return None
    delta = add.inputs[1]
    assert delta is not None
    return base, delta, add


def carry_deltas(graph: ir.Graph, split_outputs: list[ir.Value], slotted: list[SlotDelta]) -> None:
    """The packed ``Split(MatMul(x, [Wq|Wk|Wv]))`` of ``pack.pack_matmuls`` (its outputs, read by
    the slots' Adds) -> ``Split(Add(MatMul(x, [Wq|Wk|Wv]), Concat(dq, dk, dv)))``: each Split
    output is its projection plus its own delta, exactly what the Adds computed, and what read
    the Adds reads the Split. The Adds are removed; the graph is sorted again (the Split now
    reads the deltas, made after it)."""
    split = split_outputs[0].producer()
    assert split is not None and split.op_type == "Split" and split.inputs[0] is not None
    packed = split.inputs[0]
    prefix = (split.name or "").removesuffix("/Split")
    concat = ir.node("Concat", [delta for _, delta, _ in slotted], {"axis": -1}, name=f"{prefix}/lora/Concat")
    total = ir.node("Add", [packed, concat.outputs[0]], name=f"{prefix}/lora/Add")
    for value in (concat.outputs[0], total.outputs[0]):
        copy_type(value, packed)
    graph.insert_after(split, [concat, total])
    split.replace_input_with(0, total.outputs[0])
    for out, (_, _, add) in zip(split_outputs, slotted, strict=True):
        add.outputs[0].replace_all_uses_with(out)
        graph.remove(add, safe=True)  # now, not later: a Split output read by a dead Add does not fuse (gqa_rotary)
    graph.sort()
