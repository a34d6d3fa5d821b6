"""Pass: MatMuls that read the same input with constant weights -> one MatMul and a Split.

At decode a MatMul is a matrix-vector product bound by reading its weight; several of them over
the same activation (a SwiGLU MLP's gate and up projections, the q/k/v projections of a layer
whose attention stayed portable) are as many kernel launches and passes over the input. Packing
their weights side by side (``[K, N1 + N2 + ...]``) makes them one kernel, as ONNX Runtime
GenAI's builder does. Exact: the Split returns each MatMul's own output. The packed weight is a
new tensor (``weights.ort.bin``); the portable graphs keep the separate ones.
"""

from __future__ import annotations

import os

import numpy as np
import onnx_ir as ir

from kiln.exporter.passes.ir_utils import constant, copy_type, set_dtype
from kiln.exporter.passes.names import module_of
from kiln.exporter.patterns.rules import NotFused
from kiln.exporter.targets.ort.int4 import BlockInt4, register
from kiln.exporter.targets.ort.lora import fixed_weight

__all__ = ["pack_matmuls", "pack_shared_input_matmuls", "packable", "packable_reason"]


def _weight(node: ir.Node) -> ir.TensorProtocol | None:
    tensor = fixed_weight(node.inputs[1]) if len(node.inputs) == 2 else None  # a LoRA slot's A is no constant
    if tensor is None or len(tensor.shape) != 2 or tensor.dtype != ir.DataType.FLOAT:
        return None
    return tensor


def packable_reason(nodes: list[ir.Node]) -> str | None:
    """Why ``nodes`` cannot be packed, or None: two or more MatMuls reading one input, each with
    a constant float [K, N_i] weight of one K, none of them a graph output."""
    weights = [_weight(n) for n in nodes]
    if len(nodes) < 2:
        return "fewer than two MatMuls"
    if any(w is None for w in weights):
        return "a weight is not a constant float [K, N] matrix"
    if nodes[0].inputs[0] is None or any(
        n.op_type != "MatMul" or n.domain != "" or n.inputs[0] is not nodes[0].inputs[0] for n in nodes
    ):
        return "they do not all read one input"
    if len({w.shape[0] for w in weights if w is not None}) != 1:
        return "their weights differ in K"
    if any(n.outputs[0].is_graph_output() for n in nodes):
        return "a MatMul's output is a graph output"
    return None


def packable(nodes: list[ir.Node]) -> bool:
    """``packable_reason`` finds nothing against packing ``nodes``."""
    return packable_reason(nodes) is None


def pack_matmuls(graph: ir.Graph, nodes: list[ir.Node], prefix: str) -> list[ir.Value]:
    """Replace ``packable`` ``nodes`` by one MatMul on their weights side by side (in the order
    given) and a Split; returns the Split's outputs, which now feed what read each MatMul. The
    new tensors are named ``ort/<prefix>.packed.*``."""
    weights = [w for w in map(_weight, nodes) if w is not None]
    assert len(weights) == len(nodes), "pack_matmuls needs packable() nodes"
    name = f"ort/{prefix}.packed.weight"
    if all(
        isinstance(w, BlockInt4) for w in weights
    ):  # int4 weights stay int4: their numbers side by side (blocks run along K)
        packed = graph.initializers.get(name) or register(
            graph, BlockInt4.side_by_side(name, [w for w in weights if isinstance(w, BlockInt4)])
        )
    else:
        packed = constant(graph, name, np.concatenate([w.numpy() for w in weights], axis=1))
    sizes = constant(graph, f"ort/{prefix}.packed.split", np.array([w.shape[1] for w in weights], dtype=np.int64))
    matmul = ir.node("MatMul", [nodes[0].inputs[0], packed], name=f"/{prefix}/ort/packed/MatMul")
    set_dtype(matmul.outputs[0], ir.DataType.FLOAT)
    split = ir.node(
        "Split", [matmul.outputs[0], sizes], {"axis": -1}, num_outputs=len(nodes), name=f"/{prefix}/ort/packed/Split"
    )
    graph.insert_after(nodes[-1], [matmul, split])  # the caller sorts the graph once its passes are done
    for out, old in zip(split.outputs, nodes, strict=True):
        copy_type(out, old.outputs[0])
        old.outputs[0].replace_all_uses_with(out)
    return list(split.outputs)


def pack_shared_input_matmuls(model: ir.Model, *, not_fused: NotFused | None = None) -> list[str]:
    """Pack every group of two or more float MatMuls that share their first input and have
    constant 2-D weights; returns the names of the packed MatMuls it wrote. ``not_fused`` gets
    why each other such group is not packed (fusion ``pack``, by the group's first MatMul).

    Hand-written, not a rewrite rule: a group is every MatMul of one input, of any size, with
    no node in common but that input (a pattern matches a fixed subgraph below one root)."""
    graph = model.graph
    groups: dict[int, list[ir.Node]] = {}
    for node in graph:
        if node.op_type == "MatMul" and node.domain == "" and node.inputs[0] is not None and _weight(node) is not None:
            groups.setdefault(id(node.inputs[0]), []).append(node)
    written: list[str] = []
    for nodes in groups.values():
        reason = packable_reason(nodes) if len(nodes) > 1 else None
        if reason is not None and not_fused is not None:
            not_fused.add("pack", [f"{nodes[0].name}: {reason}"])
        if len(nodes) < 2 or reason is not None:
            continue
        prefix = os.path.commonprefix([module_of(n) for n in nodes]).rstrip("._") or "graph"
        prefix += "" if not any(w.startswith(f"/{prefix}/") for w in written) else f".{len(written)}"
        pack_matmuls(graph, nodes, prefix)
        written.append(f"/{prefix}/ort/packed/MatMul")
    return written
