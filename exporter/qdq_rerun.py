"""``kiln check``'s Q/DQ numbers: an int8 or fp8 export's calibration run again on the checkpoint (issue 40).

An int8 or fp8 export is proved on the scales its calibration made (``qdq_spill``), which the
export does not keep (its ``calibration/*.trt-calibration.cache`` holds TensorRT's ``amax / 127``,
and read back from the graphs being judged they would prove nothing). ``kiln check`` makes them
again as the export made them: the options the manifest records (``export.calibration``: the data,
its sha256 and the settings; ``export.quantization.options``: the kind's own, its keep-float
rules), the same calibration (``calibrate``, never the ranges cache) on the same fp32 graphs,
traced again in memory (the calibrator's own copy goes to a temporary directory, never into the
export), and the kind's own pass on each, which leaves the scales in its sink before it quantizes.
Every Q/DQ graph set is then checked against them bit for bit (``qdq_spill.proved_qdq_numbers``)
and parity judges the graphs against PyTorch with them (``parity.qdq_model``), as the export did.

The data is read only where ``check_calibration`` allows: the file the user passes with
``--calib-data`` (its token windows hashing as recorded), ``synthetic``, or the bundled demo text;
never the path the manifest records. Where the calibration cannot run again, ``QdqRerun.reason`` says
why in one line and ``kiln check`` judges the export against the checkpoint's model only, as before: a
manifest without the record (an export of an earlier kiln), no ``--calib-data`` given (the line says
which data to pass), settings this kiln calibrates with otherwise, weights merged with ``--adapter``,
or quantized MatMuls that the Q/DQ model does not model (``precision.qdq_scales``: the export had no
such proof either).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.exporter.artifacts.manifest import Manifest, graph_options
from kiln.exporter.calibrate import graph_ranges, prepare_calibration, weights_identity
from kiln.exporter.check_calibration import Recorded, Skip, rerun_source
from kiln.exporter.contract.io import graph_kinds
from kiln.exporter.fold import fold
from kiln.exporter.graphs import fp32_graph, precision_context
from kiln.exporter.load import Reference
from kiln.exporter.options import CalibrationOptions, ExportOptions
from kiln.exporter.parity.qdq_numbers import NUMBERS_FILE, QdqNumbers
from kiln.exporter.passes import run_passes
from kiln.exporter.precision.kinds.base import Needs, with_kind_options
from kiln.exporter.precision.kinds.plan import Precision
from kiln.exporter.precision.qdq_scales import qdq_sink
from kiln.exporter.progress import Progress
from kiln.exporter.qdq_spill import proved_qdq_numbers
from kiln.exporter.runners.device import CPU, on
from kiln.exporter.trace import trace_unified

__all__ = ["QdqRerun", "rerun_calibration", "checked_qdq_numbers"]

_SETTINGS = {"method", "percentile", "samples", "window"}  # what the rerun reads of export.calibration.settings


@dataclasses.dataclass(frozen=True)
class QdqRerun:
    """The numbers the calibration made again (in the graphs' float type), or why it could not run."""

    numbers: QdqNumbers | None
    reason: str | None = None


def checked_qdq_numbers(
    directory: Path,
    manifest: Manifest,
    reference: Reference,
    spill: Path,
    progress: Progress,
    calib_data: Path | None = None,
) -> QdqNumbers | None:
    """An int8 or fp8 export's numbers made again over ``calib_data`` (``kiln check --calib-data``),
    once every Q/DQ graph set holds them bit for bit (else a ``ParityError`` naming the first that
    differs); None for another precision, or where the calibration cannot run again (one line says why)."""
    precision = Precision.parse(manifest.precision)
    if not precision.needs(Needs.RANGES):
        return None
    with on(CPU):  # where the export calibrated (outside parity's device): the same ranges, bit for bit
        rerun = rerun_calibration(manifest, reference, progress, calib_data)
    if rerun.numbers is None:
        progress.note(
            f"{manifest.precision}: the calibration cannot run again: {rerun.reason}; judged against the "
            "checkpoint's model only (a scale changed in the graphs is not caught)"
        )
        return None
    portable = {kind: directory / entry.file for kind, entry in manifest.graphs.items()}
    sets = [("portable", portable)]
    for name, entry in (manifest.targets or {}).items():  # the targets' graphs of the same Q/DQ
        if entry.precision == manifest.precision:
            sets.append((name, {kind: directory / graph.file for kind, graph in entry.graphs.items()}))
    with progress.stage(f"check: {rerun.numbers.form} Q/DQ scales against the calibration, run again"):
        return proved_qdq_numbers(
            rerun.numbers,
            spill / NUMBERS_FILE,
            sets,
            f"{directory}: Q/DQ differ from the calibration's numbers (run again on the checkpoint)",
        )


def rerun_calibration(
    manifest: Manifest, reference: Reference, progress: Progress, calib_data: Path | None = None
) -> QdqRerun:
    """The export's calibration and its Q/DQ kind's pass run again on ``reference`` (the
    checkpoint's module as check built it) over ``calib_data`` (``check_calibration.rerun_source``),
    or why they cannot."""
    found = _options(manifest)
    if isinstance(found, str):
        return QdqRerun(None, found)
    options, record = found
    settings = record["settings"]
    recorded = Recorded(
        str(record["source"]), str(record["data_sha256"]), int(settings["samples"]), int(settings["window"])
    )
    source = rerun_source(recorded, calib_data, reference.loaded)
    if isinstance(source, Skip):
        return QdqRerun(None, source.reason)
    options = dataclasses.replace(options, calibration=dataclasses.replace(options.calibration, data=source))
    calibration = prepare_calibration(
        reference,
        options,
        lambda: weights_identity(
            manifest.checkpoint.files, [(a.files, a.weight) for a in manifest.checkpoint.adapters or ()]
        ),
        progress,
    )
    assert calibration is not None, "a precision that needs ranges is calibrated"
    if calibration.data.sha256 != record["data_sha256"]:
        return QdqRerun(
            None,
            f"its calibration data {options.calibration.data} gives other token windows than the export's "
            "(sha256 differs)",
        )
    if calibration.settings != record["settings"]:
        changed = sorted(k for k in calibration.settings if calibration.settings[k] != record["settings"].get(k))
        return QdqRerun(None, f"this kiln calibrates with other settings ({', '.join(changed)}) than the export's")
    folded = fold(reference.module, reference.loaded.ple)
    traced = trace_unified(reference, folded, options, progress)
    context = precision_context(
        reference, folded, options, traced, graph_ranges(reference, options, calibration, progress), progress
    )
    prepared = next(k for k in options.precision.kinds if k.needs() is Needs.RANGES).prepare(context)
    for kind in graph_kinds(reference.spec):  # the kind's own pass: it leaves the scales in its sink first
        run_passes(fp32_graph(reference, folded, options, kind, traced), prepared.passes(kind), graph=kind.value)
    sink = qdq_sink([prepared])
    made = sink.numbers() if sink is not None else None
    if made is None:
        return QdqRerun(
            None, "its quantized MatMuls are not all an activation times a constant weight, which no Q/DQ model models"
        )
    return QdqRerun(made.in_float16() if options.precision.float16 else made)


def _options(manifest: Manifest) -> tuple[ExportOptions, Mapping[str, Any]] | str:
    """The export's options as its calibration and Q/DQ kind read them (the data apart: it is not
    read where the manifest says), and its calibration record; or why the manifest does not give them."""
    record = manifest.export.calibration or {}
    if manifest.checkpoint.adapters:
        return "its weights are of the checkpoint merged with --adapter, which kiln check does not merge"
    settings = record.get("settings")
    if not isinstance(settings, dict) or not _SETTINGS <= set(settings) or not {"source", "data_sha256"} <= set(record):
        return "the manifest records no calibration settings (export.calibration)"
    recorded = (manifest.export.quantization or {}).get("options")
    kinds = [
        with_kind_options(k, recorded) if k.needs() is Needs.RANGES and isinstance(recorded, dict) else k
        for k in Precision.parse(manifest.precision).kinds
    ]
    if not isinstance(recorded, dict) or any(k is None for k in kinds):
        return (
            f"the manifest records no options of its {manifest.precision} kind (export.quantization.options), "
            "which exports of an earlier kiln do not"
        )
    percentile, base = settings["percentile"], graph_options(manifest)  # a percentile: the percentile method's only
    calibration = CalibrationOptions(
        samples=int(settings["samples"]),
        method=str(settings["method"]),
        percentile=float(percentile) if percentile is not None else CalibrationOptions.percentile,
    )
    options = dataclasses.replace(
        base, precision=Precision.of(*(k for k in kinds if k is not None)), calibration=calibration
    )
    return options, record
