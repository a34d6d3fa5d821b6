"""``cut_subgraph`` (``passes.subgraph``): the piece of a saved graph that computes some outputs,
run on its own with ONNX Runtime, equals the whole graph's outputs; what it cannot cut is None."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, external_data_helper, helper, numpy_helper

from kiln.exporter.passes.subgraph import cut_subgraph


def saved(directory: Path) -> onnx.ModelProto:
    """cos = Cos(Cast(position_ids) * w) with w [4] external in ``directory``; y = x + Neg(cos);
    z = a com.microsoft op (``lost``, asked for below, is a name nothing produces)."""
    nodes = [
        helper.make_node("Cast", ["position_ids"], ["p"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["p", "w"], ["scaled"]),
        helper.make_node("Cos", ["scaled"], ["cos"]),
        helper.make_node("Neg", ["cos"], ["neg"]),
        helper.make_node("Add", ["x", "neg"], ["y"]),
        helper.make_node("FastGelu", ["x"], ["z"], domain="com.microsoft"),
    ]
    inputs = [
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, [2, 4]),
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
    ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4]) for n in ("cos", "y", "z")]
    w = numpy_helper.from_array(np.linspace(0.1, 0.4, 4, dtype=np.float32), "w")
    external_data_helper.set_external_data(w, "weights.bin", offset=0, length=16)
    (directory / "weights.bin").write_bytes(np.linspace(0.1, 0.4, 4, dtype=np.float32).tobytes())
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    graph = helper.make_graph(nodes, "g", inputs, outputs, [w])
    opsets = [helper.make_opsetid("", 19), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], directory: Path | None = None) -> dict[str, np.ndarray]:
    if directory is not None:  # the whole graph reads its external weights from beside it
        path = directory / "model.onnx"
        onnx.save(model, path)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    else:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


FEEDS = {"position_ids": np.arange(8, dtype=np.int64).reshape(2, 4), "x": np.ones((2, 4), np.float32)}


def test_cut_subgraph_computes_the_outputs_alone(tmp_path: Path) -> None:
    proto = saved(tmp_path)
    whole = run(proto, FEEDS, tmp_path)
    cut = cut_subgraph(proto, ["cos", "y"], tmp_path, name="piece")
    assert cut is not None and cut.graph.name == "piece"
    assert [n.op_type for n in cut.graph.node] == [
        "Cast",
        "Mul",
        "Cos",
        "Neg",
        "Add",
    ]  # in the graph's order, FastGelu left out
    assert sorted(v.name for v in cut.graph.input) == ["position_ids", "x"]
    (w,) = cut.graph.initializer
    assert not external_data_helper.uses_external_data(w) and numpy_helper.to_array(w).tolist() == pytest.approx(
        [0.1, 0.2, 0.3, 0.4]
    )
    assert [o.domain for o in cut.opset_import] == [""]
    got = run(cut, FEEDS)  # no file: its constants are inside it
    for name in ("cos", "y"):
        np.testing.assert_array_equal(got[name], whole[name])


@pytest.mark.parametrize(
    ("outputs", "limits"),
    [
        (["y"], {"allowed_inputs": {"position_ids"}}),  # reads x
        (["cos"], {"max_external_bytes": 15}),  # w is 16 bytes
        (["z"], {}),  # a contrib op
        (["lost"], {}),  # nothing produces it
    ],
    ids=["input not allowed", "external constant too large", "non-standard domain", "unproduced value"],
)
def test_cut_subgraph_refuses(outputs: list[str], limits: dict[str, object], tmp_path: Path) -> None:
    proto = saved(tmp_path)
    assert cut_subgraph(proto, outputs, tmp_path, name="piece", **limits) is None  # type: ignore[arg-type]
    assert (
        cut_subgraph(proto, ["cos"], tmp_path, name="piece", allowed_inputs={"position_ids"}, max_external_bytes=16)
        is not None
    )


def test_cut_subgraph_keeps_an_fp16_output_fp16(tmp_path: Path) -> None:
    """An output the graph records as fp16 (an --fp16 graph's rotary tables) is declared fp16:
    declared FLOAT, ONNX Runtime refuses the cut model (a type mismatch)."""
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16), helper.make_node("Neg", ["h"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2])]
    graph = helper.make_graph(
        nodes, "g", inputs, outputs, value_info=[helper.make_tensor_value_info("h", TensorProto.FLOAT16, [2])]
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=10)
    cut = cut_subgraph(proto, ["h", "y"], tmp_path, name="piece")
    assert cut is not None and [o.type.tensor_type.elem_type for o in cut.graph.output] == [
        TensorProto.FLOAT16,
        TensorProto.FLOAT16,
    ]
    got = run(cut, {"x": np.array([1.5, -2.0], np.float32)})
    assert got["y"].dtype == np.float16 and got["y"].tolist() == [-1.5, 2.0]
