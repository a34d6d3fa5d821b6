"""Pass: convert a traced fp32 graph to fp16 with fp32 islands.

Weights, activations and the KV cache (past inputs, present outputs) become fp16; the nodes the
policy keeps run in fp32 with Casts at the borders; ``logits`` stays an fp32 output. The
conversion itself is ONNX Runtime's converter (``onnxruntime.transformers.float16``), which
also clamps constants to the fp16 range (the attention mask's fp32 minimum becomes -65504, not
-inf, so fully masked padding rows stay finite).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir

from kiln.exporter.precision.policy import Fp16Policy, resolve_kept_nodes
from kiln.exporter.precision.via_proto import via_proto

__all__ = ["ConvertFp16", "Fp16Result", "convert_to_fp16", "FP16_MAX"]

FP16_MAX = 65504.0


@dataclasses.dataclass(frozen=True)
class Fp16Result:
    kept_fp32: tuple[str, ...]  # node names that run in fp32
    fp32_tables: tuple[str, ...]  # folded PLE tables kept fp32 because their range exceeds fp16


def _wide_tables(graph: ir.Graph) -> list[str]:
    """Gather nodes reading a float table whose values do not fit fp16 (e.g. a PLE table)."""
    names = []
    for node in graph:
        if node.op_type == "Gather" and node.inputs and node.inputs[0] is not None:
            table = node.inputs[0].const_value
            if table is not None and table.dtype == ir.DataType.FLOAT and float(np.abs(table.numpy()).max(initial=0.0)) > FP16_MAX:
                names.append(node.name or "")
    return names


def _drop_cast_round_trips(graph: ir.Graph) -> int:
    """Remove ``Cast(to fp16) -> Cast(to fp32)`` pairs, in place.

    The converter wraps every kept node in Casts (fp16 in, fp32 compute, fp16 out), so between
    two kept nodes a value goes fp32 -> fp16 -> fp32: an fp32 island would still round (and
    overflow) through fp16 at each of its edges. ONNX Runtime removes such pairs when it
    optimises; a strongly typed TensorRT build honours them. Wiring the second Cast's
    consumers to the first Cast's fp32 input keeps the island in fp32 as the policy means."""
    removed = 0
    for node in list(graph):
        if node.op_type != "Cast" or node.attributes.get_int("to") != ir.DataType.FLOAT16:
            continue
        source = node.inputs[0]
        if source is None or source.dtype != ir.DataType.FLOAT:
            continue
        for user, _ in list(node.outputs[0].uses()):
            if user.op_type == "Cast" and user.attributes.get_int("to") == ir.DataType.FLOAT and not user.outputs[0].is_graph_output():
                user.outputs[0].replace_all_uses_with(source)
                graph.remove(user, safe=True)
                removed += 1
        if not node.outputs[0].uses() and not node.outputs[0].is_graph_output():
            graph.remove(node, safe=True)
    return removed


def convert_to_fp16(model: ir.Model, policy: Fp16Policy) -> tuple[ir.Model, Fp16Result]:
    """A new fp16 model; the input model must not be used afterwards."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    kept = resolve_kept_nodes(model.graph, policy)
    tables = _wide_tables(model.graph)
    block = sorted(set(kept) | set(tables))

    def convert(proto: onnx.ModelProto) -> onnx.ModelProto:
        converted: onnx.ModelProto = convert_float_to_float16(
            proto,
            keep_io_types=["logits"],
            disable_shape_infer=True,  # the exporter wrote every value's type; shape inference would need the whole proto < 2 GB
            op_block_list=list(DEFAULT_OP_BLOCK_LIST),
            node_block_list=block,
        )
        return converted

    return via_proto(model, convert, _drop_cast_round_trips), Fp16Result(tuple(kept), tuple(tables))


class ConvertFp16(ir.passes.FunctionalPass):
    """``convert_to_fp16`` as a pass; ``result`` says which nodes and tables stayed fp32."""

    def __init__(self, policy: Fp16Policy) -> None:
        super().__init__()
        self.policy = policy
        self.result: Fp16Result | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        converted, self.result = convert_to_fp16(model, self.policy)
        return ir.passes.PassResult(converted, modified=True)
