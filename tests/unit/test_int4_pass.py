"""``QuantizeInt4`` (``int4.quantize``) on tiny onnx-ir graphs run by ONNX Runtime: a plain
``Gemm`` (GPT-2's Conv1D as traced) becomes ``MatMul`` + ``Add`` over an int4 block-DQ weight that
computes ``x @ dequantize(rtn(W)) + b``; a graph with nothing it may quantize is refused; ``raise_opset``
takes the reductions to opset 21 and refuses an op whose meaning changed."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from kiln.errors import ExportError
from kiln.exporter.int4.numbers import dequantize, rtn
from kiln.exporter.int4.quantize import Int4Quantizer, QuantizeInt4, check_int4, raise_opset
from kiln.exporter.precision.int8 import Int8Policy
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln.exporter.runners.ort_runner import ort_session
from kiln_testing import exact

FLOAT = ir.DataType.FLOAT
K, N = 32, 8
RNG = np.random.default_rng(0)
W, B = RNG.standard_normal((K, N)).astype(np.float32), RNG.standard_normal(N).astype(np.float32)


def gemm_model(module: str = "/h.0/attn/c_attn", **attributes: object) -> ir.Model:
    """y = Gemm(x [4, K], W [K, N], b [N]) named ``<module>/Gemm``."""
    x = ir.val("x", FLOAT, [4, K])
    w, b = ir.val("w", const_value=ir.tensor(W, name="w")), ir.val("b", const_value=ir.tensor(B, name="b"))
    gemm = ir.node("Gemm", [x, w, b], attributes or None, name=f"{module}/Gemm")
    y = gemm.outputs[0]
    y.name, y.dtype, y.shape = "y", FLOAT, ir.Shape([4, N])
    graph = ir.Graph([x], [y], nodes=[gemm], initializers=[w, b], opset_imports={"": 19}, name="g")
    return ir.Model(graph, ir_version=10)


def quantize(model: ir.Model, keep: tuple[str, ...] = ()) -> QuantizeInt4:
    p = QuantizeInt4(Int4Quantizer(Int4Method.RTN, 16), Int8Policy(keep_float=keep), FLOAT)
    p(model)
    return p


def test_a_plain_gemm_becomes_an_int4_matmul_and_add() -> None:
    model = gemm_model()
    p = quantize(model)
    assert [(n.op_type, n.name) for n in model.graph] == [
        ("DequantizeLinear", "/h.0/attn/c_attn/MatMul/weight/DequantizeLinear"),
        ("MatMul", "/h.0/attn/c_attn/MatMul"),
        ("Add", "/h.0/attn/c_attn/Add"),
    ]
    assert (
        p.record is not None
        and p.record.nodes == ("/h.0/attn/c_attn/MatMul",)
        and p.record.blocks == {"/h.0/attn/c_attn/MatMul": 16}
    )
    assert [v.name for v in model.graph.outputs] == [
        "y"
    ] and "w" not in model.graph.initializers  # the float weight is not written
    assert check_int4(model) == 1
    x = RNG.standard_normal((4, K)).astype(np.float32)
    session = ort_session(ir.serde.serialize_model(model).SerializeToString(), weight_only_dq=True)
    (got,) = session.run(None, {"x": x})
    q, scale = rtn(W, 16, np.dtype(np.float32))
    np.testing.assert_allclose(got, x @ dequantize(q, scale) + B, rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, x @ W + B, rtol=1e-5, atol=1e-5)  # int4 numbers, not the float ones


@pytest.mark.parametrize(
    ("attributes", "keep"),
    [({"transB": 1}, ()), ({"alpha": 0.5}, ()), ({}, ("*.lm_head",))],
    ids=["transposed", "scaled", "kept float"],
)
def test_a_graph_with_nothing_to_quantize_is_refused(attributes: dict[str, object], keep: tuple[str, ...]) -> None:
    model = gemm_model("/lm_head", **attributes)
    message = (
        "export: --int4 found no MatMul or plain Gemm weight to quantize in this graph (a constant 2-D float "
        "weight outside the kept-float rules): "
        "its export would be int4 in name only"
    )
    with pytest.raises(ExportError, match=exact(message)):
        quantize(model, keep)
    assert [n.op_type for n in model.graph] == ["Gemm"]  # left as it was


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_a_reduction_is_raised_to_opset_21_as_it_computes(op: str) -> None:
    """ReduceMax/ReduceMin (PhiMoE's routing, attention sinks): version 20 only adds bool inputs, so
    an opset-19 graph raised to 21 (int4's DequantizeLinear) computes what it did."""
    x = ir.val("x", FLOAT, [4, K])
    reduce = ir.node(op, [x], {"keepdims": 1}, name=f"/{op}")
    reduce.outputs[0].name, reduce.outputs[0].dtype = "y", FLOAT
    model = ir.Model(ir.Graph([x], reduce.outputs, nodes=[reduce], opset_imports={"": 19}, name="g"), ir_version=9)
    raise_opset(model, 21)
    assert model.opset_imports[""] == model.graph.opset_imports[""] == 21 and model.ir_version == 10
    data = RNG.standard_normal((4, K)).astype(np.float32)
    (got,) = ort_session(ir.serde.serialize_model(model).SerializeToString()).run(None, {"x": data})
    np.testing.assert_array_equal(got, getattr(np, op[6:].lower())(data, keepdims=True))


def test_an_op_whose_meaning_changed_is_not_raised() -> None:
    x = ir.val("x", FLOAT, [1, 4, 2])
    norm = ir.node("GroupNormalization", [x, x, x], {"num_groups": 2}, name="/norm")
    model = ir.Model(ir.Graph([x], norm.outputs, nodes=[norm], opset_imports={"": 19}, name="g"), ir_version=9)
    with pytest.raises(
        ExportError,
        match=exact(
            "export: the graph holds ['GroupNormalization'], whose meaning changed by opset 21; export with --opset 21 "
            "or later"
        ),
    ):
        raise_opset(model, 21)
    assert model.opset_imports[""] == 19
