"""Parity runs an int8 Q/DQ graph as written (``runners.ort_runner``: ``qdq_as_written``): each
DequantizeLinear, then the float MatMul, as TensorRT computes it, not ONNX Runtime's CPU fusion
into ``QLinearMatMul`` over uint8 activations (on x86 CPUs without VNNI its products saturate:
measured 0.38 off on a tiny model's logits). The graph here has activations and weights at the
ends of int8's range, where that fusion's pairwise uint8 x int8 sums pass int16's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.runners import OrtRunner, ort_runner

K, N = 256, 8


def _qdq_matmul(path: Path, weight: np.ndarray, x_scale: float, w_scale: np.ndarray) -> None:
    """y = DQ(Q(x)) @ DQ(W): activations per tensor, weights per output channel, int8, zero points 0."""
    inits = [
        numpy_helper.from_array(weight, "w_q"),
        numpy_helper.from_array(w_scale.astype(np.float32), "w_scale"),
        numpy_helper.from_array(np.zeros(N, np.int8), "w_zero"),
        numpy_helper.from_array(np.array(x_scale, np.float32), "x_scale"),
        numpy_helper.from_array(np.array(0, np.int8), "x_zero"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["input_ids_f", "x_scale", "x_zero"], ["x_q"], name="/q"),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"], name="/dq"),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w_dq"], axis=1, name="/w_dq"),
        helper.make_node("MatMul", ["x_dq", "w_dq"], ["logits"], name="/MatMul"),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("input_ids_f", TensorProto.FLOAT, [4, K])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, N])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=10), path)


def test_int8_qdq_graphs_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner asks for the graph as written, and gets the exact products (on a CPU with VNNI,
    ONNX Runtime's default session computes them exactly too; on this one it is 0.3 off)."""
    asked: list[dict[str, Any]] = []
    real = ort_runner.ort_session

    def recording(model: Path, **kwargs: Any) -> Any:
        asked.append(kwargs)
        session = real(model, **kwargs)
        assert session.get_session_options().get_session_config_entry("session.disable_quant_qdq") == "1"
        return session

    monkeypatch.setattr(ort_runner, "ort_session", recording)
    rng = np.random.default_rng(0)
    weight = rng.choice(np.array([-127, 127], np.int8), size=(K, N))  # the range's ends
    w_scale = rng.uniform(0.01, 0.02, N).astype(np.float32)
    x_scale = 0.05
    x = (rng.choice([-1.0, 1.0], size=(4, K)) * 127 * x_scale).astype(np.float32)  # quantizes to +-127 exactly
    path = tmp_path / "qdq.onnx"
    _qdq_matmul(path, weight, x_scale, w_scale)
    exact = (np.round(x / x_scale).clip(-128, 127) * x_scale) @ (weight.astype(np.float32) * w_scale)
    with OrtRunner({GraphKind.DECODE: path}) as runner:
        got = runner.run(GraphKind.DECODE, {"input_ids_f": x})["logits"]
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-4)
    assert [a["qdq_as_written"] for a in asked] == [True]
