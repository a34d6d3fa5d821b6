"""Precision variants: every one is an ONNX graph that carries its own types (docs/precisions.md)."""

from __future__ import annotations

from kiln.exporter.precision.fp16 import Fp16Result, convert_to_fp16
from kiln.exporter.precision.policy import (
    DEFAULT_KEEP_FP32,
    Fp16Policy,
    resolve_kept_nodes,
)

__all__ = ["DEFAULT_KEEP_FP32", "Fp16Policy", "Fp16Result", "convert_to_fp16", "resolve_kept_nodes"]
