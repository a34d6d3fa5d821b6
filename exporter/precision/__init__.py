"""Precision variants: every one is an ONNX graph that carries its own types (docs/precisions.md).

An export's precision (``plan.Precision``) composes registered kinds (``kinds``: fp16, int8, fp8,
int4), each one file declaring its options, checks, passes, calibration needs, tolerances,
manifest record and GPU requirement (``base.PrecisionKind``); the passes themselves are the
modules beside them (``fp16``, ``int8``, ``int4``, ``fp8``, with ``policy`` for which nodes
stay float and ``qdq_rules``/``lowbit_check`` for what TensorRT builds).
"""

from __future__ import annotations

from kiln.exporter.precision.kinds.plan import TOLERANCES, Precision

__all__ = ["Precision", "TOLERANCES"]
