"""The manifest of a finished export, built from its ``ExportReport`` (``manifest.py`` holds the
types; this module is apart so that reading a manifest imports none of the export machinery)."""

from __future__ import annotations

from pathlib import Path

from kiln.exporter.artifacts.layout import PARITY_REPORT, TOKENIZER
from kiln.exporter.artifacts.manifest import (
    MANIFEST_VERSION,
    CheckpointRef,
    GraphEntry,
    KvCacheInfo,
    Limits,
    Manifest,
    ModelInfo,
    ParityInfo,
    TargetEntry,
    TargetWeights,
    WeightsInfo,
    export_settings,
    tool_versions,
)
from kiln.exporter.report import ExportReport
from kiln.exporter.targets.ort import INT8_FORMAT, OrtTarget
from kiln.exporter.targets.ort.int4 import INT4_FORMAT

__all__ = ["build_manifest"]


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _ort_entry(target: OrtTarget, root: Path, int4: dict[str, object] | None) -> TargetEntry:
    graphs = {kind.value: entry for kind, entry in target.graphs.items()}
    int8 = dict(INT8_FORMAT) if target.precision == "int8" else None
    return TargetEntry(target.precision, int8, graphs, TargetWeights(_rel(target.weights.path, root), target.weights.bytes), int4)


def _ort_int4(report: ExportReport) -> dict[str, object] | None:
    if report.ort is None or report.ort.precision != "int4" or report.quantization is None:
        return None
    return INT4_FORMAT(int(report.quantization["block_size"]))


def build_manifest(report: ExportReport, root: Path) -> Manifest:
    """The manifest of the export staged in ``root`` (its ``files`` are filled in last, once
    every file is written: ``artifacts.export_dir``)."""
    spec, options = report.spec, report.options
    graphs = {
        kind.value: GraphEntry.of(
            _rel(g.path, root), g.io, int8_nodes=g.int8_nodes, int4_nodes=g.int4_nodes, fp8_nodes=g.fp8_nodes, fp32_nodes=g.fp32_nodes, fp32_ple_tables=g.fp32_tables
        )
        for kind, g in report.portable.graphs.items()
    }
    weights = report.portable.weights
    return Manifest(
        manifest_version=MANIFEST_VERSION,
        family=spec.family,
        checkpoint=CheckpointRef(report.model_ref, report.checkpoint_files, spec.dtype, report.checkpoint_path),
        config=spec.config,
        model=ModelInfo(spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.vocab_size, spec.bos_token_id, spec.eos_token_id, spec.pad_token_id, spec.encoder_dim, spec.has_encoder, spec.decoder_start_token_id),
        precision=options.precision.value,
        kv_cache=KvCacheInfo("BNSH", ("batch", "n_kv_heads", "seq", "head_dim"), options.precision.kv_dtype),
        limits=Limits(options.max_batch, report.max_context),
        export=export_settings(options, trained_rows=spec.ple_positions, keep_fp32=report.keep_fp32, calibration=report.calibration, quantization=report.quantization),
        graphs=graphs,
        weights=WeightsInfo(_rel(weights.path, root), weights.tensors, weights.bytes),
        tokenizer=TOKENIZER if report.tokenizer is not None else None,
        parity=ParityInfo(report.parity.passed, PARITY_REPORT),
        tools=tool_versions(),
        files={},
        targets={"ort": _ort_entry(report.ort, root, _ort_int4(report))} if report.ort is not None else None,
    )
