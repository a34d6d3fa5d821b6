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
import onnx_ir as ir

from kiln.exporter.precision.policy import Fp16Policy, resolve_kept_nodes

__all__ = ["Fp16Result", "convert_to_fp16", "FP16_MAX"]

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
                names.append(node.name)
    return names


def convert_to_fp16(model: ir.Model, policy: Fp16Policy) -> tuple[ir.Model, Fp16Result]:
    """A new fp16 model; the input model must not be used afterwards."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    kept = resolve_kept_nodes(model.graph, policy)
    tables = _wide_tables(model.graph)
    block = sorted(set(kept) | set(tables))
    proto = ir.serde.serialize_model(model)
    del model
    converted = convert_float_to_float16(
        proto,
        keep_io_types=["logits"],
        disable_shape_infer=True,  # the exporter wrote every value's type; shape inference would need the whole proto < 2 GB
        op_block_list=list(DEFAULT_OP_BLOCK_LIST),
        node_block_list=block,
    )
    return ir.serde.deserialize_model(converted), Fp16Result(tuple(kept), tuple(tables))
