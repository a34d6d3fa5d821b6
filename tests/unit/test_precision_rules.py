"""The precision rules on small graphs: the fp16 policy (``precision.policy``) and its fp32
islands (``precision.fp16``), the int8 node selection and TensorRT's Q/DQ rules
(``precision.int8``)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from kiln.errors import ConfigError, ExportError
from kiln.exporter.passes.names import module_of
from kiln.exporter.precision.fp16 import FP16_MAX, ConvertFp16, _drop_cast_round_trips, convert_to_fp16
from kiln.exporter.precision.int8 import (
    DEFAULT_INT8_FLOAT,
    MIN_INT8_OPSET,
    Int8Policy,
    check_qdq,
    int8_targets,
    quantize_int8,
)
from kiln.exporter.precision.policy import DEFAULT_KEEP_FP32, Fp16Policy, resolve_kept_nodes, rule_matches

F32, F16, I8 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT8


def exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def make(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    inits: Sequence[tuple[str, np.ndarray]] = (),
    opset: int = 19,
    infer: bool = True,
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "decode", inputs, outputs, [numpy_helper.from_array(a, n) for n, a in inits])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return onnx.shape_inference.infer_shapes(proto, strict_mode=True) if infer else proto


def run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def named(name: str, op: str = "MatMul") -> ir.Node:
    x = ir.val("x", ir.DataType.FLOAT, [1])
    return ir.node(op, [x, x], name=name)


# ---------------------------------------------------------------- rules


@pytest.mark.parametrize(
    ("rule", "name", "op", "hit"),
    [
        ("Softmax", "/layers.0.attn/Softmax", "Softmax", True),
        ("Softmax", "/layers.0.attn/MatMul", "MatMul", False),
        ("softmax", "/layers.0.attn/Softmax", "Softmax", False),  # op types are case-sensitive
        ("/layers.0.attn/MatMul", "/layers.0.attn/MatMul", "MatMul", True),
        ("/layers.0.attn/MatMul", "/layers.0.attn/MatMul_1", "MatMul", False),
        ("/layers.0.mlp/", "/layers.0.mlp/Add", "Add", True),
        ("/layers.0.mlp/", "/layers.0.mlp.fc1/MatMul", "MatMul", False),  # a submodule is another module
        ("/layers.0.mlp/", "/layers.0/Add", "Add", False),
        ("/", "/Add", "Add", True),  # outside any module
        ("/", "/layers.0/Add", "Add", False),
        ("*.fc2", "/layers.0.mlp.fc2/MatMul", "MatMul", True),
        ("*.fc2", "/fc2/MatMul", "MatMul", True),
        ("*.fc2", "/layers.0.mlp.fc22/MatMul", "MatMul", False),
        ("*.fc2", "/layers.0.myfc2/MatMul", "MatMul", False),
        ("*.fc2", "/layers.0.mlp.fc2.inner/MatMul", "MatMul", False),
        ("*.rotary", "/layers.0.attn.rotary/Cos", "Cos", True),
    ],
)
def test_rule_matches(rule: str, name: str, op: str, hit: bool) -> None:
    assert rule_matches(rule, named(name, op)) is hit


def test_module_of() -> None:
    assert module_of(named("/layers.0.attn.q_proj/MatMul")) == "layers.0.attn.q_proj"
    assert module_of(named("/MatMul")) == "" and module_of(named("MatMul_3")) == "" and module_of(named("")) == ""


def rms_graph(eps_as_node: bool = False) -> onnx.ModelProto:
    """x -> fc1 (MatMul) -> RMSNorm (module layers.0.norm) -> the same module's * weight ->
    Softmax (layers.0.attn) -> Add in the head -> logits. Exported names, as NameNodes writes them."""
    n = "/layers.0.norm/"
    eps_node = [
        helper.make_node(
            "Constant",
            [],
            ["eps"],
            name=f"{n}Constant",
            value=numpy_helper.from_array(np.array(1e-6, dtype=np.float32)),
        )
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w_fc1"], ["h"], name="/layers.0.mlp.fc1/MatMul"),
        helper.make_node("Pow", ["h", "two"], ["p"], name=f"{n}Pow"),
        helper.make_node("ReduceMean", ["p", "axes"], ["m"], keepdims=1, name=f"{n}ReduceMean"),
        helper.make_node("Add", ["m", "eps"], ["a"], name=f"{n}Add"),
        helper.make_node("Sqrt", ["a"], ["s"], name=f"{n}Sqrt"),
        helper.make_node("Reciprocal", ["s"], ["r"], name=f"{n}Reciprocal"),
        helper.make_node("Mul", ["h", "r"], ["nh"], name=f"{n}Mul"),  # reads h (fp16 work): not kept
        helper.make_node("Mul", ["nh", "gamma"], ["g"], name=f"{n}Mul_1"),
        helper.make_node("Softmax", ["g"], ["sm"], axis=-1, name="/layers.0.attn/Softmax"),
        helper.make_node(
            "Add", ["sm", "r"], ["sr"], name="/head/Add"
        ),  # fed by kept nodes only, another module: not kept
        helper.make_node("MatMul", ["sr", "w_head"], ["logits"], name="/lm_head/MatMul"),
    ]
    if eps_as_node:
        nodes = eps_node + nodes
    rng = np.random.default_rng(0)
    inits = [
        ("w_fc1", (rng.standard_normal((8, 8)) / 3).astype(np.float32)),
        ("two", np.array(2.0, dtype=np.float32)),
        ("axes", np.array([-1], dtype=np.int64)),
        ("gamma", (1 + 0.1 * rng.standard_normal(8)).astype(np.float32)),
        ("w_head", (rng.standard_normal((8, 5)) / 3).astype(np.float32)),
    ]
    if not eps_as_node:
        inits.append(("eps", np.array(1e-6, dtype=np.float32)))
    inputs = [helper.make_tensor_value_info("x", F32, [2, 3, 8])]
    return make(nodes, inputs, [helper.make_tensor_value_info("logits", F32, [2, 3, 5])], inits)


NORM_KEPT = [
    "/layers.0.norm/Pow",
    "/layers.0.norm/ReduceMean",
    "/layers.0.norm/Add",
    "/layers.0.norm/Sqrt",
    "/layers.0.norm/Reciprocal",
    "/layers.0.attn/Softmax",
]


def test_resolve_kept_nodes_default_policy_and_propagation() -> None:
    graph = ir.serde.deserialize_model(rms_graph()).graph
    # the eps Add is kept by propagation (element-wise, fed by the kept ReduceMean and a
    # constant, same module); the Mul reading fc1's output and the head's Add are not
    assert resolve_kept_nodes(graph, Fp16Policy()) == NORM_KEPT
    assert Fp16Policy().keep == DEFAULT_KEEP_FP32


def test_resolve_kept_nodes_extra_rules() -> None:
    graph = ir.serde.deserialize_model(rms_graph()).graph
    policy = Fp16Policy().widened(("/lm_head/MatMul", "*.fc1", "Softmax"))
    assert policy.keep == (*DEFAULT_KEEP_FP32, "/lm_head/MatMul", "*.fc1")  # no duplicate rule
    kept = resolve_kept_nodes(graph, policy)
    assert kept == [
        "/layers.0.mlp.fc1/MatMul",
        *NORM_KEPT[:5],
        "/layers.0.norm/Mul",
        "/layers.0.norm/Mul_1",
        "/layers.0.attn/Softmax",
        "/lm_head/MatMul",
    ]
    # with fc1 kept, the norm's Mul (fed by fc1 and the Reciprocal) propagates, and so does Mul_1
    assert resolve_kept_nodes(graph, Fp16Policy(("/layers.0.norm/",))) == [
        n for n in kept if n.startswith("/layers.0.norm/")
    ]


def test_propagation_never_crosses_a_module() -> None:
    graph = ir.serde.deserialize_model(rms_graph()).graph
    kept = resolve_kept_nodes(graph, Fp16Policy(("Reciprocal", "Softmax")))
    assert kept == ["/layers.0.norm/Reciprocal", "/layers.0.attn/Softmax"]  # /head/Add: fed by both, other module


@pytest.mark.parametrize("rule", ["/layers.0.attn/Matmul", "/layers.9.mlp/"])
def test_a_rule_that_names_nothing(rule: str) -> None:
    graph = ir.serde.deserialize_model(rms_graph()).graph
    message = (
        f"config: --keep-fp32 {rule}: no node of the decode graph has that name (node names look like "
        "/layers.0.attn/Softmax)"
    )
    with pytest.raises(ConfigError, match=exact(message)):
        resolve_kept_nodes(graph, Fp16Policy().widened((rule,)))


def test_op_type_and_suffix_rules_may_match_nothing() -> None:
    graph = ir.serde.deserialize_model(rms_graph()).graph
    assert resolve_kept_nodes(graph, Fp16Policy(("LayerNormalization", "*.rotary"))) == []


def test_propagation_through_a_constant_node() -> None:
    graph = ir.serde.deserialize_model(rms_graph(eps_as_node=True)).graph
    assert resolve_kept_nodes(graph, Fp16Policy()) == NORM_KEPT


# ---------------------------------------------------------------- fp16 with fp32 islands


def casts(model: ir.Model) -> list[tuple[str, int]]:
    """(the Cast's input producer, target dtype) for every Cast."""
    out = []
    for node in model.graph:
        if node.op_type == "Cast":
            source = node.inputs[0].producer() if node.inputs[0] is not None else None
            out.append(
                (source.name if source is not None else (node.inputs[0].name or ""), node.attributes.get_int("to"))
            )
    return out


def test_convert_to_fp16_keeps_the_islands_in_fp32() -> None:
    proto = rms_graph()
    x = np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)
    want = run(proto, {"x": x})[0]
    converted, result = convert_to_fp16(ir.serde.deserialize_model(proto), Fp16Policy())
    assert result.kept_fp32 == tuple(NORM_KEPT) and result.fp32_tables == ()
    graph = converted.graph
    by_name = {n.name: n for n in graph}
    for name in NORM_KEPT:  # kept nodes compute in fp32: fp32 in (but the int64 axes), fp32 out
        node = by_name[name]
        assert all(
            v.dtype == ir.DataType.FLOAT for v in node.inputs if v is not None and v.dtype != ir.DataType.INT64
        ), name
        assert node.outputs[0].dtype == ir.DataType.FLOAT, name
    for name in (
        "/layers.0.mlp.fc1/MatMul",
        "/layers.0.norm/Mul",
        "/layers.0.norm/Mul_1",
        "/head/Add",
        "/lm_head/MatMul",
    ):
        assert by_name[name].outputs[0].dtype == ir.DataType.FLOAT16, name
    assert graph.initializers["w_fc1"].const_value.dtype == ir.DataType.FLOAT16
    assert [v.dtype for v in graph.inputs] == [ir.DataType.FLOAT16] and graph.outputs[0].name == "logits"
    assert graph.outputs[0].dtype == ir.DataType.FLOAT  # logits stays an fp32 output
    # Casts only at the islands' borders: none between two kept nodes (no fp32 -> fp16 -> fp32)
    f16, f32 = ir.DataType.FLOAT16, ir.DataType.FLOAT
    assert sorted(casts(converted)) == sorted(
        [
            ("/layers.0.mlp.fc1/MatMul", f32),  # into Pow (the islands' constants stay fp32: no Cast at all)
            ("/layers.0.norm/Reciprocal", f16),  # to the fp16 Mul and the head's Add
            ("/layers.0.norm/Mul_1", f32),  # into Softmax
            ("/layers.0.attn/Softmax", f16),
            ("/lm_head/MatMul", f32),  # the fp32 logits output
        ]
    )
    for node in graph:
        if node.op_type == "Cast" and node.attributes.get_int("to") == f32:
            producer = node.inputs[0].producer()
            assert producer is None or producer.op_type != "Cast", "a round trip was left"
    got = run(ir.serde.serialize_model(converted), {"x": x.astype(np.float16)})[0]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2)


def test_fp32_island_does_not_overflow() -> None:
    """|h| ~ 300: Pow(h, 2) ~ 1e5 does not fit fp16. The island computes it in fp32, so ONNX's
    reference evaluator (true fp16 arithmetic, every Cast honoured) gives finite, fp32-close logits."""
    proto = rms_graph()
    x = (np.random.default_rng(2).standard_normal((2, 3, 8)) * 300).astype(np.float32)
    want = run(proto, {"x": x})[0]
    converted, _ = convert_to_fp16(ir.serde.deserialize_model(proto), Fp16Policy())
    h = x @ numpy_helper.to_array(next(t for t in proto.graph.initializer if t.name == "w_fc1"))
    assert np.abs(h).max() < FP16_MAX and (h.astype(np.float64) ** 2).max() > FP16_MAX
    got = ReferenceEvaluator(ir.serde.serialize_model(converted)).run(None, {"x": x.astype(np.float16)})[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-2)


def test_drop_cast_round_trips() -> None:
    """fp32 -> fp16 -> fp32 pairs are removed; a Cast whose fp16 value has other readers stays,
    and a Cast that is a graph output is left alone."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="/k/Relu"),  # fp32
        helper.make_node("Cast", ["a"], ["a16"], to=F16, name="c1"),
        helper.make_node("Cast", ["a16"], ["a32"], to=F32, name="c2"),  # round trip: removed
        helper.make_node("Cast", ["a16"], ["a32b"], to=F32, name="c3"),  # a second one: removed
        helper.make_node("Mul", ["a32", "a32"], ["e"], name="/k/Exp"),
        helper.make_node("Neg", ["a32b"], ["n"], name="/k/Neg"),
        helper.make_node("Add", ["e", "n"], ["y"], name="/k/Add"),
        helper.make_node("Cast", ["x"], ["x16"], to=F16, name="c4"),
        helper.make_node("Abs", ["x16"], ["y16"], name="/h/Abs"),  # an fp16 reader: c4 stays
        helper.make_node("Cast", ["x16"], ["x32"], to=F32, name="c5"),  # round trip: removed
        helper.make_node("Sigmoid", ["x32"], ["z"], name="/k/Sigmoid"),
        helper.make_node("Cast", ["z"], ["z16"], to=F16, name="c6"),
        helper.make_node("Cast", ["z16"], ["z32"], to=F32, name="c7"),  # a graph output: stays
    ]
    outputs = [helper.make_tensor_value_info(n, t, [4]) for n, t in (("y", F32), ("y16", F16), ("z32", F32))]
    proto = make(nodes, [helper.make_tensor_value_info("x", F32, [4])], outputs)
    model = ir.serde.deserialize_model(proto)
    assert _drop_cast_round_trips(model.graph) == 3
    assert sorted(n.name for n in model.graph if n.op_type == "Cast") == ["c4", "c6", "c7"]
    assert model.graph.node("/k/Exp").inputs[0].name == "a" and model.graph.node("/k/Neg").inputs[0].name == "a"
    assert model.graph.node("/k/Sigmoid").inputs[0].name == "x"
    x = np.array([-1.0, 0.1234567, 2.0, 70000.0], dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        y, y16, z32 = ReferenceEvaluator(ir.serde.serialize_model(model)).run(None, {"x": x})
    a = np.maximum(x, 0)
    np.testing.assert_array_equal(y, a * a - a)  # no fp16 rounding (70000 is no inf) on the way
    assert np.isinf(y16[-1])  # the fp16 path is as it was


def test_wide_tables_stay_fp32() -> None:
    table = np.random.default_rng(3).standard_normal((6, 4)).astype(np.float32)
    table[2, 1] = 1e5  # does not fit fp16
    nodes = [
        helper.make_node("Gather", ["table", "position_ids"], ["t"], name="/layers.0.ple/Gather"),
        helper.make_node("Mul", ["x", "t"], ["logits"], name="/layers.0.ple/Mul"),
    ]
    inputs = [
        helper.make_tensor_value_info("x", F32, [2, 3, 4]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, [2, 3]),
    ]
    proto = make(nodes, inputs, [helper.make_tensor_value_info("logits", F32, [2, 3, 4])], [("table", table)])
    pass_ = ConvertFp16(Fp16Policy())
    result = pass_(ir.serde.deserialize_model(proto))
    assert (
        pass_.result is not None
        and pass_.result.fp32_tables == ("/layers.0.ple/Gather",)
        and pass_.result.kept_fp32 == ()
    )
    converted = result.model
    assert converted.graph.initializers["table"].const_value.dtype == ir.DataType.FLOAT
    pos = np.array([[0, 2, 5], [2, 2, 1]], dtype=np.int64)
    x = np.full((2, 3, 4), 0.5, dtype=np.float32)
    with np.errstate(over="ignore"):  # x * 1e5 overflows in the fp16 Mul
        got = ReferenceEvaluator(ir.serde.serialize_model(converted)).run(
            None, {"x": x.astype(np.float16), "position_ids": pos}
        )[0]
    want = x * table[pos]
    fits = np.abs(table[pos]) < FP16_MAX  # the table is not clamped to fp16's range; its rows that fit are exact
    assert not fits.all()
    np.testing.assert_allclose(got[fits], want[fits], rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------- int8: which nodes


def test_int8_targets_default_policy() -> None:
    names = [
        "/lm_head/MatMul",
        "/model.lm_head/MatMul",
        "/layers.0.attn/MatMul",
        "/layers.0.attn/MatMul_1",
        "/model.layers.0.self_attn/MatMul",
        "/transformer.h.0.attn/MatMul",
        "/layers.0.cross_attn/MatMul",
        "/layers.0.attn.q_proj/MatMul",
        "/model.layers.0.self_attn.o_proj/MatMul",
        "/transformer.h.0.attn.c_attn/Gemm",
        "/layers.0.mlp.fc1/MatMul",
        "/layers.0.attention/MatMul",  # not an `attn` module
    ]
    nodes = [named(n, "Gemm" if n.endswith("Gemm") else "MatMul") for n in names]
    nodes += [named("/layers.0.mlp/Add", "Add"), named("", "MatMul")]  # not a MatMul; no name
    graph = ir.Graph([], [], nodes=nodes, name="g")
    quantized = [
        "/layers.0.attn.q_proj/MatMul",
        "/model.layers.0.self_attn.o_proj/MatMul",
        "/transformer.h.0.attn.c_attn/Gemm",
        "/layers.0.mlp.fc1/MatMul",
        "/layers.0.attention/MatMul",
    ]
    assert Int8Policy().keep_float == DEFAULT_INT8_FLOAT
    assert int8_targets(graph, Int8Policy()) == quantized
    assert int8_targets(graph, Int8Policy((*DEFAULT_INT8_FLOAT, "/layers.0.mlp.fc1/", "*.c_attn"))) == [
        quantized[0],
        quantized[1],
        quantized[4],
    ]
    assert int8_targets(graph, Int8Policy(())) == names  # --int8-all-matmuls


# ---------------------------------------------------------------- int8: TensorRT's Q/DQ rules


def qdq_graph(
    *,
    opset: int = 19,
    act_scale: np.ndarray | None = None,
    act_zero: np.ndarray | None = None,
    w_scale: np.ndarray | None = None,
    w_zero: np.ndarray | None = None,
    w_axis: int = 1,
    scale_input: bool = False,
    scale_node: bool = False,
) -> onnx.ModelProto:
    """x [2, 4] -> Q/DQ per tensor; int8 W [4, 3] -> DQ per output channel; MatMul -> y."""
    w_q = np.array([[1, -2, 3], [-4, 5, -6], [7, -8, 9], [-10, 11, -127]], dtype=np.int8)
    inits: list[tuple[str, np.ndarray]] = [
        ("w_q", w_q),
        ("x_zero", np.array(0, dtype=np.int8) if act_zero is None else act_zero),
        ("w_scale", np.array([0.01, 0.02, 0.03], dtype=np.float32) if w_scale is None else w_scale),
        ("w_zero", np.zeros(3, dtype=np.int8) if w_zero is None else w_zero),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"], name="/fc/x/QuantizeLinear"),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"], name="/fc/x/DequantizeLinear"),
        helper.make_node(
            "DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w"], axis=w_axis, name="/fc/w/DequantizeLinear"
        ),
        helper.make_node("MatMul", ["x_dq", "w"], ["y"], name="/fc/MatMul"),
    ]
    inputs = [helper.make_tensor_value_info("x", F32, [2, 4])]
    scale = np.array(0.05, dtype=np.float32) if act_scale is None else act_scale
    if scale_input:
        inputs.append(helper.make_tensor_value_info("x_scale", F32, []))
    elif scale_node:
        nodes.insert(
            0, helper.make_node("Constant", [], ["x_scale"], value=numpy_helper.from_array(scale), name="/fc/Constant")
        )
    else:
        inits.append(("x_scale", scale))
    return make(nodes, inputs, [helper.make_tensor_value_info("y", F32, [2, 3])], inits, opset=opset, infer=False)


@pytest.mark.parametrize("scale_node", [False, True], ids=["initializer", "Constant node"])
def test_check_qdq_accepts_the_valid_form(scale_node: bool) -> None:
    proto = qdq_graph(scale_node=scale_node)
    check_qdq(proto)
    x = np.array([[0.1, -0.2, 0.33, 1.0], [2.0, -6.35, 0.0, 0.07]], dtype=np.float32)
    got = run(proto, {"x": x})[0]
    x_dq = np.clip(np.rint(x / 0.05), -128, 127) * np.float32(0.05)
    w = np.array([[1, -2, 3], [-4, 5, -6], [7, -8, 9], [-10, 11, -127]], dtype=np.float32) * np.array(
        [0.01, 0.02, 0.03], dtype=np.float32
    )
    np.testing.assert_allclose(got, x_dq @ w, rtol=1e-6, atol=1e-6)  # the graph is real and means what it says
    check_qdq(qdq_graph(w_axis=-1))  # axis -1 is the output axis of [K, N] too
    check_qdq(qdq_graph(act_scale=np.array([0.05], dtype=np.float32)))  # a 1-element scale is per tensor


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"opset": 18}, "Q/DQ graph has opset 18; int8 needs 19 or later"),
        ({"scale_input": True}, "/fc/x/QuantizeLinear: the scale is not a constant"),
        (
            {"act_scale": np.array(0.0, dtype=np.float32)},
            "/fc/x/QuantizeLinear: scales must be finite and > 0, found min 0.0",
        ),
        (
            {"w_scale": np.array([0.01, -0.5, 0.03], dtype=np.float32)},
            "/fc/w/DequantizeLinear: scales must be finite and > 0, found min -0.5",
        ),
        (
            {"act_scale": np.array(np.inf, dtype=np.float32)},
            "/fc/x/QuantizeLinear: scales must be finite and > 0, found min inf",
        ),
        (
            {"act_zero": np.array(3, dtype=np.int8)},
            "/fc/x/QuantizeLinear: the zero point must be an int8 constant of zeros",
        ),
        (
            {"act_zero": np.array(0, dtype=np.uint8)},
            "/fc/x/QuantizeLinear: the zero point must be an int8 constant of zeros",
        ),
        (
            {"w_zero": np.array([0, 1, 0], dtype=np.int8)},
            "/fc/w/DequantizeLinear: the zero point must be an int8 constant of zeros",
        ),
        (
            {"act_scale": np.full(4, 0.05, dtype=np.float32)},
            "/fc/x/QuantizeLinear: activations must be quantized per tensor, found a scale of 4",
        ),
        (
            {"w_scale": np.full(4, 0.01, dtype=np.float32), "w_zero": np.zeros(4, dtype=np.int8), "w_axis": 0},
            "/fc/w/DequantizeLinear: a per-channel weight scale must run along the output channels (axis 1 of [K, N])",
        ),
        (
            {"w_axis": 0},
            "/fc/w/DequantizeLinear: a per-channel weight scale must run along the output channels (axis 1 of [K, N])",
        ),
        (
            {"act_scale": np.full((1, 1), 0.05, dtype=np.float32)},
            "/fc/x/QuantizeLinear: scale must be a scalar or 1-D, found shape (1, 1)",
        ),
    ],
    ids=[
        "opset 18",
        "scale not constant",
        "zero scale",
        "negative scale",
        "infinite scale",
        "non-zero zero point",
        "uint8 zero point",
        "non-zero weight zero point",
        "per-channel activation",
        "weight scale along K",
        "weight axis 0",
        "2-D scale",
    ],
)
def test_check_qdq_rules(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ExportError, match=exact(f"export: {message}")):
        check_qdq(qdq_graph(**kwargs))


def _without_zero_points(proto: onnx.ModelProto, output_dtype: int | None = None) -> onnx.ModelProto:
    for node in proto.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            del node.input[2:]
            if node.op_type == "QuantizeLinear" and output_dtype is not None:
                node.attribute.append(helper.make_attribute("output_dtype", output_dtype))
    return proto


def test_check_qdq_missing_zero_point_must_still_be_int8_and_a_3d_weight_is_not_allowed() -> None:
    proto = _without_zero_points(qdq_graph(opset=21), output_dtype=I8)
    check_qdq(proto)  # an absent zero point is zero; output_dtype says int8 (opset 21+)
    x = np.array([[0.1, -0.2, 0.33, 1.0], [2.0, -6.35, 0.0, 0.07]], dtype=np.float32)
    np.testing.assert_allclose(
        run(proto, {"x": x})[0], run(qdq_graph(opset=21), {"x": x})[0], rtol=1e-6
    )  # the numbers of the explicit zero points
    message = (
        "export: /fc/x/QuantizeLinear: a QuantizeLinear without a zero point must set output_dtype to int8 (without "
        "either it writes uint8)"
    )
    with pytest.raises(ExportError, match=exact(message)):
        check_qdq(_without_zero_points(qdq_graph()))  # uint8, by ONNX's default
    with pytest.raises(ExportError, match=exact(message)):
        check_qdq(_without_zero_points(qdq_graph(opset=21), output_dtype=TensorProto.UINT8))
    unsigned = qdq_graph()
    next(t for t in unsigned.graph.initializer if t.name == "w_q").CopyFrom(
        numpy_helper.from_array(np.ones((4, 3), dtype=np.uint8), "w_q")
    )
    del next(n for n in unsigned.graph.node if n.name == "/fc/w/DequantizeLinear").input[2:]
    with pytest.raises(
        ExportError,
        match=exact(
            "export: /fc/w/DequantizeLinear: a DequantizeLinear without a zero point must read int8, found uint8"
        ),
    ):
        check_qdq(unsigned)
    proto = qdq_graph()
    w = next(t for t in proto.graph.initializer if t.name == "w_q")
    w.CopyFrom(
        numpy_helper.from_array(np.ones((4, 3, 1), dtype=np.int8), "w_q")
    )  # axis 1 holds the 3 scales: only its rank is wrong
    with pytest.raises(
        ExportError,
        match=exact(
            "export: /fc/w/DequantizeLinear: a per-channel weight scale must run along the output channels (axis "
            "1 of [K, N])"
        ),
    ):
        check_qdq(proto)


def float_mlp(opset: int = 19) -> onnx.ModelProto:
    rng = np.random.default_rng(6)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="/layers.0.mlp.fc1/MatMul"),
        helper.make_node("Relu", ["h"], ["r"], name="/layers.0.mlp/Relu"),
        helper.make_node("MatMul", ["r", "w2"], ["logits"], name="/lm_head/MatMul"),
    ]
    inits = [
        ("w1", rng.standard_normal((8, 16)).astype(np.float32)),
        ("w2", rng.standard_normal((16, 4)).astype(np.float32)),
    ]
    return make(
        nodes,
        [helper.make_tensor_value_info("x", F32, [3, 8])],
        [helper.make_tensor_value_info("logits", F32, [3, 4])],
        inits,
        opset=opset,
    )


def test_quantize_int8_writes_what_check_qdq_accepts() -> None:
    proto = float_mlp()
    x = np.random.default_rng(7).standard_normal((3, 8)).astype(np.float32)
    want = run(proto, {"x": x})[0]
    h = x @ numpy_helper.to_array(proto.graph.initializer[0])
    ranges = {
        name: (-float(np.abs(v).max()), float(np.abs(v).max()))
        for name, v in (("x", x), ("h", h), ("r", np.maximum(h, 0)), ("logits", want))
    }
    quantized, targets = quantize_int8(ir.serde.deserialize_model(proto), ranges, Int8Policy())
    assert targets == ["/layers.0.mlp.fc1/MatMul"]  # the LM head stays float
    out = ir.serde.serialize_model(quantized)
    check_qdq(out)
    producers = {o: n for n in out.graph.node for o in n.output}
    by_name = {n.name: n for n in out.graph.node}
    assert [producers[i].op_type for i in by_name["/layers.0.mlp.fc1/MatMul"].input] == [
        "DequantizeLinear",
        "DequantizeLinear",
    ]
    weight_dq = producers[by_name["/layers.0.mlp.fc1/MatMul"].input[1]]
    assert (
        len(numpy_helper.to_array(next(t for t in out.graph.initializer if t.name == weight_dq.input[1]))) == 16
    )  # per output channel
    assert list(by_name["/lm_head/MatMul"].input) == ["r", "w2"]  # the LM head stays float
    assert next(t for t in out.graph.initializer if t.name == "w2").data_type == F32
    got = run(out, {"x": x})[0]
    cos = float((got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want))
    assert cos > 0.999 and np.abs(got - want).max() > 0  # quantized, and close


def test_quantize_int8_needs_opset_19() -> None:
    with pytest.raises(ExportError, match=exact(f"export: --int8 needs --opset {MIN_INT8_OPSET} or later, found 18")):
        quantize_int8(ir.serde.deserialize_model(float_mlp(opset=18)), {}, Int8Policy())


# ---------------------------------------------------------------- the fp16 conversion of values


def _onnx_runtime_rule(array: np.ndarray) -> np.ndarray:
    """ONNX Runtime's converter's rule, as its float16.py writes it (the reference)."""
    tiny = 5.96e-08
    out = np.where((array > 0) & (array < tiny), tiny, array)
    out = np.where((out < 0) & (out > -tiny), -tiny, out)
    return np.where(np.isfinite(out), np.clip(out, -FP16_MAX, FP16_MAX), out).astype(np.float16)


@pytest.mark.parametrize("source", ["float32", "bfloat16", "transposed"])
def test_fp16_values_follow_onnx_runtimes_rule_from_any_source(source: str) -> None:
    import torch

    from kiln.exporter.precision.fp16 import _SLICE, _to_fp16

    rng = np.random.default_rng(0)
    values = rng.standard_normal((_SLICE // 64 + 3, 96)).astype(np.float32)  # more rows than one slice
    values[0, :6] = [1e5, -1e5, 1e-9, -1e-9, np.inf, np.nan]
    values[-1, -3:] = [7e4, -2e-12, 0.0]  # in the last slice
    tensor = torch.from_numpy(values)
    if source == "bfloat16":
        tensor = tensor.bfloat16()
        values = tensor.float().numpy()  # the values a bf16 checkpoint holds
    elif source == "transposed":
        tensor, values = tensor.t(), values.T
    got = _to_fp16(tensor)
    assert got.is_contiguous() and got.dtype == torch.float16
    np.testing.assert_array_equal(got.numpy(), _onnx_runtime_rule(values))


def test_fp16_values_of_a_scalar_keep_its_shape() -> None:
    import torch

    from kiln.exporter.precision.fp16 import _to_fp16

    for value, want in [(1e6, FP16_MAX), (-1e-12, -5.96e-08), (0.5, 0.5)]:
        got = _to_fp16(torch.tensor(value))
        assert got.shape == () and got.dtype == torch.float16
        np.testing.assert_array_equal(got.numpy(), np.float16(want))
