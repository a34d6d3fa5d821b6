"""The trace stage: the folded module -> in-memory ONNX graphs of the contract."""

from __future__ import annotations

from kiln.exporter.trace.torch_export import example_inputs, trace_graph
from kiln.exporter.trace.unified import Traced, trace_unified
from kiln.exporter.trace.wrapper import GraphModule

__all__ = ["GraphModule", "Traced", "example_inputs", "trace_graph", "trace_unified"]
