"""Runners: one small interface over every backend that executes kiln's graphs.

A runner executes one graph of the contract on a feed dict of numpy arrays and returns its
outputs by name. ``TorchRunner`` runs the PyTorch model itself (the reference);
``OrtRunner`` runs the exported ONNX files through polygraphy's ONNX Runtime runner;
``RecordingRunner`` records another runner's outputs and replays them. The parity code drives
any runner the same way, so a TensorRT runner (``engine.TrtRunner``) drops in beside them.

The names are imported on first use: ``ort_session`` must not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kiln.exporter.runners.base import Feeds, Runner

if TYPE_CHECKING:
    from kiln.exporter.runners.ort_runner import OrtRunner, ort_session
    from kiln.exporter.runners.recording import RecordingRunner
    from kiln.exporter.runners.torch_runner import TorchRunner

__all__ = ["Feeds", "Runner", "TorchRunner", "OrtRunner", "RecordingRunner", "ort_session"]

_LAZY = {
    "TorchRunner": "torch_runner",
    "OrtRunner": "ort_runner",
    "ort_session": "ort_runner",
    "RecordingRunner": "recording",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
