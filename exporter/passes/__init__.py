"""ONNX graph passes, one file each, applied in place to onnx-ir models."""

from __future__ import annotations

from kiln.exporter.passes.contract import apply_contract
from kiln.exporter.passes.names import name_nodes
from kiln.exporter.passes.ple_inputs import ple_tables_to_inputs

__all__ = ["apply_contract", "name_nodes", "ple_tables_to_inputs"]
