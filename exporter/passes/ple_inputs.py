"""Pass: turn the folded PLE tables from constants into graph inputs (``--ple-tables input``).

Serving stacks that swap position tables without rebuilding an engine feed them as inputs
``ple.{i}.scale`` / ``ple.{i}.shift``. A table is found by the module tensor its initializer is
bound to (``passes.bind``), or, for a constant not bound, by content: never by name or shape, so
the pass cannot pick up a different tensor of the same shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
from torch import Tensor

from kiln.errors import ExportError
from kiln.exporter.contract.io import ple_table_names
from kiln.exporter.passes.bind import ModuleWeight

__all__ = ["PleTablesToInputs", "ple_tables_to_inputs"]


def ple_tables_to_inputs(model: ir.Model, tables: Sequence[tuple[Tensor, Tensor]]) -> ir.Model:
    """Replace the initializer holding each table by a graph input, in place."""
    graph = model.graph
    by_source = {
        id(v.const_value.module_tensor): v
        for v in graph.initializers.values()
        if isinstance(v.const_value, ModuleWeight) and not v.const_value.transforms
    }
    by_content: dict[bytes, list[ir.Value]] = {}  # equal tables (an untrained PLE) are separate constants
    for value in graph.initializers.values():
        if (
            value.const_value is not None
            and not isinstance(value.const_value, ModuleWeight)
            and len(value.const_value.shape) == 2
        ):
            by_content.setdefault(value.const_value.tobytes(), []).append(value)
    for i, pair in enumerate(tables):
        for name, table in zip(ple_table_names(i), pair, strict=True):
            found = by_source.pop(id(table), None)
            if found is None:
                candidates = by_content.get(np.ascontiguousarray(table.detach().numpy()).tobytes())
                if not candidates:
                    raise ExportError(
                        f"--ple-tables input: the folded table {name} is not a constant of the traced graph"
                    )
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
