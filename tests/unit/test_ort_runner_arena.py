"""Parity's ONNX Runtime sessions run without the CPU memory arena (a run's buffers go back to the
system when it ends, not kept until the session closes: the 0.5B fp32 export's peak), while every
other session kiln opens keeps ONNX Runtime's default arena; the runs' outputs are unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.runners import ort_runner
from kiln.exporter.runners.ort_runner import OrtRunner, ort_session

K = 32


@pytest.fixture
def graph(tmp_path: Path) -> tuple[Path, np.ndarray]:
    """y = x @ w, its weight in an external file."""
    weight = np.random.default_rng(0).standard_normal((K, K)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, K])]
    made = helper.make_graph(nodes, "mm", inputs, outputs, [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(made, opset_imports=[helper.make_opsetid("", 19)], ir_version=10)
    path = tmp_path / "prefill.onnx"
    onnx.save(model, path, save_as_external_data=True, location="prefill.bin", size_threshold=0)
    return path, weight


def test_ort_session_keeps_the_arena_unless_asked(graph: tuple[Path, np.ndarray]) -> None:
    path, _ = graph
    assert ort_session(path).get_session_options().enable_cpu_mem_arena, "the default session keeps the arena"
    off = ort_session(path, memory_arena=False).get_session_options()
    assert not off.enable_cpu_mem_arena, "memory_arena=False turns the arena off"


def test_parity_sessions_run_without_the_arena(graph: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    path, weight = graph
    sessions: list[Any] = []
    real = ort_runner.ort_session

    def recording(model: Path, **kwargs: Any) -> Any:
        sessions.append(real(model, **kwargs))
        return sessions[-1]

    monkeypatch.setattr(ort_runner, "ort_session", recording)
    x = np.random.default_rng(1).standard_normal((1, K)).astype(np.float32)
    with OrtRunner({GraphKind.PREFILL: path}) as runner:
        y = runner.run(GraphKind.PREFILL, {"x": x})["y"]
    assert len(sessions) == 1, sessions
    assert not sessions[0].get_session_options().enable_cpu_mem_arena, "parity's session has no CPU arena"
    np.testing.assert_allclose(y, x @ weight, rtol=1e-5, atol=1e-5, err_msg="the run's output is x @ w")
