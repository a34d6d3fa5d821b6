"""The ``--target ort`` rewrites on small hand-built graphs, each run with ONNX Runtime before
and after: RMSNorm fusion (``norm``), packing MatMuls that share an input (``pack``),
weight-only int8 ``MatMulNBits`` (``nbits``) and the int4 graphs' DQ + MatMul as MatMulNBits
bits=4 (``int4``: ``unfold_int4_weights``, then ``int4_matmul_nbits``)."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from kiln.errors import ExportError
from kiln.exporter.int4.numbers import pack_int4, rtn
from kiln.exporter.passes import GraphRewrite, run_passes
from kiln.exporter.patterns.norm import fuse_rms_norm
from kiln.exporter.targets.ort.int4 import ACCURACY_LEVEL as INT4_ACCURACY_LEVEL
from kiln.exporter.targets.ort.int4 import BlockInt4, int4_matmul_nbits, unfold_int4_weights
from kiln.exporter.targets.ort.nbits import ACCURACY_LEVEL, BLOCK_SIZE, pack_int8_blocks, quantize_matmul_nbits
from kiln.exporter.targets.ort.pack import pack_shared_input_matmuls
from kiln.exporter.targets.ort.skip_norm import fuse_skip_rms_norm

F32 = TensorProto.FLOAT
B, S, D = 2, 5, 16
EPS = 1e-6


def make(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    inits: list[tuple[str, np.ndarray]],
    opset: int = 19,
) -> ir.Model:
    """An onnx-ir model from helper-made parts, every value typed by ONNX's shape inference."""
    tensors = [numpy_helper.from_array(array, name) for name, array in inits]
    graph = helper.make_graph(nodes, "g", inputs, outputs, tensors)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    proto = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    return ir.serde.deserialize_model(proto)


def run(model: ir.Model, feeds: dict[str, np.ndarray], *, optimize: bool = True) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    if not optimize:  # the graph as written (ONNX Runtime's own fusions off)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    proto = ir.serde.serialize_model(model)
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def finish(model: ir.Model) -> ir.Model:
    """What ``ort_passes`` runs after a rewrite: dead nodes out, graph sorted."""
    RemoveUnusedNodesPass()(model)
    TopologicalSortPass()(model)
    return model


def ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def info(name: str, shape: list[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, F32, shape)


def assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], atol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype, name
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=atol, err_msg=name)


# ---------------------------------------------------------------- RMSNorm


def rms_nodes(
    x: str,
    out: str,
    prefix: str,
    *,
    weight: str | None,
    swap: bool = False,
    axis: int = -1,
    exponent: str = "two",
    keepdims: int = 1,
) -> list[onnx.NodeProto]:
    """RMSNorm as the tracer writes it: x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2), -1) + eps)) [* w]."""
    normalized = f"{prefix}.normalized" if weight else out
    mul_in = [f"{prefix}.recip", x] if swap else [x, f"{prefix}.recip"]
    nodes = [
        helper.make_node("Pow", [x, exponent], [f"{prefix}.pow"], name=f"/{prefix}/Pow"),
        helper.make_node(
            "ReduceMean",
            [f"{prefix}.pow", f"axes{axis}"],
            [f"{prefix}.mean"],
            keepdims=keepdims,
            name=f"/{prefix}/ReduceMean",
        ),
        helper.make_node("Add", [f"{prefix}.mean", "eps"], [f"{prefix}.add"], name=f"/{prefix}/Add"),
        helper.make_node("Sqrt", [f"{prefix}.add"], [f"{prefix}.sqrt"], name=f"/{prefix}/Sqrt"),
        helper.make_node("Reciprocal", [f"{prefix}.sqrt"], [f"{prefix}.recip"], name=f"/{prefix}/Reciprocal"),
        helper.make_node("Mul", mul_in, [normalized], name=f"/{prefix}/Mul"),
    ]
    if weight:
        nodes.append(helper.make_node("Mul", [normalized, weight], [out], name=f"/{prefix}/Mul_1"))
    return nodes


def norm_constants(weights: int = 1) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    consts: list[tuple[str, np.ndarray]] = [
        ("two", np.array(2.0, dtype=np.float32)),
        ("eps", np.array(EPS, dtype=np.float32)),
        ("axes-1", np.array([-1], dtype=np.int64)),
        ("axes2", np.array([2], dtype=np.int64)),
        ("axes1", np.array([1], dtype=np.int64)),
        ("three", np.array(3.0, dtype=np.float32)),
    ]
    consts += [(f"w{i}", (1.0 + 0.5 * rng.standard_normal(D)).astype(np.float32)) for i in range(weights)]
    return consts


def norm_feeds(*names: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {n: (3.0 * rng.standard_normal((B, S, D))).astype(np.float32) for n in names}


def rms_reference(x: np.ndarray, w: np.ndarray | None) -> np.ndarray:
    y = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + EPS)
    return (y * (w if w is not None else 1.0)).astype(np.float32)


@pytest.mark.parametrize("swap", [False, True], ids=["x*r", "r*x"])
@pytest.mark.parametrize("axis", [-1, 2], ids=["axis-1", "axis2"])
def test_fuse_rms_norm_with_weight(swap: bool, axis: int) -> None:
    nodes = rms_nodes("x", "h", "layers.0.norm", weight="w0", swap=swap, axis=axis)
    nodes.append(helper.make_node("Relu", ["h"], ["y"], name="/head/Relu"))
    model = make(nodes, [info("x", [B, S, D])], [info("y", [B, S, D])], norm_constants())
    feeds = norm_feeds("x")
    before = run(model, feeds, optimize=False)
    w = model.graph.initializers["w0"].const_value.numpy()
    np.testing.assert_allclose(before["y"], np.maximum(rms_reference(feeds["x"], w), 0), rtol=1e-5, atol=1e-5)
    assert fuse_rms_norm(model) == 1
    finish(model)
    assert ops(model) == ["SimplifiedLayerNormalization", "Relu"]
    fused = next(iter(model.graph))
    assert fused.name == "/layers.0.norm/SimplifiedLayerNormalization" and fused.domain == ""
    assert fused.inputs[1] is model.graph.initializers["w0"]
    assert fused.attributes.get_float("epsilon") == pytest.approx(EPS) and fused.attributes.get_int("axis") == -1
    assert fused.attributes.get_int("stash_type") == 1
    assert_close(run(model, feeds, optimize=False), before)


def test_fuse_rms_norm_reads_eps_from_a_constant_node_and_axes_attribute() -> None:
    """Opset 17: ReduceMean's axes is an attribute; eps comes from a Constant node."""
    nodes = [
        helper.make_node("Constant", [], ["eps"], value=numpy_helper.from_array(np.array(1e-5, dtype=np.float32))),
        helper.make_node("Pow", ["x", "two"], ["p"], name="/n/Pow"),
        helper.make_node("ReduceMean", ["p"], ["m"], axes=[-1], keepdims=1, name="/n/ReduceMean"),
        helper.make_node("Add", ["eps", "m"], ["a"], name="/n/Add"),  # eps first
        helper.make_node("Sqrt", ["a"], ["s"], name="/n/Sqrt"),
        helper.make_node("Reciprocal", ["s"], ["r"], name="/n/Reciprocal"),
        helper.make_node("Mul", ["x", "r"], ["nx"], name="/n/Mul"),
        helper.make_node("Mul", ["w", "nx"], ["h"], name="/n/Mul_1"),  # weight first
        helper.make_node("Relu", ["h"], ["y"], name="/Relu"),
    ]
    w = np.linspace(0.5, 1.5, D, dtype=np.float32)
    model = make(
        nodes,
        [info("x", [B, S, D])],
        [info("y", [B, S, D])],
        [("two", np.array(2.0, dtype=np.float32)), ("w", w)],
        opset=17,
    )
    feeds = norm_feeds("x")
    before = run(model, feeds, optimize=False)
    assert fuse_rms_norm(model) == 1
    finish(model)
    assert ops(model) == ["SimplifiedLayerNormalization", "Relu"]
    assert next(iter(model.graph)).attributes.get_float("epsilon") == pytest.approx(1e-5)
    assert_close(run(model, feeds, optimize=False), before)


def test_fuse_rms_norm_without_a_constant_weight() -> None:
    """A norm scaled by a per-position table (2-D, not a weight) gets a ones weight and keeps its Mul."""
    nodes = rms_nodes("x", "nx", "ple", weight=None)
    nodes.append(helper.make_node("Mul", ["nx", "table"], ["y"], name="/ple/Mul_1"))
    table = np.random.default_rng(3).standard_normal((S, D)).astype(np.float32)
    model = make(nodes, [info("x", [B, S, D])], [info("y", [B, S, D])], [*norm_constants(0), ("table", table)])
    feeds = norm_feeds("x")
    before = run(model, feeds, optimize=False)
    assert fuse_rms_norm(model) == 1
    finish(model)
    assert ops(model) == ["SimplifiedLayerNormalization", "Mul"]
    ones = model.graph.initializers["ort/ones_16"].const_value.numpy()
    np.testing.assert_array_equal(ones, np.ones(D, dtype=np.float32))
    assert_close(run(model, feeds, optimize=False), before)


def test_two_norms_share_the_ones_weight() -> None:
    nodes = rms_nodes("x", "n1", "a", weight=None) + rms_nodes("n1", "n2", "b", weight=None)
    nodes.append(helper.make_node("Neg", ["n2"], ["y"], name="/Neg"))
    model = make(nodes, [info("x", [B, S, D])], [info("y", [B, S, D])], norm_constants(0))
    feeds = norm_feeds("x")
    before = run(model, feeds, optimize=False)
    assert fuse_rms_norm(model) == 2
    finish(model)
    assert ops(model) == ["SimplifiedLayerNormalization", "SimplifiedLayerNormalization", "Neg"]
    assert [n.inputs[1].name for n in model.graph if n.op_type != "Neg"] == ["ort/ones_16", "ort/ones_16"]
    assert_close(run(model, feeds, optimize=False), before)


@pytest.mark.parametrize(
    "change",
    ["axis 1", "Pow 3", "keepdims 0", "Pow of another tensor", "eps not constant"],
)
def test_not_an_rms_norm(change: str) -> None:
    """Near misses stay as they are (and compute what they computed)."""
    kwargs = {"axis 1": {"axis": 1}, "Pow 3": {"exponent": "three"}, "keepdims 0": {"keepdims": 0}}.get(change, {})
    nodes = rms_nodes("x", "y", "n", weight="w0", **kwargs)
    inputs = [info("x", [B, S, D])]
    if change == "Pow of another tensor":
        nodes[0] = helper.make_node("Pow", ["z", "two"], ["n.pow"], name="/n/Pow")
        inputs.append(info("z", [B, S, D]))
    if change == "eps not constant":
        nodes[2] = helper.make_node("Add", ["n.mean", "e"], ["n.add"], name="/n/Add")
        inputs.append(info("e", [1]))
    if change == "keepdims 0":  # [B, S] statistics: broadcast back by an Unsqueeze to stay valid
        nodes[2] = helper.make_node("Add", ["n.mean", "eps"], ["n.add0"], name="/n/Add")
        nodes.insert(3, helper.make_node("Unsqueeze", ["n.add0", "axes-1"], ["n.add"], name="/n/Unsqueeze"))
    model = make(nodes, inputs, [info("y", [B, S, D])], norm_constants())
    feeds = norm_feeds(*(i.name for i in inputs))
    if change == "eps not constant":
        feeds["e"] = np.array([EPS], dtype=np.float32)
    before = run(model, feeds, optimize=False)
    count = len(ops(model))
    assert fuse_rms_norm(model) == 0
    finish(model)
    assert len(ops(model)) == count and "SimplifiedLayerNormalization" not in ops(model)
    assert_close(run(model, feeds, optimize=False), before, atol=0)


def residual_graph(shape_b: list[int | str] | None = None, dims: list[int | str] | None = None) -> ir.Model:
    """h = a + b; n = RMSNorm(h) * w; z = h + tanh(n): the residual stream reads the Add too."""
    dims = dims or [B, S, D]
    nodes = [helper.make_node("Add", ["a", "b"], ["h"], name="/layers.0/Add")]
    nodes += rms_nodes("h", "n", "layers.0.norm", weight="w0")
    nodes.append(helper.make_node("Tanh", ["n"], ["t"], name="/layers.0.mlp/Tanh"))
    nodes.append(helper.make_node("Add", ["h", "t"], ["z"], name="/layers.0/Add_1"))
    inputs = [info("a", dims), info("b", shape_b or dims)]
    return make(nodes, inputs, [info("t", dims), info("z", dims)], norm_constants())


@pytest.mark.parametrize("dims", [[B, S, D], ["batch", "seq", D]], ids=["static", "named dims"])
def test_fuse_skip_rms_norm(dims: list[int | str]) -> None:
    model = residual_graph(dims=dims)
    feeds = norm_feeds("a", "b")
    before = run(model, feeds, optimize=False)
    want = np.tanh(rms_reference(feeds["a"] + feeds["b"], norm_constants()[-1][1]))
    np.testing.assert_allclose(before["t"], want, rtol=1e-5, atol=1e-5)
    passes = [
        GraphRewrite(fuse_rms_norm),
        GraphRewrite(fuse_skip_rms_norm),
        RemoveUnusedNodesPass(),
        TopologicalSortPass(),
    ]
    run_passes(model, passes, graph="decode")
    assert passes[0].result == 1 and passes[1].result == 1
    assert ops(model) == ["SkipSimplifiedLayerNormalization", "Tanh", "Add"]
    skip = next(iter(model.graph))
    assert skip.domain == "com.microsoft" and skip.name == "/layers.0.norm/SkipSimplifiedLayerNormalization"
    assert [v.name for v in skip.inputs] == ["a", "b", "w0"]
    assert skip.attributes.get_float("epsilon") == pytest.approx(EPS)
    assert model.opset_imports["com.microsoft"] == 1 and model.graph.opset_imports["com.microsoft"] == 1
    assert [v.name for v in model.graph.outputs] == ["t", "z"]
    assert_close(run(model, feeds, optimize=False), before)


def test_no_skip_fusion_when_the_add_broadcasts() -> None:
    model = residual_graph(shape_b=[D])
    feeds = {**norm_feeds("a"), "b": np.linspace(-1, 1, D, dtype=np.float32)}
    before = run(model, feeds, optimize=False)
    assert fuse_rms_norm(model) == 1
    assert fuse_skip_rms_norm(model) == 0
    finish(model)
    assert ops(model) == ["Add", "SimplifiedLayerNormalization", "Tanh", "Add"]
    assert "com.microsoft" not in model.opset_imports
    assert_close(run(model, feeds, optimize=False), before)


def test_a_norm_that_is_a_graph_output_keeps_its_name() -> None:
    nodes = rms_nodes("x", "y", "final_norm", weight="w0")
    model = make(nodes, [info("x", [B, S, D])], [info("y", [B, S, D])], norm_constants())
    feeds = norm_feeds("x")
    before = run(model, feeds, optimize=False)
    assert fuse_rms_norm(model) == 1
    finish(model)
    assert [v.name for v in model.graph.outputs] == ["y"]
    assert_close(run(model, feeds, optimize=False), before)


# ---------------------------------------------------------------- packing MatMuls


def projection_graph(*, output_one: bool = False, nameless: bool = False) -> tuple[ir.Model, dict[str, np.ndarray]]:
    """q/k/v projections of x, and gate/up projections of another activation m."""
    rng = np.random.default_rng(5)
    k = 8
    weights = {
        n: rng.standard_normal((k, width)).astype(np.float32)
        for n, width in (("wq", 8), ("wk", 4), ("wv", 4), ("wg", 6), ("wu", 6))
    }
    names = {
        "wq": "/layers.0.attn.q_proj/MatMul",
        "wk": "/layers.0.attn.k_proj/MatMul",
        "wv": "/layers.0.attn.v_proj/MatMul",
        "wg": "/layers.0.mlp.gate_proj/MatMul",
        "wu": "/layers.0.mlp.up_proj/MatMul",
    }
    nodes = [helper.make_node("Neg", ["x"], ["m"], name="/layers.0/Neg")]
    for w, reads in (("wq", "x"), ("wk", "x"), ("wv", "x"), ("wg", "m"), ("wu", "m")):
        nodes.append(helper.make_node("MatMul", [reads, w], [f"{w}.out"], name="" if nameless else names[w]))
    nodes += [
        helper.make_node("Concat", ["wq.out", "wk.out", "wv.out"], ["qkv"], axis=-1, name="/c1"),
        helper.make_node("Mul", ["wg.out", "wu.out"], ["mlp"], name="/mul"),
    ]
    outputs = [info("qkv", [B, S, 16]), info("mlp", [B, S, 6])]
    if output_one:
        outputs.append(info("wk.out", [B, S, 4]))
    model = make(nodes, [info("x", [B, S, k])], outputs, list(weights.items()))
    return model, weights


def _pack_feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(2).standard_normal((B, S, 8)).astype(np.float32)}


def test_pack_shared_input_matmuls() -> None:
    model, weights = projection_graph()
    feeds = _pack_feeds()
    before = run(model, feeds, optimize=False)
    written = pack_shared_input_matmuls(model)
    assert written == ["/layers.0.attn/ort/packed/MatMul", "/layers.0.mlp/ort/packed/MatMul"]
    finish(model)
    assert [n.name for n in model.graph] == [
        "/layers.0/Neg",
        "/layers.0.attn/ort/packed/MatMul",
        "/layers.0.attn/ort/packed/Split",
        "/layers.0.mlp/ort/packed/MatMul",
        "/layers.0.mlp/ort/packed/Split",
        "/c1",
        "/mul",
    ]
    inits = model.graph.initializers
    assert sorted(inits) == [
        "ort/layers.0.attn.packed.split",
        "ort/layers.0.attn.packed.weight",
        "ort/layers.0.mlp.packed.split",
        "ort/layers.0.mlp.packed.weight",
    ]
    np.testing.assert_array_equal(
        inits["ort/layers.0.attn.packed.weight"].const_value.numpy(),
        np.concatenate([weights["wq"], weights["wk"], weights["wv"]], axis=1),
    )
    np.testing.assert_array_equal(inits["ort/layers.0.attn.packed.split"].const_value.numpy(), [8, 4, 4])
    np.testing.assert_array_equal(inits["ort/layers.0.mlp.packed.split"].const_value.numpy(), [6, 6])
    split = model.graph.node("/layers.0.attn/ort/packed/Split")
    assert [list(o.shape) for o in split.outputs] == [[B, S, 8], [B, S, 4], [B, S, 4]]
    assert_close(run(model, feeds, optimize=False), before)


def test_pack_groups_without_module_names_get_distinct_prefixes() -> None:
    model, weights = projection_graph(nameless=True)
    feeds = _pack_feeds()
    before = run(model, feeds, optimize=False)
    assert pack_shared_input_matmuls(model) == ["/graph/ort/packed/MatMul", "/graph.1/ort/packed/MatMul"]
    finish(model)
    inits = model.graph.initializers
    np.testing.assert_array_equal(
        inits["ort/graph.packed.weight"].const_value.numpy(),
        np.concatenate([weights["wq"], weights["wk"], weights["wv"]], axis=1),
    )
    np.testing.assert_array_equal(
        inits["ort/graph.1.packed.weight"].const_value.numpy(), np.concatenate([weights["wg"], weights["wu"]], axis=1)
    )
    assert_close(run(model, feeds, optimize=False), before)


def test_no_packing_when_a_matmul_is_a_graph_output() -> None:
    model, _ = projection_graph(output_one=True)
    feeds = _pack_feeds()
    before = run(model, feeds, optimize=False)
    assert pack_shared_input_matmuls(model) == ["/layers.0.mlp/ort/packed/MatMul"]  # q/k/v stay: k is an output
    finish(model)
    assert ops(model).count("MatMul") == 4
    assert_close(run(model, feeds, optimize=False), before)


def test_no_packing_of_a_lone_or_non_constant_matmul() -> None:
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"], name="/p/MatMul"),  # float16 weights: not packed
        helper.make_node("MatMul", ["x", "v"], ["b"], name="/p/MatMul_1"),  # v is an input, not a weight
        helper.make_node("MatMul", ["x", "h"], ["c"], name="/p/MatMul_2"),
        helper.make_node("Add", ["a", "b"], ["ab"], name="/p/Add"),
        helper.make_node("Add", ["ab", "c"], ["y"], name="/p/Add_1"),
    ]
    model = make(
        nodes,
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 4]),
            helper.make_tensor_value_info("v", TensorProto.FLOAT16, [4, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 3])],
        [("w", rng.standard_normal((4, 3)).astype(np.float16)), ("h", rng.standard_normal((4, 3)).astype(np.float16))],
    )
    assert pack_shared_input_matmuls(model) == []
    assert ops(model).count("MatMul") == 3


# ---------------------------------------------------------------- MatMulNBits


def dequantize(q: np.ndarray, scales: np.ndarray, k: int) -> np.ndarray:
    """MatMulNBits' int8 weight back to float [K, N]: (q - 128) * scale per block of column n."""
    n, blocks, block = q.shape
    w = (q.astype(np.float32) - 128.0) * scales.reshape(n, blocks, 1)
    return w.reshape(n, blocks * block)[:, :k].T


def nbits_graph(k: int, n: int, *, gemm: bool = False, seed: int = 4) -> tuple[ir.Model, np.ndarray, np.ndarray | None]:
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((k, n)).astype(np.float32)
    weight[:, 0] = 0.0  # an all-zero column: its scales are 1, not 0
    bias = None
    if gemm:
        bias = rng.standard_normal(n).astype(np.float32)
        nodes = [helper.make_node("Gemm", ["x", "weights/fc.weight", "fc.bias"], ["logits"], transB=1, name="/fc/Gemm")]
        inits = [("weights/fc.weight", np.ascontiguousarray(weight.T)), ("fc.bias", bias)]
        x_shape: list[int | str] = [3, k]
        out_shape: list[int | str] = [3, n]
    else:
        nodes = [
            helper.make_node("MatMul", ["x", "weights/fc.weight"], ["logits"], name="/fc/MatMul"),
            helper.make_node("MatMul", ["x", "xt"], ["gram"], name="/attn/MatMul"),  # no constant weight: stays
        ]
        inits = [("weights/fc.weight", weight)]
        x_shape, out_shape = [B, S, k], [B, S, n]
    inputs = [info("x", x_shape)]
    outputs = [info("logits", out_shape)]
    if not gemm:
        inputs.append(info("xt", [B, k, S]))
        outputs.append(info("gram", [B, S, S]))
    return make(nodes, inputs, outputs, inits), weight, bias


def nbits_feeds(k: int, gemm: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(8)
    if gemm:
        return {"x": rng.standard_normal((3, k)).astype(np.float32)}
    x = rng.standard_normal((B, S, k)).astype(np.float32)
    return {"x": x, "xt": np.ascontiguousarray(x.transpose(0, 2, 1))}


def test_pack_int8_blocks_layout_and_math() -> None:
    k, n, block = 70, 3, 32
    weight = np.random.default_rng(1).standard_normal((k, n)).astype(np.float32)
    weight[:, 1] = 0.0
    q, scales = pack_int8_blocks(weight, block)
    assert q.shape == (n, 3, block) and q.dtype == np.uint8 and scales.shape == (n, 3) and scales.dtype == np.float32
    for col in range(n):
        for blk in range(3):
            values = weight[blk * block : (blk + 1) * block, col]
            want_scale = np.abs(values).max() / 127.0 if np.abs(values).max() > 0 else 1.0
            assert scales[col, blk] == np.float32(want_scale)
            want = np.clip(np.rint(values / np.float32(want_scale)), -127, 127).astype(np.int16) + 128
            np.testing.assert_array_equal(q[col, blk, : len(values)], want)
            np.testing.assert_array_equal(q[col, blk, len(values) :], 128)  # the zero padding of K
    assert (q[1] == 128).all() and (scales[1] == 1.0).all()
    assert q.min() >= 1 and q.max() <= 255  # symmetric: -127..127 around 128
    deq = dequantize(q, scales, k)
    assert np.abs(deq - weight).max() <= (scales.max() / 2) * (1 + 1e-6)
    assert np.abs(deq - weight).max() > 0


@pytest.mark.parametrize("gemm", [False, True], ids=["MatMul", "Gemm transB + bias"])
@pytest.mark.parametrize("block_size", [BLOCK_SIZE, 32])
def test_quantize_matmul_nbits(gemm: bool, block_size: int) -> None:
    k, n = 200, 24  # K not a multiple of the block: the last block is padded
    model, weight, bias = nbits_graph(k, n, gemm=gemm)
    feeds = nbits_feeds(k, gemm)
    before = run(model, feeds, optimize=False)
    replaced = quantize_matmul_nbits(model, block_size=block_size)
    assert replaced == (["/fc/Gemm"] if gemm else ["/fc/MatMul"])
    finish(model)
    assert [v.name for v in model.graph.outputs] == [o for o in before]  # logits keeps its name
    fused = model.graph.node("/fc/GemmNBits" if gemm else "/fc/MatMulNBits")
    assert fused.op_type == "MatMulNBits" and fused.domain == "com.microsoft"
    attrs = {name: fused.attributes.get_int(name) for name in ("K", "N", "bits", "block_size", "accuracy_level")}
    assert attrs == {"K": k, "N": n, "bits": 8, "block_size": block_size, "accuracy_level": ACCURACY_LEVEL}
    assert model.opset_imports["com.microsoft"] == 1
    # the stored weight is exactly pack_int8_blocks' (names from the weight's, without weights/)
    q = model.graph.initializers["ort_int8/fc.weight.q"].const_value.numpy()
    scales = model.graph.initializers["ort_int8/fc.weight.scales"].const_value.numpy()
    want_q, want_scales = pack_int8_blocks(weight, block_size)
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(scales, want_scales.reshape(-1))
    deq = dequantize(q, scales, k)
    assert np.abs(deq - weight).max() <= scales.max() / 2 * (1 + 1e-6)
    assert (deq[:, 0] == 0).all()
    if gemm:
        assert fused.inputs[5] is not None and fused.inputs[5].name == "fc.bias"
    else:
        assert "MatMul" in ops(model)  # the activation x activation MatMul stays float
    after = run(model, feeds)
    x = feeds["x"].astype(np.float64)
    exact_deq = x @ deq.astype(np.float64) + (bias if bias is not None else 0.0)
    # Tolerance, derived rather than guessed: accuracy_level 4 also quantizes x symmetrically
    # per block of block_size (scale max|x_block| / 127), so |x - x_q| <= that scale / 2 per
    # element; the output error against x @ dequantized W is at most |W_deq|^T . (x_scale / 2)
    # summed over K. On top, MLAS applies the zero point 128 as a float32 correction
    # 128 * sum(x_q * scale): one float32 rounding of that term (it shows on the all-zero column).
    blocks = -(-k // block_size)
    padded = np.zeros((*x.shape[:-1], blocks * block_size))
    padded[..., :k] = np.abs(x)
    x_half_step = (padded.reshape(*x.shape[:-1], blocks, block_size).max(-1) / 127.0 / 2.0).repeat(block_size, -1)[
        ..., :k
    ]
    w_scale = np.repeat(scales.reshape(n, blocks), block_size, axis=1)[:, :k].T  # [K, N], per weight
    rounding = np.finfo(np.float32).eps * 128.0 * (np.abs(x) @ w_scale) + 1e-6
    bound = x_half_step @ np.abs(deq.astype(np.float64)) + rounding
    err = np.abs(after["logits"] - exact_deq)
    assert (err <= bound).all(), float((err - bound).max())
    # against the float model the weight's own rounding adds at most sum_k |x_k| * scale_k / 2
    float_bound = bound + np.abs(x) @ (w_scale / 2.0)
    float_err = np.abs(after["logits"] - before["logits"])
    assert (float_err <= float_bound).all(), float((float_err - float_bound).max())
    assert float_err.max() > 0  # it is quantized
    if not gemm:
        np.testing.assert_allclose(after["gram"], before["gram"], rtol=1e-5, atol=1e-5)


def test_quantize_matmul_nbits_exact_layout_at_accuracy_level_0() -> None:
    """Without activation quantization MatMulNBits multiplies by the dequantized weight: checks
    that ONNX Runtime reads B and scales in the layout pack_int8_blocks writes."""
    k, n = 200, 24
    model, weight, _ = nbits_graph(k, n)
    feeds = nbits_feeds(k)
    quantize_matmul_nbits(model, block_size=32, accuracy_level=0)
    finish(model)
    q = model.graph.initializers["ort_int8/fc.weight.q"].const_value.numpy()
    scales = model.graph.initializers["ort_int8/fc.weight.scales"].const_value.numpy()
    want = feeds["x"].astype(np.float64) @ dequantize(q, scales, k).astype(np.float64)
    np.testing.assert_allclose(run(model, feeds)["logits"], want, rtol=1e-4, atol=1e-4)


def test_quantize_matmul_nbits_names_are_shared_between_graphs() -> None:
    """Prefill and decode quantize the same weight under the same names and content."""
    a, _, _ = nbits_graph(64, 8)
    b, _, _ = nbits_graph(64, 8)
    quantize_matmul_nbits(a)
    quantize_matmul_nbits(b)
    names = sorted(n for n in a.graph.initializers if n.startswith("ort_int8/"))
    assert names == ["ort_int8/fc.weight.q", "ort_int8/fc.weight.scales"]
    for name in names:
        np.testing.assert_array_equal(
            a.graph.initializers[name].const_value.numpy(), b.graph.initializers[name].const_value.numpy()
        )


def test_quantize_matmul_nbits_leaves_other_matmuls() -> None:
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w3"], ["a"], name="/batched/MatMul"),  # 3-D weight
        helper.make_node("Gemm", ["x2", "w2"], ["b"], alpha=2.0, name="/scaled/Gemm"),  # alpha != 1
        helper.make_node("Gemm", ["x2t", "w2"], ["c"], transA=1, name="/ta/Gemm"),  # transA
    ]
    model = make(
        nodes,
        [info("x", [2, 3, 4]), info("x2", [3, 4]), info("x2t", [4, 3])],
        [info("a", [2, 3, 5]), info("b", [3, 5]), info("c", [3, 5])],
        [
            ("w3", rng.standard_normal((2, 4, 5)).astype(np.float32)),
            ("w2", rng.standard_normal((4, 5)).astype(np.float32)),
        ],
    )
    assert quantize_matmul_nbits(model) == []
    assert ops(model) == ["MatMul", "Gemm", "Gemm"] and "com.microsoft" not in model.opset_imports


# ---------------------------------------------------------------- int4: DQ + MatMul -> MatMulNBits bits=4

K4, N4, BLOCK4 = 64, 24, 32


def int4_graph(*, also_read: bool = False, scale_dtype: type = np.float32) -> tuple[ir.Model, np.ndarray, np.ndarray]:
    """logits = x @ DQ(W int4 [K, N], scale [K/B, N], axis=0, block_size=B) as ``--int4`` writes
    it (round to nearest), and gram = x @ xt (no constant weight); ``also_read``: the
    dequantized weight is also summed (read by something other than a MatMul)."""
    weight = np.random.default_rng(5).standard_normal((K4, N4)).astype(np.float32)
    q, scale = rtn(weight, BLOCK4, np.dtype(scale_dtype))
    w = ir.val(
        "weights/fc.weight.int4",
        ir.DataType.INT4,
        [K4, N4],
        const_value=ir.PackedTensor(pack_int4(q), ir.DataType.INT4, shape=ir.Shape([K4, N4])),
    )
    s = ir.val("weights/fc.weight.scale", const_value=ir.tensor(scale, name="weights/fc.weight.scale"))
    x, xt = ir.val("x", ir.DataType.FLOAT, [B, S, K4]), ir.val("xt", ir.DataType.FLOAT, [B, K4, S])
    dq = ir.node("DequantizeLinear", [w, s], {"axis": 0, "block_size": BLOCK4}, name="/fc/weight/DequantizeLinear")
    dq.outputs[0].name, dq.outputs[0].dtype, dq.outputs[0].shape = (
        "weights/fc.weight",
        ir.DataType.FLOAT,
        ir.Shape([K4, N4]),
    )
    fc = ir.node("MatMul", [x, dq.outputs[0]], name="/fc/MatMul")
    gram = ir.node("MatMul", [x, xt], name="/attn/MatMul")
    outputs = []
    for node, name, dims in ((fc, "logits", [B, S, N4]), (gram, "gram", [B, S, S])):
        node.outputs[0].name, node.outputs[0].dtype, node.outputs[0].shape = name, ir.DataType.FLOAT, ir.Shape(dims)
        outputs.append(node.outputs[0])
    nodes = [dq, fc, gram]
    if also_read:
        total = ir.node("ReduceSum", [dq.outputs[0]], {"keepdims": 0}, name="/weight/ReduceSum")
        total.outputs[0].name, total.outputs[0].dtype, total.outputs[0].shape = "total", ir.DataType.FLOAT, ir.Shape([])
        nodes.append(total)
        outputs.append(total.outputs[0])
    graph = ir.Graph([x, xt], outputs, nodes=nodes, initializers=[w, s], opset_imports={"": 21}, name="g")
    return ir.Model(graph, ir_version=10), q, scale


def test_unfold_int4_weights_keeps_the_numbers() -> None:
    model, q, scale = int4_graph()
    feeds = nbits_feeds(K4)
    before = run(model, feeds, optimize=False)
    assert unfold_int4_weights(model) == ["/fc/MatMul"]
    assert ops(model) == ["MatMul", "MatMul"]
    weight = model.graph.node("/fc/MatMul").inputs[1]
    tensor = weight.const_value if weight is not None else None
    assert isinstance(tensor, BlockInt4) and tensor.name == "ort_int4/fc.weight" and tensor.block == BLOCK4
    np.testing.assert_array_equal(tensor.q(), q)
    np.testing.assert_array_equal(tensor.scale, scale)
    np.testing.assert_array_equal(tensor.numpy(), q.astype(np.float32) * np.repeat(scale, BLOCK4, axis=0))
    after = run(model, feeds, optimize=False)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_unfold_int4_weights_leaves_a_weight_read_as_float() -> None:
    model, _, _ = int4_graph(also_read=True)
    assert unfold_int4_weights(model) == []
    assert ops(model) == ["DequantizeLinear", "MatMul", "MatMul", "ReduceSum"]


def test_unfold_int4_weights_refuses_fp16_scales() -> None:
    model, _, _ = int4_graph(scale_dtype=np.float16)
    message = (
        "export: /fc/weight/DequantizeLinear: the ONNX Runtime target's int4 weights need fp32 scales (an fp32 "
        "graph), found FLOAT16"
    )
    with pytest.raises(ExportError, match="^" + re.escape(message) + "$"):
        unfold_int4_weights(model)


def unpack_nbits(packed: np.ndarray) -> np.ndarray:
    """MatMulNBits' uint4 ``B [N, K/B, B/2]`` (zero point 8) back to q int8 [K, N]."""
    n = packed.shape[0]
    u = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)  # element 2j: the low nibble
    return (u.astype(np.int16) - 8).astype(np.int8).T


def test_int4_matmul_nbits_computes_the_dq_matmul_form() -> None:
    model, q, scale = int4_graph()
    feeds = nbits_feeds(K4)
    before = run(model, feeds, optimize=False)
    run_passes(model, [GraphRewrite(unfold_int4_weights), GraphRewrite(int4_matmul_nbits)], graph="decode")
    finish(model)
    assert ops(model) == ["MatMulNBits", "MatMul"] and model.opset_imports["com.microsoft"] == 1
    fused = model.graph.node("/fc/MatMulNBits")
    attrs = {name: fused.attributes.get_int(name) for name in ("K", "N", "bits", "block_size", "accuracy_level")}
    assert attrs == {"K": K4, "N": N4, "bits": 4, "block_size": BLOCK4, "accuracy_level": INT4_ACCURACY_LEVEL}
    assert not any(isinstance(v.const_value, BlockInt4) for v in model.graph.initializers.values() if v.uses())
    packed = model.graph.initializers["ort_int4/fc.weight.q"].const_value.numpy()
    scales = model.graph.initializers["ort_int4/fc.weight.scales"].const_value.numpy()
    assert packed.shape == (N4, K4 // BLOCK4, BLOCK4 // 2) and packed.dtype == np.uint8
    np.testing.assert_array_equal(unpack_nbits(packed), q)  # the same int4 numbers
    np.testing.assert_array_equal(scales, scale.T.reshape(-1))  # and scales, column by column
    fused.attributes["accuracy_level"] = ir.AttrInt64(
        "accuracy_level", 0
    )  # float activations: ONNX Runtime reads that layout as the DQ form
    exact = run(model, feeds)
    np.testing.assert_allclose(exact["logits"], before["logits"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(exact["gram"], before["gram"])
    # at the level it writes, the activations are int8 per block: |x - x_q| <= max|x_block| / 254
    fused.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", INT4_ACCURACY_LEVEL)
    x = feeds["x"].astype(np.float64)
    half_step = np.repeat(np.abs(x).reshape(B, S, K4 // BLOCK4, BLOCK4).max(-1) / 254.0, BLOCK4, axis=-1)
    bound = half_step @ np.abs(q * np.repeat(scale, BLOCK4, axis=0)).astype(np.float64) + 1e-5
    err = np.abs(run(model, feeds)["logits"] - before["logits"])
    assert (err <= bound).all() and err.max() > 0, float((err - bound).max())


def test_int4_matmul_nbits_refuses_an_int4_weight_read_as_float() -> None:
    model, _, _ = int4_graph()
    unfold_int4_weights(model)
    weight = model.graph.node("/fc/MatMul").inputs[1]
    assert weight is not None
    model.graph.append(ir.node("Identity", [weight], name="/float/Identity"))
    with pytest.raises(
        ExportError,
        match=re.escape("int4 weights ['ort_int4/fc.weight'] are still read as float after the MatMulNBits rewrite"),
    ):
        int4_matmul_nbits(model)
