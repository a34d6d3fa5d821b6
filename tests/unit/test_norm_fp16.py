"""``targets.onnx.norm_fp16``: the fp16 pass's RMSNorm island (fp32 statistics, fp16 scale)
becomes one ``RMSNormalization`` (stash_type 1) over fp32 input and scale, cast back to fp16; ONNX
Runtime runs both, before and after, within fp16 rounding of the exact norm, even where fp16
squares would overflow."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from kiln.exporter.patterns.norm import fuse_rms_norm
from kiln.exporter.precision.fp16 import convert_to_fp16
from kiln.exporter.precision.policy import Fp16Policy
from kiln.exporter.targets.onnx.norm_fp16 import fuse_fp16_rms_norm

B, S, D, EPS = 2, 3, 64, 1e-6
WEIGHT = (1 + 0.1 * np.random.default_rng(1).standard_normal(D)).astype(np.float32)


def norm_graph(*, weighted: bool, swap: bool = False) -> ir.Model:
    """x -> RMSNorm (module layers.0.norm, as the tracer writes it) [* weight | * s] -> Relu -> y, at
    opset 24, in fp32: ``fp16`` converts it."""
    n = "/layers.0.norm/"
    normalized = "nx" if weighted else "h0"
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["p"], name=f"{n}Pow"),
        helper.make_node("ReduceMean", ["p", "axes"], ["m"], keepdims=1, name=f"{n}ReduceMean"),
        helper.make_node("Add", ["m", "eps"], ["a"], name=f"{n}Add"),
        helper.make_node("Sqrt", ["a"], ["q"], name=f"{n}Sqrt"),
        helper.make_node("Reciprocal", ["q"], ["r"], name=f"{n}Reciprocal"),
        helper.make_node("Mul", ["r", "x"] if swap else ["x", "r"], [normalized], name=f"{n}Mul"),
        helper.make_node("Mul", [normalized, "w"] if weighted else [normalized, "s"], ["h"], name=f"{n}Mul_1"),
        helper.make_node("Relu", ["h"], ["y"], name="/head/Relu"),
    ]
    inits = [
        ("two", np.array(2.0, np.float32)),
        ("axes", np.array([-1], np.int64)),
        ("eps", np.array(EPS, np.float32)),
        ("w", WEIGHT),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, D])] + (
        [] if weighted else [helper.make_tensor_value_info("s", TensorProto.FLOAT, [B, S, D])]
    )
    graph = helper.make_graph(
        nodes,
        "g",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, S, D])],
        [numpy_helper.from_array(a, k) for k, a in inits if weighted or k != "w"],
    )
    proto = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=11), strict_mode=True
    )
    return ir.serde.deserialize_model(proto)


def run(model: ir.Model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    proto = ir.serde.serialize_model(model)
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]


def _cast_of(value: ir.Value | None, to: ir.DataType) -> ir.Value | None:
    """What a Cast to ``to`` casts, where ``value`` is one."""
    node = value.producer() if value is not None else None
    assert node is not None and node.op_type == "Cast" and node.attributes.get_int("to") == to
    return node.inputs[0]


def _the_norm(model: ir.Model) -> ir.Node:
    """The one RMSNormalization, read from its fp16 Cast down; no island node left."""
    assert not {n.op_type for n in model.graph} & {"ReduceMean", "Pow", "Sqrt", "Reciprocal"}
    (norm,) = (n for n in model.graph if n.op_type == "RMSNormalization")
    (use,) = norm.outputs[0].uses()
    assert use.node.op_type == "Cast" and use.node.attributes.get_int("to") == ir.DataType.FLOAT16
    return norm


def exact(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return np.maximum(x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + EPS) * scale, 0)


@pytest.mark.parametrize("swap", [False, True], ids=["x*r", "r*x"])
@pytest.mark.parametrize("magnitude", [1.0, 300.0], ids=["unit", "fp16-squares-overflow"])
def test_fp16_island_becomes_rms_normalization(swap: bool, magnitude: float) -> None:
    model, _ = convert_to_fp16(norm_graph(weighted=True, swap=swap), Fp16Policy())
    x = (magnitude * np.random.default_rng(2).standard_normal((B, S, D))).astype(np.float16)
    island = run(model, {"x": x})
    assert [n.op_type for n in model.graph].count("Cast") == 2  # the island's borders: x up, 1/rms down
    assert fuse_rms_norm(model, op_type="RMSNormalization") == 0  # the fp32 rule does not see it
    assert fuse_fp16_rms_norm(model) == 1
    RemoveUnusedNodesPass()(model)
    TopologicalSortPass()(model)
    norm = _the_norm(model)
    assert norm.name == "/layers.0.norm/RMSNormalization"
    x_up, w_up = (_cast_of(v, ir.DataType.FLOAT) for v in norm.inputs)
    assert (
        x_up is model.graph.inputs[0] and w_up is model.graph.initializers["w"] and w_up.dtype == ir.DataType.FLOAT16
    )  # the weight stays fp16 in the file
    assert (
        norm.attributes.get_int("stash_type"),
        norm.attributes.get_int("axis"),
        norm.attributes.get_float("epsilon"),
    ) == (1, -1, pytest.approx(EPS))
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    fused = run(model, {"x": x})
    want = exact(x, WEIGHT.astype(np.float16).astype(np.float64))
    assert np.isfinite(fused).all() and fused.dtype == np.float16
    for got in (island, fused):  # both within fp16 rounding (a few ulps at the row's scale) of the exact norm
        np.testing.assert_allclose(got.astype(np.float64), want, atol=4e-3 * np.abs(want).max(), rtol=0)
    assert np.abs(fused - want).max() <= np.abs(island - want).max()  # one rounding to fp16 instead of three


def test_fp16_island_without_weight_gets_fp16_ones_and_keeps_its_mul() -> None:
    model, _ = convert_to_fp16(norm_graph(weighted=False), Fp16Policy())
    rng = np.random.default_rng(3)
    feeds = {
        "x": rng.standard_normal((B, S, D)).astype(np.float16),
        "s": rng.standard_normal((B, S, D)).astype(np.float16),
    }
    island = run(model, feeds)
    assert fuse_fp16_rms_norm(model) == 1
    RemoveUnusedNodesPass()(model)
    TopologicalSortPass()(model)
    norm = _the_norm(model)
    assert _cast_of(norm.inputs[0], ir.DataType.FLOAT) is model.graph.inputs[0]
    ones = norm.inputs[1]
    assert ones is not None and ones.name == f"ort/ones_{D}" and ones.const_value is not None
    np.testing.assert_array_equal(ones.const_value.numpy(), np.ones(D, np.float32))
    assert sorted(n.op_type for n in model.graph) == [
        "Cast",
        "Cast",
        "Mul",
        "RMSNormalization",
        "Relu",
    ]  # the table's Mul kept
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    np.testing.assert_allclose(run(model, feeds).astype(np.float32), island.astype(np.float32), atol=8e-3, rtol=4e-3)


def test_an_fp32_norm_is_not_an_fp16_island() -> None:
    model = norm_graph(weighted=True)
    assert fuse_fp16_rms_norm(model) == 0
    assert fuse_rms_norm(model, op_type="RMSNormalization") == 1  # the fp32 rule's
