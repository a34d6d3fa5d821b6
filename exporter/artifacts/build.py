"""The manifest of a finished export, built from its ``ExportReport`` (``manifest.py`` holds the
types; this module is apart so that reading a manifest imports none of the export machinery)."""

from __future__ import annotations

from pathlib import Path

from kiln.exporter.artifacts.cache_info import CacheTensorInfo, SharedKvRead
from kiln.exporter.artifacts.layout import PARITY_REPORT, TOKENIZER
from kiln.exporter.artifacts.manifest import (
    MANIFEST_VERSION,
    AdapterRef,
    CheckpointRef,
    GraphEntry,
    KvCacheInfo,
    Limits,
    Manifest,
    ModelInfo,
    ParityInfo,
    QualityInfo,
    TargetEntry,
    TargetGraph,
    TargetWeights,
    TensorEntry,
    TextDecoderInfo,
    WeightsInfo,
    export_settings,
    tool_versions,
)
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.report import ExportReport
from kiln.exporter.targets.base import TargetGraphs
from kiln.plugins.base import DecoderSpec

__all__ = ["build_manifest", "kv_cache_info"]


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _target_graph(target: TargetGraphs, kind: GraphKind, path: Path, root: Path) -> TargetGraph:
    io = (target.io or {}).get(kind)
    own = (
        (tuple(map(TensorEntry.of, io.inputs)), tuple(map(TensorEntry.of, io.outputs)))
        if io is not None
        else (None, None)
    )
    return TargetGraph(_rel(path, root), target.passes.get(kind) or None, *own)


def _target_entry(target: TargetGraphs, root: Path) -> TargetEntry:
    """What a target wrote, as the manifest holds it: all of it the target's own data."""
    graphs = {kind.value: _target_graph(target, kind, path, root) for kind, path in target.paths.items()}
    weights = TargetWeights(_rel(target.weights.path, root), target.weights.bytes)
    return TargetEntry(
        target.precision.value, target.kv_cache.value, graphs, weights, dict(target.record) if target.record else None
    )


def _adapters(report: ExportReport) -> tuple[AdapterRef, ...] | None:
    """What the manifest records of each ``--adapter`` (none: the key is left out)."""
    refs = tuple(
        AdapterRef(str(a.path), str(a.path.absolute()), dict(a.sha256), a.weight, a.rank, a.alpha, a.rslora, a.targets)
        for a in report.adapters
    )
    return refs or None


def _text_decoder_of(spec: DecoderSpec) -> TextDecoderInfo | None:
    part = spec.text_decoder_of
    return TextDecoderInfo(part.architecture, part.prefix, part.not_exported) if part is not None else None


def kv_cache_info(spec: DecoderSpec, dtype: str) -> KvCacheInfo:
    """The cache's layout: its tensors listed only when they are not keys and values of
    ``n_kv_heads`` x ``head_dim`` (so a plain KV cache's manifest is what it always was)."""
    if spec.cache is None:
        return KvCacheInfo("BNSH", ("batch", "n_kv_heads", "seq", "head_dim"), dtype)
    tensors = tuple(
        CacheTensorInfo(i, t.suffix, t.heads, t.width, t.span.value, t.length or None) for i, t in spec.cache.tensors()
    )
    reads = tuple(SharedKvRead(layer, source) for layer, source in spec.cache.reads) or None
    return KvCacheInfo("BNSH", ("batch", "heads", "seq", "width"), dtype, spec.cache.kind, tensors, reads)


def build_manifest(report: ExportReport, root: Path) -> Manifest:
    """The manifest of the export staged in ``root`` (its ``files`` are filled in last, once
    every file is written: ``exporter.emit``)."""
    spec, options = report.spec, report.options
    graphs = {
        kind.value: GraphEntry.of(_rel(g.path, root), g.io, g.passes) for kind, g in report.portable.graphs.items()
    }
    weights = report.portable.weights
    return Manifest(
        manifest_version=MANIFEST_VERSION,
        family=spec.family,
        checkpoint=CheckpointRef(
            report.model_ref, report.checkpoint_files, spec.dtype, report.checkpoint_path, _adapters(report)
        ),
        config=spec.config,
        model=ModelInfo(
            spec.n_layers,
            spec.n_kv_heads,
            spec.head_dim,
            spec.vocab_size,
            spec.bos_token_id,
            spec.eos_token_id,
            spec.pad_token_id,
            spec.encoder_dim,
            spec.has_encoder,
            spec.decoder_start_token_id,
            _text_decoder_of(spec),
        ),
        precision=options.precision.value,
        kv_cache=kv_cache_info(spec, options.precision.kv_dtype),
        limits=Limits(options.graphs.max_batch, report.max_context),
        export=export_settings(
            options,
            trained_rows=spec.ple_positions,
            keep_fp32=report.keep_fp32,
            calibration=report.calibration,
            quantization=report.quantization,
        ),
        graphs=graphs,
        weights=WeightsInfo(_rel(weights.path, root), weights.tensors, weights.bytes),
        tokenizer=TOKENIZER if report.tokenizer is not None else None,
        parity=ParityInfo(
            report.parity.passed,
            PARITY_REPORT,
            options.parity.agreement or "record" if report.parity.quantized is not None else None,
            _quality(report),
        ),
        tools=tool_versions(),
        files={},
        targets={t.name: _target_entry(t, root) for t in report.targets} or None,
        lora=report.portable.lora,
    )


def _quality(report: ExportReport) -> QualityInfo | None:
    """The manifest's record of the graphs' quality on text (None where it was not measured)."""
    q = report.parity.quality
    if q is None or q.note is not None:
        return None
    return QualityInfo(
        q.source,
        q.real,
        q.tokens,
        q.agreement,
        q.kl,
        q.perplexity_checkpoint,
        q.perplexity_graphs,
        q.judged,
        q.threshold,
        q.graphs,
    )
