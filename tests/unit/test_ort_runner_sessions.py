"""``OrtRunner`` opens one graph's session at a time when the graphs' weights are large (each
session prepacks its own copy: an 8B model's three would not fit), and keeps small graphs'
sessions open side by side (reopening them was most of a small model's parity on ONNX Runtime's
side). Counted by the sessions it asks ``ort_session`` for; every run's output checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.errors import ArtifactError
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.runners import ort_runner
from kiln.exporter.runners.ort_runner import OrtRunner

K = 64


def _matmul_graph(path: Path, weight: np.ndarray) -> None:
    """y = x @ weight, the weight in an external file beside the graph."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="/MatMul")],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, K])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=10)
    onnx.save(model, path, save_as_external_data=True, location=f"{path.stem}.bin", size_threshold=0)


@pytest.fixture
def graphs(tmp_path: Path) -> dict[GraphKind, tuple[Path, np.ndarray]]:
    rng = np.random.default_rng(0)
    made = {}
    for kind in (GraphKind.PREFILL, GraphKind.DECODE):
        weight = rng.standard_normal((K, K)).astype(np.float32)
        _matmul_graph(tmp_path / f"{kind.value}.onnx", weight)
        made[kind] = (tmp_path / f"{kind.value}.onnx", weight)
    return made


def _opened(graphs: dict[GraphKind, tuple[Path, np.ndarray]], monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Run prefill, decode, prefill, decode; the graphs a session was opened for, in order."""
    opened: list[Path] = []
    real = ort_runner.ort_session

    def counting(model: Path, **kwargs: Any) -> Any:
        opened.append(model)
        return real(model, **kwargs)

    monkeypatch.setattr(ort_runner, "ort_session", counting)
    x = np.random.default_rng(1).standard_normal((1, K)).astype(np.float32)
    with OrtRunner({kind: path for kind, (path, _) in graphs.items()}) as runner:
        for kind in (GraphKind.PREFILL, GraphKind.DECODE) * 2:
            np.testing.assert_allclose(runner.run(kind, {"x": x})["y"], x @ graphs[kind][1], rtol=1e-5, atol=1e-5)
    return opened


def test_small_graphs_keep_their_sessions_open(
    graphs: dict[GraphKind, tuple[Path, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _opened(graphs, monkeypatch) == [graphs[GraphKind.PREFILL][0], graphs[GraphKind.DECODE][0]]


def test_large_graphs_open_one_session_at_a_time(
    graphs: dict[GraphKind, tuple[Path, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    one = graphs[GraphKind.PREFILL][0]
    weight_bytes = one.stat().st_size + (one.parent / "prefill.bin").stat().st_size
    assert weight_bytes > K * K * 4  # the external file is counted
    monkeypatch.setattr(ort_runner, "KEEP_OPEN_BYTES", weight_bytes + 16)  # one fits, two do not
    prefill, decode = graphs[GraphKind.PREFILL][0], graphs[GraphKind.DECODE][0]
    assert _opened(graphs, monkeypatch) == [prefill, decode, prefill, decode]


@pytest.mark.parametrize("location", ["../outside.bin", "missing.bin", "sub/prefill.bin", "link.bin"])
def test_a_weights_location_not_beside_the_graph_is_refused_by_name(
    graphs: dict[GraphKind, tuple[Path, np.ndarray]], location: str
) -> None:
    """A graph naming weights outside its directory, in a subdirectory, in no file, or in a link
    beside it (to a file outside) is refused in one line before any session opens (its size is
    never read from outside the directory)."""
    path = graphs[GraphKind.PREFILL][0]
    model = onnx.load(str(path), load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save(model, path)
    (path.parent.parent / "outside.bin").write_bytes((path.parent / "prefill.bin").read_bytes())
    (path.parent / "link.bin").symlink_to(path.parent.parent / "outside.bin")
    x = np.zeros((1, K), np.float32)
    with OrtRunner({GraphKind.PREFILL: path}) as runner, pytest.raises(ArtifactError) as refused:
        runner.run(GraphKind.PREFILL, {"x": x})
    assert (
        str(refused.value)
        == f"artifacts: prefill.onnx: tensor w reads external data from {location!r}, which is not a file beside "
        "the graph"
    )
