"""``precision.int8_form``: the smallest graph ONNX Runtime 1.32's default session cannot load (an
int8 Q/DQ pair with an explicit int8 zero point, its DequantizeLinear feeding a Reshape, at opset
>= 21), which optimizers it takes to fail and which forms load, and the pass that writes the form
that loads: the same numbers, TensorRT's rules and onnx.checker's full check kept."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes.common import RemoveUnusedNodesPass

from kiln.errors import ExportError
from kiln.exporter.precision.int8_form import int8_type_attribute_form
from kiln.exporter.precision.qdq_rules import check_qdq

LOAD_ERROR = "output_dtype INT8 does not match y_zero_point type UINT8"
X = np.linspace(-3.0, 3.0, 16, dtype=np.float32).reshape(1, 16)


def reproducer(opset: int = 24, zero: np.ndarray | None = None, zero_type: int = TensorProto.INT8) -> onnx.ModelProto:
    """x [1, 16] -> QuantizeLinear(scale 0.05, zero) -> DequantizeLinear -> Reshape [1, 2, 2, 4] -> y:
    what a q/k/v projection's output pair does before the attention in ``--target onnx`` graphs."""
    zero = np.array(0, dtype=np.int8) if zero is None else zero
    inits = [
        numpy_helper.from_array(np.array(0.05, dtype=np.float32), "scale"),
        helper.make_tensor("zero", zero_type, [], [zero.item()])
        if zero_type != TensorProto.INT8
        else numpy_helper.from_array(zero, "zero"),
        numpy_helper.from_array(np.array([1, 2, 2, 4], dtype=np.int64), "shape"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["q"], name="/proj/QuantizeLinear"),
        helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["dq"], name="/proj/DequantizeLinear"),
        helper.make_node("Reshape", ["dq", "shape"], ["y"], name="/attn/Reshape"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 2, 4])],
        inits,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=11 if opset >= 24 else 10
    )


def session(
    model: onnx.ModelProto,
    disabled: tuple[str, ...] = (),
    level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.log_severity_level = 3
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"], disabled_optimizers=list(disabled)
    )


def rewritten(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    model_ir = ir.serde.deserialize_model(model)
    count = int8_type_attribute_form(model_ir)
    RemoveUnusedNodesPass()(model_ir)
    return ir.serde.serialize_model(model_ir), count


@pytest.mark.parametrize("opset", [21, 23, 24])
def test_onnx_runtime_cannot_load_an_explicit_int8_zero_point_before_a_reshape(opset: int) -> None:
    """The measured cause: QDQPropagationTransformer copies the pair past the Reshape, its new
    QuantizeLinear saying output_dtype INT8 with the same zero point; QDQS8ToU8Transformer makes
    that zero point uint8. Either optimizer off, or opset 19 (no output_dtype), and it loads."""
    model = reproducer(opset)
    onnx.checker.check_model(model, full_check=True)  # valid ONNX
    with pytest.raises(Exception, match=re.escape(LOAD_ERROR)) as err:
        session(model)
    assert "Node (y_q)" in str(err.value)  # the QuantizeLinear the propagation added after the Reshape
    for disabled in ("QDQPropagationTransformer", "QDQS8ToU8Transformer"):
        session(model, (disabled,))
    session(reproducer(19))


def test_the_form_without_zero_points_loads_and_computes_the_same() -> None:
    model = reproducer()
    want = session(model, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, {"x": X})[
        0
    ]  # the graph as written
    np.testing.assert_array_equal(
        want.reshape(-1), np.clip(np.rint(X / np.float32(0.05)), -128, 127).reshape(-1) * np.float32(0.05)
    )
    form, count = rewritten(model)
    assert count == 2
    quantize, dequantize = (n for n in form.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear"))
    assert list(quantize.input) == ["x", "scale"] and list(dequantize.input) == ["q", "scale"]
    assert [(a.name, a.i) for a in quantize.attribute] == [
        ("output_dtype", TensorProto.INT8)
    ] and not dequantize.attribute
    assert "zero" not in {i.name for i in form.graph.initializer}
    onnx.checker.check_model(form, full_check=True)
    inferred = {
        v.name: v.type.tensor_type.elem_type
        for v in onnx.shape_inference.infer_shapes(form, strict_mode=True).graph.value_info
    }
    assert inferred["q"] == TensorProto.INT8  # not ONNX's uint8 default
    assert check_qdq(form) == 1
    np.testing.assert_array_equal(
        session(form).run(None, {"x": X})[0], want
    )  # a default session loads it: the same numbers


def test_only_int8_zero_points_of_zeros_are_rewritten() -> None:
    model_ir = ir.serde.deserialize_model(reproducer(zero=np.array(3, dtype=np.int8)))
    assert int8_type_attribute_form(model_ir) == 0  # left for check_qdq to refuse
    with pytest.raises(ExportError, match="the zero point must be an int8 constant of zeros"):
        check_qdq(model_ir)
    fp8 = ir.serde.deserialize_model(
        reproducer(zero=np.array(0.0, dtype=np.float32), zero_type=TensorProto.FLOAT8E4M3FN)
    )
    assert int8_type_attribute_form(fp8) == 0 and all(
        len(n.inputs) == 3 for n in fp8.graph if n.op_type.endswith("QuantizeLinear")
    )


def test_opset_below_21_is_refused() -> None:
    with pytest.raises(
        ExportError, match=re.escape("export: int8 Q/DQ with output_dtype need opset 21 or later, found 19")
    ):
        int8_type_attribute_form(ir.serde.deserialize_model(reproducer(19)))
