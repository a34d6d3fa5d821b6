"""Serving artifacts written from an export's manifest: ONNX Runtime GenAI and Triton."""

from __future__ import annotations

from kiln.exporter.serving.genai import write_genai_config
from kiln.exporter.serving.triton import write_triton_repo

__all__ = ["write_genai_config", "write_triton_repo"]
