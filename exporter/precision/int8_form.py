"""Pass: the int8 Q/DQ of an opset >= 21 graph in the form whose type is an attribute, not a zero
point: every ``QuantizeLinear`` with an int8 zero point of zeros loses that input and says
``output_dtype=INT8``; every ``DequantizeLinear`` with one loses it (its int8 input says the type).
The numbers are the same (an absent zero point is zero), and so is what TensorRT's parser builds
(``QuantDequantLinearHelper`` in onnx/onnx-tensorrt ``onnxOpImporters.cpp``: without a zero point
a QuantizeLinear's type is its ``output_dtype``, INT8 here, and a DequantizeLinear's INT8).

Why (measured with ONNX Runtime 1.32, CPU, a default session; ``tests/unit/test_int8_form.py``
holds the reproducer): at opset >= 21, an int8 Q/DQ pair written with an explicit int8 zero point
whose DequantizeLinear feeds a Reshape, Transpose, Squeeze or Unsqueeze cannot be loaded.
``QDQPropagationTransformer`` copies the pair past that op and gives the QuantizeLinear it adds
``output_dtype=INT8`` (the type of the DQ's input) with the same zero point;
``QDQS8ToU8Transformer`` then turns that zero point into a uint8 one (+128) and leaves the
attribute, and the node fails type inference ("output_dtype INT8 does not match y_zero_point type
UINT8"). At opset 19 (the portable graphs) QuantizeLinear has no ``output_dtype`` and loads; a
pair with no zero point is not rewritten to uint8 and loads. The ``--target onnx`` graphs are
opset 24, and each q/k/v projection's output pair feeds the attention's Reshape.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.errors import ExportError

__all__ = ["MIN_OUTPUT_DTYPE_OPSET", "int8_type_attribute_form"]

MIN_OUTPUT_DTYPE_OPSET = 21  # QuantizeLinear-21 added output_dtype
_QDQ = ("QuantizeLinear", "DequantizeLinear")


def int8_type_attribute_form(model: ir.Model) -> int:
    """Rewrite every int8 Q/DQ of ``model`` in place (module docstring); how many it rewrote. An
    int8 zero point that is not a constant of zeros is left for ``qdq_rules.check_qdq`` to refuse."""
    opset = model.opset_imports.get("", 0)
    if opset < MIN_OUTPUT_DTYPE_OPSET:
        raise ExportError(f"int8 Q/DQ with output_dtype need opset {MIN_OUTPUT_DTYPE_OPSET} or later, found {opset}")
    rewritten = 0
    for node in model.graph:
        if node.op_type in _QDQ and node.domain == "" and _zero_int8_zeros(node):
            node.resize_inputs(2)
            if node.op_type == "QuantizeLinear":
                node.attributes["output_dtype"] = ir.AttrInt64("output_dtype", int(ir.DataType.INT8))
            rewritten += 1
    return rewritten


def _zero_int8_zeros(node: ir.Node) -> bool:
    zero = node.inputs[2] if len(node.inputs) > 2 else None
    if zero is None or zero.dtype != ir.DataType.INT8:
        return False
    tensor = ir.convenience.get_const_tensor(zero)
    return tensor is not None and not tensor.numpy().any()
