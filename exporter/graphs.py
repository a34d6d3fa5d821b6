"""The portable graph set: from the traced unified graph (``trace``), each graph of the contract
by its passes (specialisation, the per-layer stamp, contract, precision, weights), one graph at a
time, into ``onnx/<kind>.onnx`` + one shared ``weights.bin``.

The passes of these graphs are composed here and nowhere else (``contract_passes``, then the
precision kinds' passes: ``precision.prepare``); each target composes its own in its folder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir

from kiln.exporter.contract.io import GraphIO, GraphKind, graph_io, graph_kinds
from kiln.exporter.contract.lora import LoraSlots
from kiln.exporter.fold import Folded
from kiln.exporter.load import Reference
from kiln.exporter.options import ExportOptions, PLETables
from kiln.exporter.passes import (
    ApplyContract,
    PleTablesToInputs,
    SharedWeights,
    WeightsWriter,
    run_passes,
)
from kiln.exporter.passes.ir_utils import clone
from kiln.exporter.passes.lora_slots import AddLoraSlots
from kiln.exporter.passes.reports import Report, pass_reports
from kiln.exporter.passes.specialise import specialise
from kiln.exporter.passes.stamp import StampLayers
from kiln.exporter.passes.weights import WEIGHTS_FILE
from kiln.exporter.precision.context import PrecisionContext
from kiln.exporter.precision.kinds.base import Ranges
from kiln.exporter.precision.lowbit_check import onnx_full_check
from kiln.exporter.precision.prepare import PreparedPrecision
from kiln.exporter.progress import Progress
from kiln.exporter.trace import Traced

__all__ = ["GraphRecord", "GraphSet", "contract_io", "fp32_graph", "write_portable_graphs"]


@dataclasses.dataclass(frozen=True)
class GraphRecord:
    kind: GraphKind
    path: Path
    io: GraphIO  # the graph's final I/O (the contract at its precision)
    passes: dict[str, Report] = dataclasses.field(
        default_factory=dict
    )  # what its passes report (``passes.reports``): the manifest's graphs.<kind>.passes


@dataclasses.dataclass(frozen=True)
class GraphSet:
    graphs: dict[GraphKind, GraphRecord]
    weights: SharedWeights
    lora: LoraSlots | None = None  # --lora-slots: the adapter inputs every graph takes

    @property
    def paths(self) -> dict[GraphKind, Path]:
        return {kind: record.path for kind, record in self.graphs.items()}

    @property
    def reports(self) -> dict[GraphKind, dict[str, Report]]:
        """Per graph, what its passes report."""
        return {kind: record.passes for kind, record in self.graphs.items()}


def contract_io(
    reference: Reference, folded: Folded, options: ExportOptions, kind: GraphKind, kv_dtype: str = "float32"
) -> GraphIO:
    tables = folded.table_shapes if options.ple.tables is PLETables.INPUT else ()
    return graph_io(
        reference.spec, kind, last_logits_only=options.graphs.last_logits_only, ple_tables=tables, kv_dtype=kv_dtype
    )


def contract_passes(
    reference: Reference, folded: Folded, options: ExportOptions, kind: GraphKind, traced: Traced
) -> list[ir.passes.PassBase]:
    """A traced graph -> the fp32 graph of ``kind`` in the contract (derived from the unified
    graph when ``kind`` was not traced itself)."""
    derive = specialise(kind, options.graphs.last_logits_only) if kind not in traced.graphs else []
    stamp = [StampLayers(traced.stamp)] if traced.stamp is not None else []
    tables = [PleTablesToInputs(folded.tables)] if options.ple.tables is PLETables.INPUT else []
    return [*derive, *stamp, *tables, ApplyContract(contract_io(reference, folded, options, kind), kind)]


def fp32_graph(
    reference: Reference, folded: Folded, options: ExportOptions, kind: GraphKind, traced: Traced
) -> ir.Model:
    """The fp32 graph of ``kind``, with the contract's I/O (a new model: ``traced`` is kept)."""
    source = traced.graphs.get(kind, traced.model)
    return run_passes(clone(source), contract_passes(reference, folded, options, kind, traced), graph=kind.value)


def write_portable_graphs(
    reference: Reference,
    folded: Folded,
    options: ExportOptions,
    traced: Traced,
    precision: PreparedPrecision,
    onnx_dir: Path,
    progress: Progress,
    lora: LoraSlots | None = None,
) -> GraphSet:
    """Every graph of the contract, one at a time: derive it, pass it, move its weights into the
    shared file, save, drop (so at most one graph's weight being written is in memory). The
    first graph reads and writes every weight; the others find theirs already written."""
    records: dict[GraphKind, GraphRecord] = {}
    final_dtype = precision.precision.kv_dtype
    with WeightsWriter(onnx_dir / WEIGHTS_FILE, rename=True) as writer:
        for kind in graph_kinds(reference.spec):
            path = onnx_dir / f"{kind.value}.onnx"
            passes = [*precision.passes(kind), *([AddLoraSlots(lora)] if lora is not None else [])]
            with progress.stage(f"{path.name}: graph passes"):
                model = run_passes(fp32_graph(reference, folded, options, kind, traced), passes, graph=kind.value)
            with progress.stage(f"{path.name}: weights", total=len(writer.pending(model))) as bar:
                writer.externalize(model, bar.advance)
                ir.save(model, path)
            del model
            records[kind] = GraphRecord(
                kind, path, contract_io(reference, folded, options, kind, final_dtype), pass_reports(passes)
            )
        weights = writer.close()
    if precision.precision.full_check:
        with progress.stage("low-bit graphs: onnx.checker (full check)"):
            for record in records.values():
                onnx_full_check(record.path)
    return GraphSet(records, weights, lora)


def precision_context(
    reference: Reference,
    folded: Folded,
    options: ExportOptions,
    traced: Traced,
    ranges: Callable[[GraphKind, ir.Model], Ranges] | None,
    progress: Progress,
) -> PrecisionContext:
    """What the precision kinds are prepared from: the reference, the calibrated ``ranges`` (None: no
    kind reads them), and this module's contract I/O and fp32 graphs of ``traced``, handed down as
    callables (``precision`` imports nothing of the graph stage). The export's and ``kiln check``'s
    Q/DQ rerun (``qdq_rerun``) build it the same way."""
    return PrecisionContext(
        reference,
        options,
        progress,
        ranges,
        lambda kind, kv_dtype: contract_io(reference, folded, options, kind, kv_dtype),
        lambda kind: fp32_graph(reference, folded, options, kind, traced),
    )
