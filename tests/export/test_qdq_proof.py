"""--int8 and --fp8's proof built apart from the graphs (issue 40): the scales kiln made from the
calibrator's ranges (``exporter/precision/qdq_scales.py``), every graph's Q/DQ checked bit for bit
against them (``exporter/parity/qdq_proof.py``), and PyTorch with them applied as the Q/DQ apply
them (``exporter/parity/qdq_model.py``). The faults are made in kiln's own int8 pass, after ONNX
Runtime's quantizer wrote the graph."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from kiln.errors import ParityError
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.parity.qdq_numbers import NUMBERS_FILE, QdqModule, QdqNumbers, read_qdq_numbers, write_qdq_numbers
from kiln.exporter.pipeline import export
from kiln.exporter.precision import int8
from kiln.exporter.precision.qdq_scales import int8_scale
from kiln_testing import tiny_config, write_checkpoint

_MATMUL = "/layers.0.attn.k_proj/MatMul"
_FC2 = "/layers.0.mlp.fc2/MatMul"


def _options(precision: Precision) -> ExportOptions:
    return ExportOptions.from_flags(precision=precision, calib_data="synthetic", calib_samples=2, parity_tokens=8)


@pytest.mark.parametrize("precision", [Precision.INT8, Precision.FP8], ids=["int8", "fp8"])
def test_correct_qdq_graphs_are_proved_on_the_calibration_numbers(tmp_path: Path, precision: Precision) -> None:
    """Every graph's scales are kiln's own, bit for bit, and every graph set passes against the
    Q/DQ model with every greedy token its argmax or a tie; the spill file is gone."""
    out = tmp_path / "out"
    export(write_checkpoint(tmp_path / "ckpt", tiny_config()), out, _options(precision))
    report = json.loads((out / "reports" / "parity.json").read_text())
    quantized = report["quantized"]
    assert quantized is not None and quantized["passed"], quantized
    assert quantized["generation"] and all(g["passed"] for g in quantized["generation"]), quantized["generation"]
    assert not any(p.name == NUMBERS_FILE for p in out.rglob("*"))


def _after_quantizing(edit: Callable[[ir.Model], None]) -> Callable[..., tuple[ir.Model, list[str]]]:
    """``precision.int8.quantize_int8`` with ``edit`` applied to the graph ONNX Runtime's quantizer wrote."""
    quantize = int8.quantize_int8

    def edited(
        model: ir.Model, ranges: dict[str, tuple[float, float]], policy: int8.KeepFloat
    ) -> tuple[ir.Model, list[str]]:
        quantized, targets = quantize(model, ranges, policy)
        edit(quantized)
        return quantized, targets

    return edited


def _node(model: ir.Model, name: str) -> ir.Node:
    return next(n for n in model.graph if n.name == name)


def _drop_input_pair(model: ir.Model) -> None:
    """The k_proj MatMul reads its input's float tensor, not the Q/DQ pair (q_proj and v_proj still do)."""
    matmul = _node(model, _MATMUL)
    dq = matmul.inputs[0].producer()  # type: ignore[union-attr]
    q = dq.inputs[0].producer()  # type: ignore[union-attr]
    matmul.replace_input_with(0, q.inputs[0])  # type: ignore[union-attr]


def _input_scale_off(model: ir.Model) -> None:
    """The fc2 input pair's scale (its Q and DQ share it; no other MatMul reads the pair) 10% off."""
    dq = _node(model, _FC2).inputs[0].producer()  # type: ignore[union-attr]
    scale = dq.inputs[1]  # type: ignore[union-attr]
    assert scale is not None and scale.const_value is not None
    scale.const_value = ir.tensor(
        np.asarray(scale.const_value.numpy() * np.float32(1.1), dtype=np.float32), name=scale.name
    )


def test_a_qdq_pair_dropped_from_one_matmul_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8, "quantize_int8", _after_quantizing(_drop_input_pair))
    with pytest.raises(ParityError) as err:
        export(write_checkpoint(tmp_path / "ckpt", tiny_config()), tmp_path / "out", _options(Precision.INT8))
    message = str(err.value)
    assert message.startswith(
        f"parity: {tmp_path / 'out'}: exported Q/DQ differ from the calibration's numbers: portable "
        f"prefill.onnx: {_MATMUL}: "
    ), message
    assert message.endswith(
        "its input has no QuantizeLinear -> DequantizeLinear pair, which the calibration made a scale for"
    ), message
    assert not (tmp_path / "out").exists()


def test_an_activation_scale_off_by_10_percent_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(int8, "quantize_int8", _after_quantizing(_input_scale_off))
    with pytest.raises(ParityError) as err:
        export(write_checkpoint(tmp_path / "ckpt", tiny_config()), tmp_path / "out", _options(Precision.INT8))
    message = str(err.value)
    prefix = f"exported Q/DQ differ from the calibration's numbers: portable prefill.onnx: {_FC2}: input scale "
    assert prefix in message and " where the calibration made " in message, message
    found, made = (float(part.split(" ")[0]) for part in message.split(prefix)[1].split(" where the calibration made "))
    assert found == pytest.approx(made * 1.1, rel=1e-6), message


def test_int8_scales_are_onnx_runtimes() -> None:
    """kiln's formula against ONNX Runtime's own ``compute_scale_zp``, bit for bit, on awkward ranges."""
    from onnxruntime.quantization.quant_utils import compute_scale_zp

    for amax in (np.float32(3.1), np.float32(1e-3), np.float32(7.123457), np.float32(0.0), np.float32(1e30)):
        _, scale = compute_scale_zp(np.float32(-amax), amax, np.int8(-127), np.int8(127), symmetric=True)
        assert int8_scale(np.asarray(amax)).tobytes() == np.asarray(scale, dtype=np.float32).tobytes(), amax


def test_numbers_round_trip_through_the_spill_file(tmp_path: Path) -> None:
    module = QdqModule("a", "/a/MatMul", np.float32(0.5).reshape(()), None, np.array([0.25, 2.0], dtype=np.float16))
    numbers = write_qdq_numbers(tmp_path / NUMBERS_FILE, QdqNumbers("fp8", {"prefill": {"a": module}}, float16=True))
    again = read_qdq_numbers(tmp_path / NUMBERS_FILE)
    assert again.form == "fp8" and again.float16 and numbers.graphs["prefill"]["a"].node == "/a/MatMul"
    got = again.graphs["prefill"]["a"]
    assert (
        got.input.shape == ()
        and got.output is None
        and got.weight.dtype == np.float16
        and got.weight.tolist() == [0.25, 2.0]
    )
