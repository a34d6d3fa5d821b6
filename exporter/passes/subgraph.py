"""Cutting a self-contained subgraph out of a graph, to evaluate it on its own.

The ORT-target passes prove facts about the traced graph by running pieces of it: the rotary
cos/sin tables (``rotary_tables``) and the decode attention mask (``decode_mask``). Both walk
back from some outputs to the graph inputs they read, copying nodes and constants; this is
that walk, once.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import onnx
import onnx_ir as ir
from onnx import external_data_helper, helper

__all__ = ["cut_subgraph", "proto_for_cuts"]


def cut_subgraph(
    proto: onnx.ModelProto,
    outputs: list[str],
    base_dir: Path,
    *,
    name: str,
    allowed_inputs: Collection[str] | None = None,
    max_external_bytes: int | None = None,
) -> onnx.ModelProto | None:
    """A model computing ``outputs`` from the graph inputs they depend on (each output of the
    type the graph records for it, float when it records none; shapes unknown), with external constants loaded from
    ``base_dir``. None when the outputs depend on an input not in ``allowed_inputs`` (when given), on an external
    constant larger than ``max_external_bytes`` (when given), on a non-standard-domain or subgraph-holding node, or on
    a value nothing produces."""
    producers = {out: node for node in proto.graph.node for out in node.output}
    initializers = {t.name: t for t in proto.graph.initializer}
    graph_inputs = {v.name: v for v in proto.graph.input}
    nodes: dict[int, onnx.NodeProto] = {}
    inits: dict[str, onnx.TensorProto] = {}
    inputs: dict[str, onnx.ValueInfoProto] = {}
    stack, seen = list(outputs), set()
    while stack:
        value = stack.pop()
        if not value or value in seen:
            continue
        seen.add(value)
        if value in graph_inputs:
            if allowed_inputs is not None and value not in allowed_inputs:
                return None
            inputs[value] = graph_inputs[value]
        elif value in initializers:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(initializers[value])
            if external_data_helper.uses_external_data(tensor):
                length = int({e.key: e.value for e in tensor.external_data}.get("length", 0))
                if max_external_bytes is not None and length > max_external_bytes:
                    return None
                external_data_helper.load_external_data_for_tensor(tensor, str(base_dir))
                tensor.data_location = onnx.TensorProto.DEFAULT
                del tensor.external_data[:]
            inits[value] = tensor
        elif value in producers:
            node = producers[value]
            if node.domain not in ("", "ai.onnx") or any(a.type == onnx.AttributeProto.GRAPH for a in node.attribute):
                return None
            nodes[id(node)] = node
            stack.extend(node.input)
        else:
            return None
    ordered = [n for n in proto.graph.node if id(n) in nodes]
    # an fp16 graph's values are fp16: declared FLOAT, ONNX Runtime refuses the model (a type mismatch)
    recorded = {
        v.name: v.type.tensor_type.elem_type
        for v in [*proto.graph.value_info, *proto.graph.output]
        if v.type.tensor_type.elem_type
    }
    outs = [helper.make_tensor_value_info(o, recorded.get(o, onnx.TensorProto.FLOAT), None) for o in outputs]
    graph = helper.make_graph(ordered, name, list(inputs.values()), outs, list(inits.values()))
    opsets = [o for o in proto.opset_import if o.domain in ("", "ai.onnx")]
    return helper.make_model(graph, opset_imports=opsets, ir_version=proto.ir_version)


def proto_for_cuts(model: ir.Model) -> onnx.ModelProto:
    """``model`` as a proto to cut subgraphs from (``cut_subgraph``), reading no weight: external
    tensors stay references, and lazy ones (the ORT target's int4 weights, ``BlockInt4``, which
    serialize as their fp32 values) are left out for the call: the Llama-3-8B shape's would have
    been 28 GB of fp32, an OOM kill. The cuts (rotary tables, decode masks) read no weight; one
    that did would find it undefined and be refused."""
    lazy = [v for v in model.graph.initializers.values() if isinstance(v.const_value, ir.LazyTensor)]
    for value in lazy:
        model.graph.initializers.pop(value.name or "")
    try:
        return ir.to_proto(model)
    finally:
        for value in lazy:
            model.graph.register_initializer(value)
