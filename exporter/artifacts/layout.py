"""Where things sit inside an export directory (docs/commands.md, kiln export)."""

from __future__ import annotations

__all__ = ["ONNX_DIR", "REPORTS_DIR", "PARITY_REPORT", "TOKENIZER", "CALIBRATION_DIR"]

ONNX_DIR = "onnx"  # the graphs, their weights files, tokenizer and genai_config.json
REPORTS_DIR = "reports"
PARITY_REPORT = f"{REPORTS_DIR}/parity.json"
TOKENIZER = f"{ONNX_DIR}/tokenizer.json"  # the checkpoint's tokenizer, copied beside the graphs
CALIBRATION_DIR = "calibration"  # int8: the legacy TensorRT calibration caches
