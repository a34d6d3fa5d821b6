"""TensorRT's rules for explicit quantization, one checker for the int8 and the fp8 Q/DQ forms
(``--int8``'s from ONNX Runtime's quantizer, ``--fp8``'s written by ``precision.fp8``):

- the scale a constant, finite and > 0;
- the zero point a constant of zeros of the form's type (int8: optional; fp8: float8e4m3fn, required);
- an int8 Q/DQ without a zero point int8 all the same: a QuantizeLinear says ``output_dtype`` INT8
  (opset 21+; without it ONNX makes it uint8), a DequantizeLinear reads an int8 tensor;
- activations per tensor (a scalar or one-element scale); a per-channel scale only on a constant
  weight ``[K, N]``'s DequantizeLinear, along its output channels (axis 1);
- no scale of more than one dimension; the graph's opset at least the form's.

A node's form is its zero point's type, else its quantized value's (a QuantizeLinear's
``output_dtype``, a DequantizeLinear's input; int4 block DQs are ``int4.check_int4``'s); a Q/DQ of
neither type is judged as int8.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir

from kiln.errors import ExportError

__all__ = ["check_qdq", "MIN_INT8_OPSET", "MIN_FP8_OPSET"]

MIN_INT8_OPSET = 19  # fp16 scales (int8 + fp16) need QuantizeLinear/DequantizeLinear-19
MIN_FP8_OPSET = 19  # float8 types in QuantizeLinear/DequantizeLinear


@dataclasses.dataclass(frozen=True)
class _Form:
    name: str  # what the messages call it
    zero_types: tuple[ir.DataType, ...]
    zero_required: bool
    zero_rule: str


_INT8 = _Form("int8", (ir.DataType.INT8,), False, "the zero point must be an int8 constant of zeros")
_FP8 = _Form("fp8", (ir.DataType.FLOAT8E4M3FN,), True, "the zero point must be float8e4m3fn zeros")
_FORMS = {ir.DataType.INT8: _INT8, ir.DataType.UINT8: _INT8, ir.DataType.FLOAT8E4M3FN: _FP8}
_BLOCK_TYPES = (ir.DataType.INT4, ir.DataType.UINT4)


def check_qdq(model: ir.Model | onnx.ModelProto) -> int:
    """Every int8 and fp8 Q/DQ node of ``model`` by the rules (module docstring), or an
    ``ExportError`` naming the node; returns how many DequantizeLinear it checked."""
    if isinstance(model, onnx.ModelProto):
        model = ir.from_proto(model)
    opset = model.opset_imports.get("", 0)
    checked = 0
    for node in model.graph:
        form = _form(node) if node.op_type in ("QuantizeLinear", "DequantizeLinear") else None
        if form is None:
            continue
        if opset < MIN_INT8_OPSET:
            raise ExportError(
                f"Q/DQ graph has opset {opset}; {form.name} needs "
                f"{MIN_INT8_OPSET if form is _INT8 else MIN_FP8_OPSET} or later"
            )
        _check_node(node, form)
        checked += node.op_type == "DequantizeLinear"
    return checked


def _form(node: ir.Node) -> _Form | None:
    zero = node.inputs[2] if len(node.inputs) > 2 else None
    if zero is not None and zero.dtype is not None:
        return _FORMS.get(zero.dtype, _INT8)
    if node.op_type == "QuantizeLinear":
        declared = _output_dtype(node)
        return _INT8 if declared is None else _FORMS.get(declared, _INT8)
    source = node.inputs[0]
    if node.op_type == "DequantizeLinear" and source is not None and source.dtype in _BLOCK_TYPES:
        return None
    if node.op_type == "DequantizeLinear" and source is not None and source.dtype in _FORMS:
        return _FORMS[source.dtype]
    return _INT8


def _output_dtype(node: ir.Node) -> ir.DataType | None:
    attribute = node.attributes.get_int("output_dtype", 0)
    return ir.DataType(attribute) if attribute else None


def _check_int8_type(node: ir.Node) -> None:
    """An int8 Q/DQ without a zero point: its quantized type must still be int8."""
    if node.op_type == "QuantizeLinear" and _output_dtype(node) != ir.DataType.INT8:
        raise ExportError(
            f"{node.name}: a QuantizeLinear without a zero point must set output_dtype to int8 (without either "
            "it writes uint8)"
        )
    source = node.inputs[0]
    if node.op_type == "DequantizeLinear" and source is not None and source.dtype not in (None, ir.DataType.INT8):
        raise ExportError(
            f"{node.name}: a DequantizeLinear without a zero point must read int8, found {source.dtype.name.lower()}"
        )


def _array(value: ir.Value | None) -> np.ndarray | None:
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    return None if tensor is None else tensor.numpy()


def _check_node(node: ir.Node, form: _Form) -> None:
    scale = _array(node.inputs[1])
    if scale is None:
        raise ExportError(f"{node.name}: the scale is not a constant")
    scale = scale.astype(np.float32)
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        raise ExportError(f"{node.name}: scales must be finite and > 0, found min {scale.min()}")
    zero_value = node.inputs[2] if len(node.inputs) > 2 else None
    if zero_value is not None or form.zero_required:
        zero = _array(zero_value)
        if (
            zero is None
            or zero_value is None
            or zero_value.dtype not in form.zero_types
            or zero.astype(np.float32).any()
        ):
            raise ExportError(f"{node.name}: {form.zero_rule}")
    elif form is _INT8:
        _check_int8_type(node)
    if scale.ndim > 1:
        raise ExportError(f"{node.name}: scale must be a scalar or 1-D, found shape {scale.shape}")
    if scale.ndim == 1 and scale.size > 1:
        source = node.inputs[0]
        weight = (
            ir.convenience.get_const_tensor(source)
            if node.op_type == "DequantizeLinear" and source is not None
            else None
        )
        if weight is None:
            raise ExportError(f"{node.name}: activations must be quantized per tensor, found a scale of {scale.size}")
        shape, axis = tuple(weight.shape), node.attributes.get_int("axis", 1)  # the shape only: a weight is not read
        if len(shape) != 2 or axis not in (1, -1) or shape[1] != scale.size:
            raise ExportError(
                f"{node.name}: a per-channel {'' if form is _INT8 else 'fp8 '}weight scale must run along the "
                "output channels (axis 1 of [K, N])"
            )
