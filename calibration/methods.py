"""Activation ranges from ONNX Runtime's calibrators (max, percentile, entropy), and an MSE
threshold computed on ONNX Runtime's own histograms.

ONNX Runtime has no MSE calibrator, so ``mse`` is the one observer written here: it collects
absolute-value histograms with ``PercentileCalibrater`` and picks, per tensor, the clipping
threshold ``t`` that minimises the expected squared error of symmetric int8 quantization,
``sum_bins count * err(v, t)`` with ``err = (v - t)^2`` above ``t`` (clipping) and
``(t / 127)^2 / 12`` below it (rounding).
"""

from __future__ import annotations

import contextlib
import enum
import io
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

__all__ = ["CalibMethod", "collect_ranges", "mse_threshold"]

Feeds = dict[str, np.ndarray]


class CalibMethod(str, enum.Enum):
    MAX = "max"
    PERCENTILE = "percentile"
    ENTROPY = "entropy"
    MSE = "mse"


def mse_threshold(hist: np.ndarray, edges: np.ndarray) -> float:
    """The threshold (a histogram edge) minimising expected int8 quantization MSE."""
    centers = (edges[:-1] + edges[1:]) / 2
    best_t, best_err = float(edges[-1]), float("inf")
    for t in edges[1:]:
        t = float(t)
        if t <= 0:
            continue
        clip = np.clip(centers - t, 0, None)
        err = float((hist * np.where(centers > t, clip**2, (t / 127.0) ** 2 / 12.0)).sum())
        if err < best_err:
            best_t, best_err = t, err
    return best_t


class _Reader:
    """ONNX Runtime's CalibrationDataReader protocol over a list of feeds."""

    def __init__(self, feeds: Iterable[Feeds]) -> None:
        self._it: Iterator[Feeds] = iter(list(feeds))

    def get_next(self) -> Feeds | None:
        return next(self._it, None)


def collect_ranges(
    model: ir.Model, samples: Iterable[list[Feeds]], method: CalibMethod, percentile: float
) -> dict[str, tuple[float, float]]:
    """Symmetric ranges ``(-a, a)`` of the activations around every MatMul/Gemm of ``model``,
    over the feeds of every sample (a calibration window's prefill and decode steps). Samples are
    run one at a time (ONNX Runtime's calibrators merge their statistics across calls), so only one
    sample's activations are held, and a lazy ``samples`` can report progress as it is drawn."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, PercentileCalibrater, create_calibrator

    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        path = Path(tmp) / "model.onnx"
        ir.save(model, path, external_data="model.onnx.data")
        augmented = str(Path(tmp) / "augmented.onnx")
        if method is CalibMethod.MSE:
            calibrator = PercentileCalibrater(
                path, ["MatMul", "Gemm"], augmented, True, method="percentile", symmetric=True, num_bins=2048
            )
            calibrator.augment_graph()
            calibrator.create_inference_session()
        else:
            kind = {
                CalibMethod.MAX: CalibrationMethod.MinMax,
                CalibMethod.PERCENTILE: CalibrationMethod.Percentile,
                CalibMethod.ENTROPY: CalibrationMethod.Entropy,
            }[method]
            extra = (
                {"symmetric": True, "percentile": percentile}
                if method is CalibMethod.PERCENTILE
                else {"symmetric": True}
            )
            calibrator = create_calibrator(
                path, ["MatMul", "Gemm"], augmented, kind, use_external_data_format=True, extra_options=extra
            )
        amax: dict[str, float] = {}
        for sample in samples:
            if method is CalibMethod.MAX:
                for name, a in _sample_amax(calibrator, sample).items():
                    if np.isfinite(a):  # inf: empty in this sample (an MoE expert none of its tokens reached)
                        amax[name] = max(amax.get(name, 0.0), a)
                continue
            # the histogram collectors stack one tensor's arrays from all feeds into one array,
            # which fails when prefill and decode feeds have different lengths: feed them one at
            # a time (the histograms accumulate across calls)
            for feed in sample:
                calibrator.collect_data(_Reader([feed]))
        if method is CalibMethod.MSE:
            hists = calibrator.collector.histogram_dict
            ranges = {
                name: mse_threshold(np.asarray(h[0], dtype=np.float64), np.asarray(h[1], dtype=np.float64))
                for name, h in hists.items()
            }
            return {name: (-a, a) for name, a in ranges.items()}
        if method is CalibMethod.MAX:
            return {name: (-a, a) for name, a in amax.items()}
        data = calibrator.compute_data()
        out = {}
        for name, tensor in data.data.items():
            lo, hi = (float(np.asarray(v).ravel()[0]) for v in tensor.range_value)
            a = max(abs(lo), abs(hi))
            out[name] = (-a, a)
        return out


def _sample_amax(calibrator: Any, sample: list[Feeds]) -> dict[str, float]:
    """One sample's largest absolute value per calibrated tensor (``MinMaxCalibrater``,
    symmetric). ONNX Runtime merges each ``collect_data`` call's ranges into the ones before by
    min/max, and a tensor that was empty throughout a call (an MoE expert's input that no token
    of the sample was routed to: ReduceMin of nothing is inf) gets the range (-inf, inf), which
    then stays whatever the other samples saw; so kiln takes each call's ranges and merges the
    finite ones itself (the same numbers where no tensor is ever empty)."""
    calibrator.collect_data(_Reader(sample))
    ranges, calibrator.calibrate_tensors_range = calibrator.calibrate_tensors_range, None
    return {
        name: max(abs(float(np.asarray(v).ravel()[0])) for v in tensor.range_value)
        for name, tensor in ranges.data.items()
    }
