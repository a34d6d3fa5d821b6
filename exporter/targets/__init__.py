"""Runtime targets: copies of the portable graphs rewritten for one runtime's fused kernels,
written beside the portable graphs (never replacing them) and parity-checked the same way."""

from __future__ import annotations

from kiln.exporter.targets.ort import OrtTarget, write_ort_target

__all__ = ["OrtTarget", "write_ort_target"]
