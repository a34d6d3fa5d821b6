"""``kiln check DIR``: parity of an export directory's graphs (or engines) against its checkpoint."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from kiln.errors import ArtifactError, CheckpointError, ConfigError
from kiln.exporter.artifacts.hashing import sha256_file
from kiln.exporter.artifacts.manifest import Manifest, graph_options
from kiln.exporter.artifacts.verify import require_verified
from kiln.exporter.candidates import candidate, qdq_tolerance
from kiln.exporter.check_calibration import refuse_unread
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.fold import fold, table_feeds
from kiln.exporter.int4.proof import NUMBERS_FILE, proved_numbers, quantizer_model
from kiln.exporter.int4.rerun import rerun_quantizer
from kiln.exporter.load import Reference, adapter_reference, prepare_reference, read_adapters
from kiln.exporter.lora.adapter_file import swapped_adapter
from kiln.exporter.options import ExportOptions, PLETables
from kiln.exporter.parity import (
    Candidate,
    ParityResult,
    ParitySettings,
    QuantizedModel,
    check_parity,
    quantized_model,
)
from kiln.exporter.parity.quality import QualityPlan
from kiln.exporter.pipeline import release_weights
from kiln.exporter.precision.kinds.plan import Precision
from kiln.exporter.progress import NullProgress, Progress
from kiln.exporter.qdq_rerun import checked_qdq_numbers
from kiln.exporter.qdq_spill import qdq_model
from kiln.exporter.quality_gate import check_quality
from kiln.exporter.runners import Feeds, OrtRunner
from kiln.exporter.runners.device import ParityDevice, on, resolve
from kiln.exporter.targets import PORTABLE, target
from kiln.plugins import LoadedModel, load_model

if TYPE_CHECKING:
    from kiln.plugins.hf.adapter import LoraAdapter

__all__ = ["check_dir"]


def check_dir(
    directory: Path,
    model: str | Path | None = None,
    progress: Progress | None = None,
    backend: str = "onnxruntime",
    adapter: Path | None = None,
    parity_device: str = "cpu",
    calib_data: Path | None = None,
) -> ParityResult:
    """Re-run parity on an export directory against its checkpoint (or ``model``), on ONNX
    Runtime (the ONNX graphs) or TensorRT (``backend="tensorrt"``: the engines of ``kiln build``,
    refused when built by another TensorRT version or for another compute capability). With
    ``adapter`` (a PEFT adapter directory; an export with ``--lora-slots``): the graphs fed that
    adapter's slot tensors, against PEFT's model of the checkpoint and the adapter. ``parity_device``
    (auto, cpu, cuda: ``runners.device``) is where PyTorch, ONNX Runtime and a GPTQ rerun compute.
    ``calib_data``: the export's calibration data, which an int8/fp8 export's calibration and an int4
    GPTQ export's quantizer run again over (``check_calibration``: never read from the manifest's path)."""
    device = resolve(parity_device)  # cuda asked where it cannot run: refused before anything is read
    with on(device):
        return _check_dir(directory, model, progress or NullProgress(), backend, adapter, device, calib_data)


def _check_dir(
    directory: Path,
    model: str | Path | None,
    progress: Progress,
    backend: str,
    adapter: Path | None,
    device: ParityDevice,
    calib_data: Path | None,
) -> ParityResult:
    """``check_dir`` on ``device``, already set."""
    manifest = require_verified(directory)
    _refuse_backend(directory, backend, adapter)
    refuse_unread(directory, manifest, backend, calib_data)
    loaded = _checkpoint(directory, manifest, model, progress)
    # the export's graph options; every set's precision (its tolerances) is the manifest's, which
    # require_verified held to what the graphs are (their Q/DQ and dtypes: ``artifacts.claims``)
    options = graph_options(manifest)
    precision = Precision.parse(manifest.precision)  # the portable graphs' precision, parsed once
    swapped = (
        swapped_adapter(
            directory, manifest.lora, (manifest.checkpoint.reference, manifest.checkpoint.resolved), adapter
        )
        if adapter is not None
        else None
    )
    adapters = _reference_adapters(directory, manifest, loaded, model, swapped)

    def build(loaded: LoadedModel) -> nn.Module:
        return adapter_reference(loaded, adapters) if adapters is not None else prepare_reference(loaded, options)

    with tempfile.TemporaryDirectory(prefix="kiln-check-") as spill:  # the int4 numbers, removed once read
        # before the reference is built: an adapter's PEFT model changes the checkpoint's modules in place
        quantized = _quantized(directory, manifest, precision, loaded, Path(spill), progress, calib_data)
        reference = build(loaded)
        # int8, fp8: the calibration run again on the checkpoint's module as built (its PLE tables extended once)
        qdq = (
            checked_qdq_numbers(
                directory,
                manifest,
                Reference(loaded, reference, manifest.limits.max_context),
                Path(spill),
                progress,
                calib_data,
            )
            if backend == "onnxruntime"
            else None
        )
        quantized = quantized or qdq_model(qdq, manifest.parity.agreement != "record")
        extra = _extra_feeds(options, reference, loaded, precision, swapped)
        assert options.graphs.max_context is not None, "an export's manifest records its context"
        settings = ParitySettings(
            options.graphs.max_context,
            options.graphs.max_batch,
            options.parity.tokens,
            options.graphs.last_logits_only,
            device=device,
        )
        quality = _quality(loaded, manifest, backend, options.graphs.last_logits_only, options.graphs.max_context)
        candidates = _candidates(directory, manifest, precision, backend, extra, qdq is not None)
        # the model is freed while the graphs run unless parity.memory keeps it, then loaded again (check_parity)
        return check_parity(
            reference, loaded.spec, candidates, settings, progress=progress, quantized=quantized, quality=quality,
            release_reference=release_weights(reference), reload_reference=lambda: build(load_model(loaded.source)),
        )  # fmt: skip


def _refuse_backend(directory: Path, backend: str, adapter: Path | None) -> None:
    """Before anything is loaded: an adapter is checked on ONNX Runtime only, and TensorRT needs
    the engines to be there."""
    if adapter is not None and backend != "onnxruntime":
        raise ConfigError(
            "--adapter: adapters are checked on ONNX Runtime only (kiln build's engines take the slot inputs, "
            "but feeding them an adapter has not run on a GPU yet)"
        )
    if backend == "tensorrt":
        from kiln.exporter.engine.records import read_records

        read_records(directory)


def _reference_adapters(
    directory: Path,
    manifest: Manifest,
    loaded: LoadedModel,
    model: str | Path | None,
    swapped: tuple[LoraAdapter, Feeds] | None,
) -> tuple[LoraAdapter, ...] | None:
    """With adapters, PEFT's model of the checkpoint and these is the reference, as the export's
    parity had: the ``--adapter`` swapped in, else the adapters the manifest records; None without."""
    if swapped is not None:
        return (swapped[0],)
    return _adapters(directory, manifest, loaded, model) if manifest.checkpoint.adapters else None


def _extra_feeds(
    options: ExportOptions,
    reference: nn.Module,
    loaded: LoadedModel,
    precision: Precision,
    swapped: tuple[LoraAdapter, Feeds] | None,
) -> Feeds | None:
    """What the graphs take beside the contract's inputs: the swapped adapter's slot tensors, and
    the folded PLE tables of a ``--ple-tables input`` export (in the KV cache's dtype)."""
    extra: Feeds | None = dict(swapped[1]) if swapped is not None else None
    if options.ple.tables is PLETables.INPUT:
        extra = {**(extra or {}), **table_feeds(list(fold(reference, loaded.ple).tables), precision.kv_dtype)}
    return extra


def _quantized(
    directory: Path,
    manifest: Manifest,
    precision: Precision,
    loaded: LoadedModel,
    spill: Path,
    progress: Progress,
    calib_data: Path | None,
) -> QuantizedModel | None:
    """A weight-only int4 export: its proof made again, apart from the graphs it judges. The
    quantizer runs again on the checkpoint with the export's recorded options (``int4.rerun``),
    every graph set's int4 weights are checked bit for bit against its numbers (the first that
    differs refused by name) and PyTorch computes on them (``int4.proof``, as the export's
    proof), its agreement gating as the export chose. Where the quantizer cannot run again (one
    line says why) the numbers are read back from the portable graphs, as before issue 40.

    An int8 or fp8 export's proof is made again after the reference is built (``qdq_rerun``: its
    calibration run again on the checkpoint)."""
    if precision.weight_only_float is None:
        return None
    gate, portable = manifest.parity.agreement != "record", _portable_paths(directory, manifest)
    rerun = rerun_quantizer(manifest, loaded, progress, calib_data)
    if rerun.quantizer is None:
        progress.note(
            f"int4: the quantizer cannot run again: {rerun.reason}; judged against the int4 numbers read back from "
            "the graphs (a number changed in them is not caught)"
        )
        return quantized_model(portable.values(), gate)
    sets = [("portable", list(portable.values()))]
    for name, entry in (manifest.targets or {}).items():
        sets.append((name, [directory / graph.file for graph in entry.graphs.values()]))
    with progress.stage("check: int4 weights against the quantizer's numbers, run again on the checkpoint"):
        numbers = proved_numbers(
            spill / NUMBERS_FILE,
            rerun.quantizer.placed_numbers(),
            sets,
            f"{directory}: int4 weights differ from the quantizer's numbers (run again on the checkpoint)",
        )
    return quantizer_model(numbers, gate)


def _quality(
    loaded: LoadedModel, manifest: Manifest, backend: str, last_logits_only: bool, max_context: int
) -> QualityPlan:
    """The quality measure of ``kiln check`` (``quality_gate.check_quality``), gated at the
    threshold the export recorded, on the graph set it measured (``quality.graphs``: a target's
    where only that target's graphs are quantized, ``--ort-int8``; the engines on TensorRT)."""
    recorded = manifest.parity.quality
    threshold = recorded.threshold if recorded is not None else None
    measured = recorded.graphs if recorded is not None and backend == "onnxruntime" else None
    written = manifest.targets or {}
    target_name = measured if measured is not None and measured != PORTABLE and measured in written else None
    precision = written[target_name].precision if target_name is not None else manifest.precision
    plan = check_quality(loaded, loaded.spec, precision, threshold, last_logits_only, max_context)
    return dataclasses.replace(plan, target=target_name)


def _checkpoint(directory: Path, manifest: Manifest, model: str | Path | None, progress: Progress) -> LoadedModel:
    """The checkpoint the manifest names (or ``model``), refused when its files changed."""
    ref = model if model is not None else manifest.checkpoint.reference
    if ref is None:
        raise ArtifactError(f"{directory}: the manifest does not name its checkpoint; pass --model")
    with progress.stage("load checkpoint"):
        loaded = _load(ref, manifest.checkpoint.resolved if model is None else None, progress)
    recorded = manifest.checkpoint.files
    found = {p.name: sha256_file(p) for p in loaded.files}
    if recorded != found:
        changed = sorted(k for k in set(recorded) | set(found) if recorded.get(k) != found.get(k))
        raise CheckpointError(f"{ref}: checkpoint files {changed} differ from the ones {directory} was exported from")
    return loaded


def _adapters(
    directory: Path, manifest: Manifest, loaded: LoadedModel, model: str | Path | None
) -> tuple[LoraAdapter, ...]:
    """The adapters the manifest records (at their path, else where it resolved when the export
    ran), refused when their files changed."""
    records = manifest.checkpoint.adapters or ()
    paths = [(Path(a.path) if Path(a.path).is_dir() else Path(a.resolved), a.weight) for a in records]
    adapters = read_adapters(loaded, paths, model if model is not None else manifest.checkpoint.reference)
    for record, adapter in zip(records, adapters, strict=True):
        if adapter.sha256 != record.files:
            changed = sorted(
                k for k in set(record.files) | set(adapter.sha256) if record.files.get(k) != adapter.sha256.get(k)
            )
            raise CheckpointError(
                f"--adapter {record.path}: adapter files {changed} differ from the ones {directory} was exported with"
            )
    return adapters


def _load(ref: str | Path, resolved: str | None, progress: Progress) -> LoadedModel:
    """The checkpoint ``ref`` names, or, when it no longer resolves here (a repo id in a shell
    with another Hugging Face cache, a relative path from another directory), the path it
    resolved to when the export ran; one line says which was used."""
    try:
        return load_model(ref)
    except CheckpointError as exc:
        if resolved is None or resolved == str(ref) or not Path(resolved).exists():
            raise
        progress.note(
            f"checkpoint: {ref} does not resolve here ({str(exc).split(': ', 2)[-1]}); using {resolved}, where "
            "it resolved when the export ran"
        )
        return load_model(resolved)


def _graph_paths(directory: Path, files: dict[GraphKind, str]) -> dict[GraphKind, Path]:
    paths = {kind: directory / file for kind, file in files.items()}
    for path in paths.values():
        if not path.is_file():
            raise ArtifactError(f"{path}: graph file missing")
    return paths


def _candidates(
    directory: Path, manifest: Manifest, portable: Precision, backend: str, extra: Feeds | None, qdq: bool = False
) -> list[Candidate]:
    """The engines (TensorRT), or the portable graphs (at ``portable``, the manifest's precision)
    and then every target's (ONNX Runtime); with ``qdq`` (the Q/DQ numbers made again) every set
    of the portable precision is judged against PyTorch with them too, as the export judged it."""
    if (
        backend == "tensorrt"
    ):  # the runner of the engines' contract: the portable graphs' or --target onnx's (static cache)
        from kiln.exporter.engine import open_engines
        from kiln.exporter.engine.records import read_records

        # the graph set the engines were built from: the portable graphs, or a target's (its name)
        graph_set = read_records(directory).get("graphs", {}).get("set", PORTABLE)
        precision = (
            portable if graph_set == PORTABLE else Precision.parse((manifest.targets or {})[graph_set].precision)
        )
        # TensorRT computes int4 weight-only MatMuls in the engine's float precision
        return [
            candidate(
                lambda: open_engines(directory, extra_feeds=extra),
                (GraphKind.PREFILL, GraphKind.DECODE),
                precision,
                precision.weight_only_judge,
            )
        ]
    graphs = _portable_paths(directory, manifest)
    candidates = [
        candidate(
            OrtRunner.opener(graphs, extra),
            tuple(graphs),
            portable,
            qdq_tolerance(portable) if qdq else portable.weight_only_judge,
            files=graphs.values(),
        )
    ]
    for name, entry in (manifest.targets or {}).items():  # each target's graphs, opened its way
        paths = _graph_paths(directory, {GraphKind(kind): graph.file for kind, graph in entry.graphs.items()})
        chosen, precision = target(name), Precision.parse(entry.precision)
        quantized = chosen.quantized_precision(precision)
        candidates.append(
            candidate(
                chosen.runner(paths, extra),
                tuple(paths),
                precision,
                qdq_tolerance(precision)
                if qdq and quantized is None and precision.value == portable.value
                else quantized,
                name,
                files=paths.values(),
            )
        )
    return candidates


def _portable_paths(directory: Path, manifest: Manifest) -> dict[GraphKind, Path]:
    return _graph_paths(directory, {GraphKind(kind): entry.file for kind, entry in manifest.graphs.items()})
