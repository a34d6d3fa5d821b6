"""A plain ``Gemm`` written as ``MatMul`` (+ ``Add``), for the weight-quantizing passes.

GPT-2's Conv1D traces to ``Gemm(x, W, b)``. TensorRT's int4 and fp8 rules put the weight's
``DequantizeLinear`` on a ``MatMul``'s input B, and the quantizing passes read MatMuls; a Gemm that
is exactly ``x @ W + b`` (no transpose, alpha = beta = 1, a constant 2-D float ``W``) is that MatMul
and an Add, named after its module (``<module>/MatMul``, ``<module>/Add``) so the policies' module
rules still read it. Any other Gemm is left as it is.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["plain_gemms_as_matmuls"]


def plain_gemms_as_matmuls(graph: ir.Graph, names: set[str]) -> set[str]:
    """Every plain Gemm of ``graph`` named in ``names`` -> MatMul + Add; the new MatMuls' names."""
    return {_as_matmul(graph, node) for node in list(graph) if node.name in names and _plain(node)}


def _plain(node: ir.Node) -> bool:
    if node.op_type != "Gemm" or node.domain != "" or len(node.inputs) < 2:
        return False
    attrs, weight = node.attributes, node.inputs[1]
    plain = (
        attrs.get_int("transA", 0) == 0
        and attrs.get_int("transB", 0) == 0
        and attrs.get_float("alpha", 1.0) == 1.0
        and attrs.get_float("beta", 1.0) == 1.0
    )
    return (
        plain
        and weight is not None
        and weight.const_value is not None
        and weight.dtype == ir.DataType.FLOAT
        and len(weight.const_value.shape) == 2
    )


def _as_matmul(graph: ir.Graph, gemm: ir.Node) -> str:
    name = gemm.name or ""
    module = name[: name.rfind("/")]
    matmul = ir.node("MatMul", [gemm.inputs[0], gemm.inputs[1]], name=f"{module}/MatMul")
    bias = gemm.inputs[2] if len(gemm.inputs) > 2 else None
    nodes = [matmul] + ([ir.node("Add", [matmul.outputs[0], bias], name=f"{module}/Add")] if bias is not None else [])
    out, last = gemm.outputs[0], nodes[-1].outputs[0]
    last.type, last.shape = out.type, out.shape
    graph.insert_before(gemm, nodes)
    out.replace_all_uses_with(last, replace_graph_outputs=True)
    graph.remove(gemm, safe=True)
    last.name = out.name
    return matmul.name or ""
