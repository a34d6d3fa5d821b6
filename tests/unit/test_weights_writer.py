"""The one weights writer (``passes.weights``): graphs of a set share one external file, each
distinct tensor stored once, 64-byte aligned; the saved graphs run in ONNX Runtime as before."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from kiln.errors import ExportError
from kiln.exporter.passes import WEIGHTS_FILE, ExternalizeWeights, NameNodes, SharedWeights, WeightsWriter, run_passes

FLOAT = ir.DataType.FLOAT
K = 17  # [17, 17] float32 = 1156 bytes: over the inline limit, not a multiple of 64


def exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def arrays(seed: int, *names: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal((K, K)) / np.sqrt(K)).astype(np.float32) for n in names}


def chain(
    weights: list[tuple[str, np.ndarray, str]], small: dict[str, np.ndarray] | None = None, name: str = "g"
) -> ir.Model:
    """y = x @ W1 @ W2 ... (+ each small tensor): ``weights`` lists (initializer name, array, node name)."""
    x = ir.val("x", FLOAT, [2, K])
    inits: dict[str, ir.Value] = {}
    nodes = []
    h = x
    for init_name, array, node_name in [*weights, *((n, a, f"/add_{n}") for n, a in (small or {}).items())]:
        if init_name not in inits:
            inits[init_name] = ir.val(init_name, const_value=ir.tensor(array, name=init_name))
        op = "MatMul" if array.ndim == 2 else "Add"
        node = ir.node(op, [h, inits[init_name]], name=node_name)
        node.outputs[0].dtype, node.outputs[0].shape = FLOAT, ir.Shape([2, K])
        nodes.append(node)
        h = node.outputs[0]
    h.name = "y"
    graph = ir.Graph([x], [h], nodes=nodes, initializers=list(inits.values()), opset_imports={"": 19}, name=name)
    return ir.Model(graph, ir_version=10)


def run_file(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["y"], {"x": x})[0]


def run_memory(model: ir.Model, x: np.ndarray) -> np.ndarray:
    proto = ir.serde.serialize_model(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["y"], {"x": x})[0]


def external(model: ir.Model) -> dict[str, ir.ExternalTensor]:
    return {
        n: v.const_value for n, v in model.graph.initializers.items() if isinstance(v.const_value, ir.ExternalTensor)
    }


def stored_bytes(path: Path, tensor: ir.ExternalTensor) -> bytes:
    data = path.read_bytes()
    return data[tensor.offset : tensor.offset + tensor.length]


X = np.random.default_rng(42).standard_normal((2, K)).astype(np.float32)


def two_graphs() -> tuple[ir.Model, ir.Model, dict[str, np.ndarray]]:
    w = arrays(0, "w_big", "val_3", "b_only")
    small = {"small": np.linspace(-1, 1, K, dtype=np.float32)}  # 68 bytes: stays inline
    a = chain(
        [
            ("w_big", w["w_big"], "/layers.0.attn/MatMul"),
            ("val_3", w["val_3"], "/layers.0.mlp.fc1/MatMul"),
            ("w_copy", w["w_big"].copy(), "/layers.0.mlp.fc2/MatMul"),
        ],
        small,
        name="prefill",
    )
    b = chain(
        [("other_name", w["w_big"].copy(), "/layers.0.attn/MatMul"), ("b_only", w["b_only"], "/head/MatMul")],
        name="decode",
    )
    return a, b, w


def test_rename_shares_weights_between_graphs(tmp_path: Path) -> None:
    a, b, w = two_graphs()
    before = {"a": run_memory(a, X), "b": run_memory(b, X)}
    path = tmp_path / WEIGHTS_FILE
    with WeightsWriter(path, rename=True) as writer:
        writer.externalize(a)
        ir.save(a, tmp_path / "prefill.onnx")
        run_passes(b, [NameNodes(), ExternalizeWeights(writer)], graph="decode")
        ir.save(b, tmp_path / "decode.onnx")
        shared = writer.close()
    # three distinct contents (w_big under three names, val_3, b_only), each stored once, aligned
    assert shared == SharedWeights(path, tensors=3, bytes=path.stat().st_size, references=4)
    assert shared.bytes == 2 * 1216 + 1156  # 1156 bytes each, padded to a multiple of 64 in between
    ext_a, ext_b = external(a), external(b)
    # canonical names: weights/<first name seen>, or for a made-up val_N the node that reads it
    assert sorted(ext_a) == ["weights/layers.0.mlp.fc1/MatMul:1", "weights/w_big"]
    assert sorted(ext_b) == ["weights/b_only", "weights/w_big"]
    assert sorted(a.graph.initializers) == ["small", "weights/layers.0.mlp.fc1/MatMul:1", "weights/w_big"]
    assert a.graph.initializers["small"].const_value is not None and not isinstance(
        a.graph.initializers["small"].const_value, ir.ExternalTensor
    )
    # the in-graph duplicate (w_copy) merged into the first: both MatMuls read one initializer
    weight = a.graph.initializers["weights/w_big"]
    assert sorted(n.name for n, _ in weight.uses()) == ["/layers.0.attn/MatMul", "/layers.0.mlp.fc2/MatMul"]
    offsets = {}
    for ext in [*ext_a.values(), *ext_b.values()]:
        assert ext.location == WEIGHTS_FILE and ext.offset % 64 == 0 and ext.length == K * K * 4
        offsets.setdefault(ext.name, set()).add(ext.offset)
    assert {k: len(v) for k, v in offsets.items()} == {
        "weights/w_big": 1,
        "weights/layers.0.mlp.fc1/MatMul:1": 1,
        "weights/b_only": 1,
    }
    assert ext_a["weights/w_big"].offset == ext_b["weights/w_big"].offset == 0
    assert sorted(o for s in offsets.values() for o in s) == [0, 1216, 2432]
    assert stored_bytes(path, ext_a["weights/w_big"]) == w["w_big"].tobytes()
    assert stored_bytes(path, ext_a["weights/layers.0.mlp.fc1/MatMul:1"]) == w["val_3"].tobytes()
    assert stored_bytes(path, ext_b["weights/b_only"]) == w["b_only"].tobytes()
    assert path.read_bytes()[1156:1216] == b"\0" * 60
    # nothing above the limit is inside the protobufs; the saved graphs compute what they did
    for kind in ("prefill", "decode"):
        proto = onnx.load(str(tmp_path / f"{kind}.onnx"), load_external_data=False)
        assert all(len(t.raw_data) < 1024 for t in proto.graph.initializer)
    np.testing.assert_allclose(run_file(tmp_path / "prefill.onnx", X), before["a"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(run_file(tmp_path / "decode.onnx", X), before["b"], rtol=1e-6, atol=1e-6)


def test_rename_gives_other_content_under_one_name_its_own_name(tmp_path: Path) -> None:
    w1, w2 = arrays(1, "w")["w"], arrays(2, "w")["w"]
    a, b = chain([("w", w1, "/a/MatMul")]), chain([("w", w2, "/a/MatMul")])
    before = run_memory(b, X)
    with WeightsWriter(tmp_path / WEIGHTS_FILE, rename=True) as writer:
        writer.externalize(a)
        writer.externalize(b)
        shared = writer.close()
    assert sorted(external(a)) == ["weights/w"] and sorted(external(b)) == ["weights/w.1"]
    assert shared.tensors == 2 and shared.references == 2
    ir.save(b, tmp_path / "b.onnx")
    np.testing.assert_allclose(run_file(tmp_path / "b.onnx", X), before, rtol=1e-6, atol=1e-6)


def test_content_means_dtype_shape_and_bytes(tmp_path: Path) -> None:
    """The same bytes under another shape or dtype are another tensor."""
    w = np.arange(16 * 64, dtype=np.float32)
    x = ir.val("x", FLOAT, [16, 64])
    inits = [
        ir.val("a", const_value=ir.tensor(w.reshape(16, 64), name="a")),
        ir.val("b", const_value=ir.tensor(w.reshape(32, 32), name="b")),
        ir.val("c", const_value=ir.tensor(w.view(np.int32).reshape(16, 64), name="c")),
    ]
    model = ir.Model(ir.Graph([x], [x], nodes=[], initializers=inits, opset_imports={"": 19}), ir_version=10)
    with WeightsWriter(tmp_path / WEIGHTS_FILE, rename=True) as writer:
        writer.externalize(model)
        shared = writer.close()
    assert shared.tensors == 3 and shared.references == 3
    assert sorted(external(model)) == ["weights/a", "weights/b", "weights/c"]


@pytest.mark.parametrize(("size", "inline"), [(255, True), (256, False)])
def test_inline_limit(tmp_path: Path, size: int, inline: bool) -> None:
    """Tensors under 1024 bytes stay in the graph; 1024 bytes and more go to the file."""
    x = ir.val("x", FLOAT, [size])
    t = ir.val("t", const_value=ir.tensor(np.ones(size, dtype=np.float32), name="t"))
    add = ir.node("Add", [x, t], name="/add")
    add.outputs[0].name, add.outputs[0].dtype, add.outputs[0].shape = "y", FLOAT, ir.Shape([size])
    model = ir.Model(ir.Graph([x], add.outputs, nodes=[add], initializers=[t], opset_imports={"": 19}), ir_version=10)
    with WeightsWriter(tmp_path / WEIGHTS_FILE, rename=True) as writer:
        writer.externalize(model)
        shared = writer.close()
    assert (shared.tensors, shared.bytes, shared.references) == ((0, 0, 0) if inline else (1, 1024, 1))
    assert sorted(model.graph.initializers) == (["t"] if inline else ["weights/t"])
    ir.save(model, tmp_path / "m.onnx")
    xs = np.arange(size, dtype=np.float32)
    got = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(["y"], {"x": xs})[0]
    np.testing.assert_array_equal(got, xs + 1)


def test_keep_names_shares_content_and_refuses_a_name_with_other_content(tmp_path: Path) -> None:
    w = arrays(3, "w", "v")
    a = chain([("w", w["w"], "/a/MatMul"), ("same_as_w", w["w"].copy(), "/b/MatMul")])
    b = chain([("w", w["w"].copy(), "/a/MatMul"), ("v", w["v"], "/b/MatMul")])
    before = run_memory(a, X)
    path = tmp_path / "weights.ort.bin"
    with WeightsWriter(path, rename=False) as writer:
        writer.externalize(a)
        writer.externalize(b)
        bad = chain([("v", w["w"], "/a/MatMul")], name="model")
        message = "tensor v differs between graphs; cannot share weights.ort.bin"
        with pytest.raises(
            ExportError, match=exact(f"export: pass ExternalizeWeights on the model (ORT target) graph: {message}")
        ):
            run_passes(bad, [ExternalizeWeights(writer)], graph="model (ORT target)")
        with pytest.raises(ExportError, match=exact(f"export: {message}")):
            writer.externalize(chain([("v", w["w"], "/a/MatMul")]))
        shared = writer.close()
    assert shared.tensors == 2 and shared.references == 4  # w (three initializers over both graphs) and v
    assert shared.bytes == path.stat().st_size == 1216 + 1156
    ext_a, ext_b = external(a), external(b)
    assert sorted(ext_a) == ["same_as_w", "w"] and sorted(ext_b) == ["v", "w"]  # names kept, nothing merged
    assert ext_a["w"].offset == ext_a["same_as_w"].offset == ext_b["w"].offset == 0 and ext_b["v"].offset == 1216
    assert all(e.name == n for n, e in [*ext_a.items(), *ext_b.items()])
    ir.save(a, tmp_path / "a.onnx")
    np.testing.assert_allclose(run_file(tmp_path / "a.onnx", X), before, rtol=1e-6, atol=1e-6)


def test_keep_names_leaves_tensors_of_another_weights_file(tmp_path: Path) -> None:
    """The ORT target reloads a portable graph: its weights stay in weights.bin, only the
    tensors its rewrite adds go to weights.ort.bin."""
    w = arrays(4, "w", "extra")
    portable = chain([("w", w["w"], "/a/MatMul")], name="decode")
    with WeightsWriter(tmp_path / WEIGHTS_FILE, rename=True) as writer:
        writer.externalize(portable)
        writer.close()
    ir.save(portable, tmp_path / "decode.onnx")
    model = ir.load(tmp_path / "decode.onnx")
    # a rewrite adds an in-memory tensor
    graph = model.graph
    extra = ir.val("ort/extra", const_value=ir.tensor(w["extra"], name="ort/extra"))
    graph.register_initializer(extra)
    out = graph.outputs[0]
    node = ir.node("MatMul", [out, extra], name="/extra/MatMul")
    node.outputs[0].dtype, node.outputs[0].shape = FLOAT, ir.Shape([2, K])
    graph.append(node)
    out.name = "y.before"
    node.outputs[0].name = "y"
    graph.outputs[0] = node.outputs[0]
    ort_path = tmp_path / "weights.ort.bin"
    with WeightsWriter(ort_path, rename=False) as writer:
        writer.externalize(model)
        shared = writer.close()
    assert (shared.tensors, shared.references, shared.bytes) == (1, 1, K * K * 4)
    ext = external(model)
    assert ext["weights/w"].location == WEIGHTS_FILE and ext["ort/extra"].location == "weights.ort.bin"
    assert stored_bytes(ort_path, ext["ort/extra"]) == w["extra"].tobytes()
    ir.save(model, tmp_path / "decode.ort.onnx")
    np.testing.assert_allclose(run_file(tmp_path / "decode.ort.onnx", X), X @ w["w"] @ w["extra"], rtol=1e-5, atol=1e-5)


def test_close_without_graphs_and_exit_closes(tmp_path: Path) -> None:
    with WeightsWriter(tmp_path / WEIGHTS_FILE, rename=True) as writer:
        shared = writer.close()
    assert shared == SharedWeights(tmp_path / WEIGHTS_FILE, 0, 0, 0)
    assert (tmp_path / WEIGHTS_FILE).read_bytes() == b""
    with pytest.raises(RuntimeError, match="boom"), WeightsWriter(tmp_path / "other.bin", rename=True) as other:
        other.externalize(chain([("w", arrays(5, "w")["w"], "/a/MatMul")]))
        raise RuntimeError("boom")
    assert other._file.closed  # the file handle does not leak when an export fails
