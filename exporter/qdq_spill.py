"""An int8 or fp8 Q/DQ export's proof numbers, between its graphs and parity: the scales the
precision passes made (``precision.qdq_scales``) spilled to the staging directory, read back
from there, and every graph set's Q/DQ checked against them (``parity.qdq_proof``) before any
graph runs; parity's Q/DQ reference is then built on the same numbers (``parity.qdq_model``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from kiln.errors import ParityError
from kiln.exporter.graphs import GraphSet
from kiln.exporter.parity import QuantizedModel
from kiln.exporter.parity.qdq_numbers import NUMBERS_FILE, QdqNumbers, write_qdq_numbers
from kiln.exporter.parity.qdq_proof import check_graph_qdq
from kiln.exporter.precision.prepare import PreparedPrecision
from kiln.exporter.precision.qdq_scales import qdq_sink
from kiln.exporter.progress import Progress
from kiln.exporter.targets.base import TargetGraphs

__all__ = ["spill_qdq_numbers", "proved_qdq_numbers", "qdq_model"]


def spill_qdq_numbers(
    precision: PreparedPrecision,
    root: Path,
    portable: GraphSet,
    written: tuple[TargetGraphs, ...],
    out: Path,
    progress: Progress,
) -> QdqNumbers | None:
    """The numbers, read back from their spill file (None: not a Q/DQ export, or one whose
    quantized MatMuls are not all modelled: ``precision.qdq_scales``), once every Q/DQ graph set
    (the portable graphs, and each target's of the same precision) holds them bit for bit."""
    sink = qdq_sink(precision.prepared)
    made = sink.numbers() if sink is not None else None
    if made is None:
        return None
    made = made.in_float16() if precision.precision.float16 else made
    sets = [
        ("portable", portable.paths),
        *((g.name, g.paths) for g in written if g.precision.value == precision.precision.value),
    ]
    labelled = [(label, {kind.value: p for kind, p in paths.items()}) for label, paths in sets]
    with progress.stage(f"parity: {made.form} Q/DQ scales against the calibration's"):
        return proved_qdq_numbers(
            made, root / NUMBERS_FILE, labelled, f"{out}: exported Q/DQ differ from the calibration's numbers"
        )


def proved_qdq_numbers(
    made: QdqNumbers, path: Path, sets: Sequence[tuple[str, Mapping[str, Path]]], refused: str
) -> QdqNumbers:
    """``made`` spilled to ``path`` and read back (what parity is built on is what the file held),
    once every graph of ``sets`` (a label, its graphs' paths by graph kind) holds them bit for bit;
    else a ``ParityError``: ``refused``, then the first difference."""
    numbers = write_qdq_numbers(path, made)
    path.unlink()  # read back whole: the file is not needed again
    failure = check_graph_qdq(numbers, sets)
    if failure is not None:
        raise ParityError(f"{refused}: {failure}")
    return numbers


def qdq_model(numbers: QdqNumbers | None, agreement_gates: bool) -> QuantizedModel | None:
    """Parity's second reference of a Q/DQ export (None: no numbers)."""
    return QuantizedModel(agreement_gates=agreement_gates, qdq=lambda: numbers) if numbers is not None else None
