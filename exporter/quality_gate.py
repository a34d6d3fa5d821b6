"""Quantization quality in ``kiln export``: which text it is measured on (``parity.quality_text``'s
order), the agreement that gates it (``parity.quality``), and the refusal when the quantization
falls short of it, which keeps the refused export's parity reports beside the output."""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kiln.calibration.data import SYNTHETIC, load_calibration_data
from kiln.errors import ParityError
from kiln.exporter.options import ExportOptions
from kiln.exporter.parity.quality import UNQUANTIZED, QualityPlan, measures, quantized, threshold_for
from kiln.exporter.parity.quality_text import quality_text_of
from kiln.exporter.parity.report import write_parity_reports
from kiln.exporter.precision.kinds.plan import Precision
from kiln.exporter.report import ExportReport
from kiln.exporter.targets.base import TargetGraphs
from kiln.plugins import LoadedModel, demo_heldout
from kiln.plugins.base import DecoderSpec

__all__ = ["QualityError", "check_quality", "measured_graphs", "plan_quality", "refuse_quality"]


class QualityError(ParityError):
    """The quantized graphs compute their model, but the quantization costs more than the gate allows."""

    stage = "quality"


def plan_quality(loaded: LoadedModel, spec: DecoderSpec, options: ExportOptions, max_context: int) -> QualityPlan:
    """The export's quality text and gate (read now: a bad ``--eval-data`` is refused before any stage runs)."""
    calib = options.calibration.data if options.calibration.data not in (None, SYNTHETIC) else None

    def calibration_ids(tokens: int, chunk: int) -> Sequence[int]:
        assert calib is not None
        windows = load_calibration_data(
            calib, tokenizer=loaded.tokenizer, vocab_size=spec.vocab_size, samples=max(1, tokens // chunk), window=chunk
        ).windows
        return [int(t) for w in windows for t in w]

    text = quality_text_of(
        options.parity.eval_data,
        demo_heldout(loaded),
        (calib, calibration_ids, Path(calib).suffix.lower() not in (".npy", ".npz")) if calib is not None else None,
        loaded.tokenizer,
        spec.vocab_size,
        max_context,
    )
    return QualityPlan(
        text,
        threshold_for(options.precision.value, options.parity.quality_gate),
        measures(
            spec, options.graphs.last_logits_only, options.precision.value, asked=options.parity.eval_data is not None
        ),
    )


def measured_graphs(quality: QualityPlan, options: ExportOptions, written: Sequence[TargetGraphs]) -> QualityPlan:
    """``quality`` measured on the graphs that carry the export's quantization: where the portable
    graphs are of a float precision and a target wrote graphs of a low-bit one (``--target ort
    --ort-int8``: int8 target graphs beside fp32 portable ones), on that target's graphs, gated at
    its precision's threshold; else (the portable graphs quantized, e.g. ``--int4 --target ort``,
    whose target graphs hold the same int4 numbers; or nothing quantized) on the portable graphs."""
    if quantized(options.precision.value):
        return quality
    low_bit = next((graphs for graphs in written if quantized(graphs.precision.value)), None)
    if low_bit is None:
        return quality
    threshold = threshold_for(low_bit.precision.value, options.parity.quality_gate)
    note = None if quality.note == UNQUANTIZED else quality.note  # the target's graphs are quantized
    return dataclasses.replace(quality, threshold=threshold, target=low_bit.name, note=note)


def check_quality(
    loaded: LoadedModel,
    spec: DecoderSpec,
    precision: str,
    threshold: float | None,
    last_logits_only: bool,
    max_context: int,
) -> QualityPlan:
    """``kiln check``'s quality: on the demo's held-out text for the demo, else random tokens (an
    export's own real text is not recorded), gated at the ``threshold`` its manifest recorded."""
    text = quality_text_of(None, demo_heldout(loaded), None, loaded.tokenizer, spec.vocab_size, max_context)
    return QualityPlan(
        text,
        threshold if any(p in precision for p in ("int4", "int8", "fp8")) else None,
        measures(spec, last_logits_only, precision),
    )


def refuse_quality(report: ExportReport, out: Path) -> None:
    """Raise ``QualityError`` when the graphs' quality on real text is below its gate, their
    parity reports written first to a new ``<out>.refused-*`` directory beside ``out``."""
    quality = report.parity.quality
    if quality is None or quality.passed:
        return
    kept = Path(tempfile.mkdtemp(prefix=f"{out.name}.refused-", dir=out.absolute().parent))
    write_parity_reports(report.parity, kept / "reports", report.parity_extras())
    target = next((t for t in report.targets if t.name == quality.graphs), None)  # None: the portable graphs
    precision = target.precision if target is not None else report.options.precision
    ways = (
        f"the {target.name} graphs without the option that quantizes them"
        if target is not None
        else f"{_ways_out(precision)}, --fp16"
    )
    raise QualityError(
        f"{out}: the {precision.value} quantization fell short (its graphs compute the quantized model: parity "
        f"passed): {quality.figures()}; top-1 agreement {quality.agreement:.3f} is below {quality.threshold:g}. "
        f"Ways out: {ways}; or --quality-gate lower or off. Reports kept in {kept / 'reports'}"
    )


def _ways_out(precision: Precision) -> str:
    """What raises a low-bit precision's quality: its quantizing kind's own options (``PrecisionKind.ways_out``)."""
    return precision.ways_out or "other calibration data (--calib-data, --calib-method)"
