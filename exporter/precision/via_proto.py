"""Running an ONNX Runtime tool that works on ``onnx.ModelProto`` over an in-memory onnx-ir model.

ONNX Runtime's fp16 converter and its Q/DQ quantizer both take and return protobufs. The round
trip and its fix-ups are the same for both: serialize, run the tool, deserialize, apply the
caller's repair, sort the graph (both tools append their new nodes at the end; ONNX and
TensorRT's parser need a topologically sorted graph) and give every initializer the value type
of its tensor (the tools leave stale types in value_info, which strict shape inference and
TensorRT's parser reject).
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
import onnx_ir as ir

from kiln.exporter.passes.ir_utils import set_dtype

__all__ = ["via_proto"]


def via_proto(
    model: ir.Model,
    tool: Callable[[onnx.ModelProto], onnx.ModelProto],
    repair: Callable[[ir.Graph], object] | None = None,
) -> ir.Model:
    """A new model: ``tool`` applied to ``model``'s proto. ``model`` must not be used afterwards."""
    proto = ir.serde.serialize_model(model)
    del model
    result = ir.serde.deserialize_model(tool(proto))
    if repair is not None:
        repair(result.graph)
    result.graph.sort()
    for value in result.graph.initializers.values():
        if value.const_value is not None:
            set_dtype(value, value.const_value.dtype)
    return result
