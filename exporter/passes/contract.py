"""Pass: the graph's I/O must be exactly the contract's (names, order, dtypes, static dims);
dynamic dims get the contract's names (the exporter names them after torch's symbols)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.errors import ExportError
from kiln.exporter.contract.io import GraphIO, GraphKind, TensorSpec

__all__ = ["ApplyContract", "apply_contract"]


def apply_contract(model: ir.Model, io_spec: GraphIO, kind: GraphKind) -> None:
    """Check names, dtypes and static dims of the graph's I/O against the contract and give
    every dynamic dim its contract name (the exporter names them after torch's symbols)."""
    graph = model.graph
    graph.name = kind.value

    def fix(values: list[ir.Value], specs: tuple[TensorSpec, ...], what: str) -> None:
        names = [v.name for v in values]
        want = [s.name for s in specs]
        if names != want:
            raise ExportError(f"{kind.value} graph {what} are {names}, the contract needs {want}")
        for value, spec in zip(values, specs, strict=True):
            dtype = ir.DataType.from_numpy(np.dtype(spec.dtype))
            if value.dtype != dtype:
                raise ExportError(
                    f"{kind.value} graph {what[:-1]} {value.name} is {value.dtype}, the contract needs {spec.dtype}"
                )
            shape = value.shape
            if shape is None or len(shape) != len(spec.dims):
                raise ExportError(
                    f"{kind.value} graph {what[:-1]} {value.name} has shape {shape}, the contract needs "
                    f"{list(spec.dims)}"
                )
            dims: list[int | str] = []
            for got, dim in zip(shape, spec.dims, strict=True):
                if isinstance(dim, int) and got != dim:
                    raise ExportError(
                        f"{kind.value} graph {what[:-1]} {value.name} has shape {shape}, the contract needs "
                        f"{list(spec.dims)}"
                    )
                dims.append(dim)
            value.shape = ir.Shape(dims)

    fix(list(graph.inputs), io_spec.inputs, "inputs")
    fix(list(graph.outputs), io_spec.outputs, "outputs")


class ApplyContract(ir.passes.InPlacePass):
    """The graph's I/O checked against the contract (``io_spec``) and its dynamic dims named."""

    def __init__(self, io_spec: GraphIO, kind: GraphKind) -> None:
        super().__init__()
        self.io_spec, self.kind = io_spec, kind

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        apply_contract(model, self.io_spec, self.kind)
        return ir.passes.PassResult(model, modified=True)
