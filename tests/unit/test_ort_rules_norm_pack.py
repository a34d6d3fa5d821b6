"""The ORT target's RMSNorm rules (``norm``: -> SimplifiedLayerNormalization, ``skip_norm``: the
residual Add into SkipSimplifiedLayerNormalization) and its hand-written matchers of the same
shape (``pack``: MatMuls of one input, ``decode_mask``: the proven padding bias): each fused on a
graph in the tracer's form and run with ONNX Runtime before and after, and a near miss whose
reason (the manifest's ``not_fused``) is asserted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from kiln.exporter.patterns.norm import fuse_rms_norm
from kiln.exporter.patterns.rules import NotFused
from kiln.exporter.targets.ort.decode_mask import compact_decode_bias
from kiln.exporter.targets.ort.pack import pack_shared_input_matmuls
from kiln.exporter.targets.ort.skip_norm import fuse_skip_rms_norm

B, S, D = 2, 5, 16
F32 = TensorProto.FLOAT


def make(
    nodes: list[onnx.NodeProto], inputs: dict[str, list[int]], outputs: list[str], inits: dict[str, np.ndarray]
) -> ir.Model:
    info = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "g",
        [info(n, F32, s) for n, s in inputs.items()],
        [info(n, F32, None) for n in outputs],
        [numpy_helper.from_array(a, n) for n, a in inits.items()],
    )
    proto = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=10), strict_mode=True
    )
    return ir.serde.deserialize_model(proto)


def run(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        ir.serde.serialize_model(model).SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return list(session.run(None, feeds))


def finish(model: ir.Model) -> list[str]:
    RemoveUnusedNodesPass()(model)
    TopologicalSortPass()(model)
    return [n.op_type for n in model.graph]


def rms(
    x: str, out: str, prefix: str, *, exponent: str = "two", axes: str = "axes-1", residual: str | None = None
) -> list[onnx.NodeProto]:
    """[residual Add ->] x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2), -1) + eps)) * w, as traced."""
    nodes = [helper.make_node("Add", [residual, "skip"], [x], name=f"/{prefix}/Add_residual")] if residual else []
    return nodes + [
        helper.make_node("Pow", [x, exponent], [f"{prefix}.pow"], name=f"/{prefix}/Pow"),
        helper.make_node(
            "ReduceMean", [f"{prefix}.pow", axes], [f"{prefix}.mean"], keepdims=1, name=f"/{prefix}/ReduceMean"
        ),
        helper.make_node("Add", [f"{prefix}.mean", "eps"], [f"{prefix}.add"], name=f"/{prefix}/Add"),
        helper.make_node("Sqrt", [f"{prefix}.add"], [f"{prefix}.sqrt"], name=f"/{prefix}/Sqrt"),
        helper.make_node("Reciprocal", [f"{prefix}.sqrt"], [f"{prefix}.recip"], name=f"/{prefix}/Reciprocal"),
        helper.make_node("Mul", [x, f"{prefix}.recip"], [f"{prefix}.normalized"], name=f"/{prefix}/Mul"),
        helper.make_node("Mul", [f"{prefix}.normalized", "w"], [out], name=f"/{prefix}/Mul_1"),
    ]


def norm_model(
    *, exponent: str = "two", axes: str = "axes-1", skip_shape: list[int] | None = None
) -> tuple[ir.Model, dict[str, np.ndarray]]:
    """h = a + skip; y = RMSNorm(h) * w; the residual stream reads h too."""
    nodes = rms("h", "n", "layers.0.norm", exponent=exponent, axes=axes, residual="a")
    nodes.append(helper.make_node("Add", ["h", "n"], ["z"], name="/layers.0/Add_1"))
    inits = {
        "two": np.array(2.0, np.float32),
        "three": np.array(3.0, np.float32),
        "eps": np.array(1e-6, np.float32),
        "axes-1": np.array([-1], np.int64),
        "axes1": np.array([1], np.int64),
    }
    inits["w"] = np.linspace(0.5, 1.5, D, dtype=np.float32)
    rng = np.random.default_rng(0)
    feeds = {
        "a": rng.standard_normal((B, S, D)).astype(np.float32),
        "skip": rng.standard_normal(skip_shape or [B, S, D]).astype(np.float32),
    }
    return make(nodes, {"a": [B, S, D], "skip": skip_shape or [B, S, D]}, ["z"], inits), feeds


def test_rms_norm_and_skip_rules_fuse_and_compute_the_same() -> None:
    model, feeds = norm_model()
    before = run(model, feeds)
    log = NotFused()
    assert fuse_rms_norm(model, not_fused=log) == 1 and fuse_skip_rms_norm(model, not_fused=log) == 1
    assert finish(model) == ["SkipSimplifiedLayerNormalization", "Add"] and log.record() is None
    np.testing.assert_allclose(run(model, feeds)[0], before[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"exponent": "three"}, "the power is not a constant 2"),
        ({"axes": "axes1"}, "the mean is not over the last axis, kept"),
    ],
    ids=["Pow 3", "mean over axis 1"],
)
def test_rms_norm_near_miss_says_why(change: dict[str, str], reason: str) -> None:
    model, feeds = norm_model(**change)
    before = run(model, feeds)
    log = NotFused()
    assert fuse_rms_norm(model, not_fused=log) == 0
    assert log.record() == {"rms_norm": (f"/layers.0.norm/ReduceMean: {reason}",)}
    np.testing.assert_allclose(run(model, feeds)[0], before[0], rtol=0, atol=0)


def test_skip_rule_near_miss_says_why() -> None:
    """The residual Add broadcasts a [D] vector: the norm fuses, the Add stays."""
    model, feeds = norm_model(skip_shape=[D])
    before = run(model, feeds)
    log = NotFused()
    assert fuse_rms_norm(model, not_fused=log) == 1 and fuse_skip_rms_norm(model, not_fused=log) == 0
    assert log.record() == {
        "skip_rms_norm": (
            "/layers.0.norm/SimplifiedLayerNormalization: the residual Add does not add two tensors of one [B, "
            "S, D] shape ([2,5,16] + [16])",
        )
    }
    assert finish(model) == ["Add", "SimplifiedLayerNormalization", "Add"]
    np.testing.assert_allclose(run(model, feeds)[0], before[0], rtol=1e-5, atol=1e-5)


def test_pack_says_why_a_group_is_not_packed() -> None:
    """The gate and up MatMuls of x pack; the pair of u does not: one of its outputs is a graph output."""
    rng = np.random.default_rng(3)
    inits = {f"w{i}": rng.standard_normal((8, 4)).astype(np.float32) for i in range(4)}
    names = [
        "/layers.0.mlp.gate/MatMul",
        "/layers.0.mlp.up/MatMul",
        "/layers.1.mlp.gate/MatMul",
        "/layers.1.mlp.up/MatMul",
    ]
    nodes = [
        helper.make_node("MatMul", ["x" if i < 2 else "u", f"w{i}"], [f"o{i}"], name=name)
        for i, name in enumerate(names)
    ]
    nodes.append(helper.make_node("Concat", ["o0", "o1", "o2"], ["y"], axis=-1, name="/Concat"))
    model = make(nodes, {"x": [B, S, 8], "u": [B, S, 8]}, ["y", "o3"], inits)
    feeds = {
        "x": rng.standard_normal((B, S, 8)).astype(np.float32),
        "u": rng.standard_normal((B, S, 8)).astype(np.float32),
    }
    before = run(model, feeds)
    log = NotFused()
    assert pack_shared_input_matmuls(model, not_fused=log) == ["/layers.0.mlp/ort/packed/MatMul"]
    assert log.record() == {"pack": ("/layers.1.mlp.gate/MatMul: a MatMul's output is a graph output",)}
    finish(model)
    for got, want in zip(run(model, feeds), before, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _decode_bias_graph(rank: int) -> ir.Model:
    """A decode GQA whose bias is the padding mask, [B, 1, 1, T] (``rank`` 3: [B, 1, T], no bias
    GQA can take)."""
    h = helper
    nodes = [
        h.make_node("Cast", ["attention_mask"], ["keep"], to=TensorProto.BOOL),
        h.make_node("Where", ["keep", "zero", "fill"], ["pad"]),
    ]
    nodes.append(h.make_node("Unsqueeze", ["pad", "axes"], ["bias"]))
    gqa = ["q", "", "", "", "", "", "", "", "", "", "bias"]
    nodes.append(
        h.make_node(
            "GroupQueryAttention",
            gqa,
            ["out", "pk", "pv"],
            domain="com.microsoft",
            num_heads=1,
            kv_num_heads=1,
            name="/layers.3.attn/ort/GroupQueryAttention",
        )
    )
    axes = [1, 2] if rank == 4 else [1]
    inits = [
        h.make_tensor("zero", F32, [], [0.0]),
        h.make_tensor("fill", F32, [], [-3.0e38]),
        h.make_tensor("axes", TensorProto.INT64, [len(axes)], axes),
    ]
    inputs = [
        h.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total_seq"]),
        h.make_tensor_value_info("q", F32, ["batch", 1, 16]),
    ]
    graph = h.make_graph(nodes, "decode", inputs, [h.make_tensor_value_info("out", F32, None)], inits)
    return ir.from_proto(
        h.make_model(graph, opset_imports=[h.make_opsetid("", 19), h.make_opsetid("com.microsoft", 1)])
    )


def test_decode_mask_says_why_a_bias_is_not_proven(tmp_path: Path) -> None:
    assert compact_decode_bias(_decode_bias_graph(4), tmp_path, 32).compact
    got = compact_decode_bias(_decode_bias_graph(3), tmp_path, 32)
    assert not got.compact and got.not_fused == (
        "layer 3: its bias is not a float32 [B, 1, 1, T] (found float32 [2, 1, 1])",
    )
