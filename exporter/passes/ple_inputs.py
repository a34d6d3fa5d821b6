"""Pass: turn the folded PLE tables from constants into graph inputs (``--ple-tables input``).

Serving stacks that swap position tables without rebuilding an engine feed them as inputs
``ple.{i}.scale`` / ``ple.{i}.shift``. The tables are found by content (the exporter is free to
rename initializers), so the pass cannot pick up a different tensor of the same shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
from torch import Tensor

from kiln.errors import ExportError
from kiln.exporter.contract.io import ple_table_names

__all__ = ["PleTablesToInputs", "ple_tables_to_inputs"]


def ple_tables_to_inputs(model: ir.Model, tables: Sequence[tuple[Tensor, Tensor]]) -> ir.Model:
    """Replace the initializer holding each table by a graph input, in place."""
    graph = model.graph
    by_content: dict[bytes, list[ir.Value]] = {}  # equal tables (an untrained PLE) are separate constants
    for value in graph.initializers.values():
        if value.const_value is not None and len(value.const_value.shape) == 2:
            by_content.setdefault(value.const_value.tobytes(), []).append(value)
    for i, pair in enumerate(tables):
        for name, table in zip(ple_table_names(i), pair, strict=True):
            data = np.ascontiguousarray(table.detach().numpy()).tobytes()
            candidates = by_content.get(data)
            if not candidates:
                raise ExportError(f"--ple-tables input: the folded table {name} is not a constant of the traced graph")
            found = candidates.pop(0)
            graph.initializers.pop(found.name or "")
            found.const_value = None
            found.name = name
            graph.inputs.append(found)
    return model


class PleTablesToInputs(ir.passes.InPlacePass):
    """The folded PLE tables as graph inputs (``--ple-tables input``)."""

    def __init__(self, tables: Sequence[tuple[Tensor, Tensor]]) -> None:
        super().__init__()
        self.tables = tables

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(ple_tables_to_inputs(model, self.tables), modified=bool(self.tables))
