"""``export``: the chain of stages that turns a checkpoint into an export directory.

    load -> fold -> calibration -> trace -> precision kinds prepared -> graph passes
         -> target graphs -> parity -> artifacts (reports, serving configs, manifest) -> commit

The plan (``exporter.plan``) is asked once per round, the options alone, the config's structure, the
loaded model's, and passed down: the targets it names are the ones written, its context the one traced.
Every stage is a function of the one before it; the export is staged in a temporary directory
and renamed into place only when every stage has passed (``artifacts.staging``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kiln.errors import ParityError
from kiln.exporter.artifacts.hashing import HashAhead
from kiln.exporter.artifacts.layout import CALIBRATION_DIR, ONNX_DIR
from kiln.exporter.artifacts.manifest import Manifest
from kiln.exporter.artifacts.staging import refuse_held, require_replaceable, staged_output
from kiln.exporter.calibrate import graph_ranges, prepare_calibration, weights_identity
from kiln.exporter.candidates import candidate, qdq_tolerance
from kiln.exporter.emit import write_artifacts
from kiln.exporter.fold import Folded, fold, table_feeds
from kiln.exporter.graphs import (
    GraphSet,
    precision_context,
    write_portable_graphs,
)
from kiln.exporter.int4.proof import (
    NUMBERS_FILE,
    QuantizerNumbers,
    proved_numbers,
    quantizer_model,
)
from kiln.exporter.int4.quantize import int4_quantizer
from kiln.exporter.load import (
    Reference,
    adapter_reference,
    load_reference,
    lora_slots,
    merge_adapters,
    prepare_reference,
)
from kiln.exporter.options import ExportOptions, PLETables, Precision
from kiln.exporter.parity import (
    Candidate,
    ParityResult,
    ParitySettings,
    check_parity,
)
from kiln.exporter.parity.qdq_numbers import QdqNumbers
from kiln.exporter.parity.quality import QualityPlan
from kiln.exporter.parity.summary import shown_failures
from kiln.exporter.plan import ExportPlan, of_model, plan
from kiln.exporter.precision.prepare import PreparedPrecision, prepare_precision
from kiln.exporter.progress import NullProgress, Progress
from kiln.exporter.qdq_spill import qdq_model, spill_qdq_numbers
from kiln.exporter.quality_gate import measured_graphs, plan_quality, refuse_quality
from kiln.exporter.report import ExportReport
from kiln.exporter.runners import OrtRunner
from kiln.exporter.runners.device import resolve
from kiln.exporter.runners.torch_runner import drop_fp32_buffers
from kiln.exporter.targets import target
from kiln.exporter.targets.base import TargetGiven, TargetGraphs
from kiln.exporter.tolerance import Tolerance
from kiln.exporter.trace import trace_unified
from kiln.plugins import LoadedModel, config_spec, load_model, resolve_checkpoint

if TYPE_CHECKING:
    from kiln.plugins.hf.adapter import LoraAdapter

__all__ = ["ExportResult", "export", "export_loaded", "release_weights"]


@dataclasses.dataclass(frozen=True)
class ExportResult:
    out: Path
    manifest: Manifest
    parity: ParityResult
    report: ExportReport


def export(
    model: str | Path, out: Path, options: ExportOptions | ExportPlan, progress: Progress | None = None
) -> ExportResult:
    """Export the checkpoint ``model`` to ``out``; ``options`` may come planned (the CLI's: the
    options' round is not asked again)."""
    progress = progress or NullProgress()
    planned = options if isinstance(options, ExportPlan) else plan(options)  # before anything is read
    options = planned.options
    require_replaceable(
        out.absolute(), options.force, inputs=(resolve_checkpoint(model), *options.data_inputs)
    )  # before the load (checked again)
    refuse_held(
        out.absolute()
    )  # another export writing there: refused now, not after the load (its lock decides again)
    with progress.stage("load checkpoint"):
        if (spec := config_spec(model)) is not None:
            of_model(planned, spec)  # the config's structure and sizes, before any weight is read
        loaded = load_model(model)
    return export_loaded(loaded, out, planned, progress, model_ref=str(model), release_reference=True)


def _note_widening(reference: Reference, options: ExportOptions, progress: Progress) -> None:
    """A 16-bit checkpoint exported at fp32 doubles in size: one line says so, and what keeps 2 bytes."""
    if options.precision is Precision.FP32 and reference.spec.dtype in ("bfloat16", "float16"):
        progress.note(
            f"the checkpoint's weights are {reference.spec.dtype}: the fp32 graphs hold each in 4 bytes, twice "
            "the checkpoint's"
            " size (--fp16 keeps 2 bytes a weight)"
        )


def _note_text_decoder(reference: Reference, progress: Progress) -> None:
    """A multimodal checkpoint exported as its text decoder: one line says what is left out."""
    part = reference.spec.text_decoder_of
    if part is not None:
        progress.note(
            f"{part.architecture} is multimodal: exporting its text decoder ({part.prefix}) only; not exported: "
            f"{', '.join(part.not_exported)}"
            " (the graphs take token ids, no images)"
        )


def _fold(reference: Reference, loaded: LoadedModel, progress: Progress) -> Folded:
    """The PLE sub-layers folded into tables: a stage of its own only where the model has PLE."""
    if loaded.ple is None:
        return fold(reference.module, None)
    with progress.stage("fold PLE"):
        return fold(reference.module, loaded.ple)


def export_loaded(
    loaded: LoadedModel,
    out: Path,
    options: ExportOptions | ExportPlan,
    progress: Progress | None = None,
    model_ref: str | None = None,
    release_reference: bool = False,
) -> ExportResult:
    """Export ``loaded``, the plan asked with its spec (``options`` planned already: that round only).
    With ``release_reference`` (``export`` does this: it loaded the model itself) parity may free its
    weights before the graphs run and load it again from ``loaded.source`` to score their tokens, so a
    big model's weights and the runtime's never sit in memory together (``check_parity``); ``loaded``
    is unusable afterwards."""
    progress = progress or NullProgress()
    planned = of_model(options if isinstance(options, ExportPlan) else plan(options), loaded.spec)
    options = planned.options
    adapters = merge_adapters(loaded, options, model_ref)  # --adapter: before anything reads the weights
    reference = load_reference(loaded, planned)
    _note_widening(reference, options, progress)
    _note_text_decoder(reference, progress)
    inputs = (loaded.source, *loaded.files, *options.data_inputs)  # never replaced by the output, whatever --force says
    quality = plan_quality(
        loaded, reference.spec, options, reference.max_context
    )  # its text read now: a bad --eval-data refused before any stage
    needs = int(sum(p.numel() for p in reference.module.parameters()) * options.precision.min_bytes_per_weight)
    with (
        staged_output(out, options.force, inputs=inputs, note=progress.note, needs=needs) as root,
        HashAhead() as hashes,
    ):
        # the prepared precision (the int4 numbers: 3.5 GB at 8B) is gone once the graphs are
        # written: what parity needs of it is spilled to the staging directory
        staged = _write_graphs(reference, loaded, planned, root, out, progress, hashes, adapters)
        hashes.queue(staged.files())  # the graphs and weights, hashed beside parity
        parity = _parity(
            reference, options, staged, _ParityModel(loaded, adapters, release_reference), quality, out, progress
        )
        report = _report(reference, loaded, options, staged, parity, model_ref, adapters)
        refuse_quality(report, out)  # the graphs are right, the quantization short of its gate: reports kept beside out
        manifest = write_artifacts(root, report, hashes.digest)
    return ExportResult(out, manifest, parity, report)


@dataclasses.dataclass(frozen=True)
class _Staged:
    """What the graph stages leave for parity and the report."""

    folded: Folded
    checkpoint: dict[str, str]  # the checkpoint's files, hashed once
    portable: GraphSet
    calibrated: dict[str, object] | None
    written: tuple[TargetGraphs, ...]  # each wanted target's graphs
    recorded: dict[str, Any]  # the precision kinds' record (the manifest's)
    extras: dict[str, Any]  # and what the parity report shows of them
    numbers: QuantizerNumbers | None  # --int4: the quantizer's numbers (int4.proof)
    qdq: QdqNumbers | None  # int8, fp8: their proof's numbers (parity.qdq_proof)

    def files(self) -> list[Path]:
        """Every graph and weights file written (the spilled numbers, which parity deletes, are not among them)."""
        sets = [(self.portable.paths, self.portable.weights), *((t.paths, t.weights) for t in self.written)]
        return [path for paths, weights in sets for path in (*paths.values(), weights.path)]


def _write_graphs(
    reference: Reference,
    loaded: LoadedModel,
    planned: ExportPlan,
    root: Path,
    out: Path,
    progress: Progress,
    hashes: HashAhead,
    adapters: tuple[LoraAdapter, ...],
) -> _Staged:
    """fold -> calibration -> trace -> precision kinds prepared -> portable graphs -> the plan's
    target graphs, in the staging directory ``root``; the low-bit proofs' numbers spilled there."""
    options = planned.options
    hashes.queue(loaded.files)  # hashed once, beside the trace and the graphs
    folded = _fold(reference, loaded, progress)

    def weights() -> str:  # the calibration cache's key: only the kinds that calibrate wait for the hashes
        return weights_identity(hashes.digests(loaded.files), [(a.sha256, a.weight) for a in adapters])

    calibration = prepare_calibration(reference, options, weights, progress)
    traced = trace_unified(reference, folded, options, progress)  # its own stage
    context = precision_context(
        reference, folded, options, traced, graph_ranges(reference, options, calibration, progress), progress
    )
    precision = prepare_precision(context)
    (root / ONNX_DIR).mkdir()
    portable = write_portable_graphs(
        reference, folded, options, traced, precision, root / ONNX_DIR, progress, lora_slots(reference, options)
    )
    calibrated = calibration.finish(root / CALIBRATION_DIR) if calibration is not None else None
    given = TargetGiven(root / ONNX_DIR, portable.paths, reference.spec, options, reference.max_context, progress)
    written = tuple(each.write(given) for each in planned.targets)
    return _Staged(
        folded,
        hashes.digests(loaded.files),
        portable,
        calibrated,
        written,
        precision.record(portable.reports),
        precision.extras(portable.reports),
        _int4_numbers(precision, root, portable, written, out, progress),
        spill_qdq_numbers(precision, root, portable, written, out, progress),
    )


@dataclasses.dataclass(frozen=True)
class _ParityModel:
    """Parity's PyTorch model: the loaded checkpoint's (``loaded`` is the one ``reference`` was
    made of), or PEFT's with ``adapters``; ``release``: it may be freed and loaded again."""

    loaded: LoadedModel
    adapters: tuple[LoraAdapter, ...]
    release: bool


def _parity(
    reference: Reference,
    options: ExportOptions,
    staged: _Staged,
    model: _ParityModel,
    quality: QualityPlan | None,
    out: Path,
    progress: Progress,
) -> ParityResult:
    """Every graph set against PyTorch (and against the quantized model of a low-bit export), or
    a ``ParityError`` naming the first failures."""
    loaded = model.loaded
    release = release_weights(reference.module) if model.release else None
    reload = (lambda: prepare_reference(load_model(loaded.source), options)) if model.release else None
    parity_module = reference.module
    if model.adapters:
        parity_module, release, reload = _peft_reference(loaded, model.adapters, release, progress)
    gate = options.parity.agreement == "gate"
    numbers, qdq = staged.numbers, staged.qdq
    candidates = _candidates(staged.folded, options, staged.portable, staged.written, qdq is not None)
    parity = check_parity(
        parity_module, reference.spec, candidates, _settings(reference, options), release_reference=release,
        reload_reference=reload, progress=progress,
        quality=measured_graphs(quality, options, staged.written) if quality is not None else None,
        quantized=quantizer_model(numbers, gate) if numbers is not None else qdq_model(qdq, gate),
    )  # fmt: skip
    if not parity.passed:
        raise ParityError(
            f"{out}: exported graphs differ from PyTorch: " + "; ".join(shown_failures(parity.failure_records()))
        )
    return parity


def _report(
    reference: Reference,
    loaded: LoadedModel,
    options: ExportOptions,
    staged: _Staged,
    parity: ParityResult,
    model_ref: str | None,
    adapters: tuple[LoraAdapter, ...],
) -> ExportReport:
    return ExportReport(
        spec=reference.spec,
        options=options,
        model_ref=model_ref,
        checkpoint_files=staged.checkpoint,
        max_context=reference.max_context,
        folding=staged.folded.checks,
        portable=staged.portable,
        calibration=staged.calibrated,
        targets=staged.written,
        parity=parity,
        tokenizer=loaded.tokenizer,
        serving_files=loaded.serving_files,
        precision_record=staged.recorded,
        precision_extras=staged.extras,
        checkpoint_path=str(loaded.source.absolute()) if loaded.source.exists() else None,
        adapters=adapters,
    )


def _int4_numbers(
    precision: PreparedPrecision,
    root: Path,
    portable: GraphSet,
    written: tuple[TargetGraphs, ...],
    out: Path,
    progress: Progress,
) -> QuantizerNumbers | None:
    """--int4: the quantizer's own numbers spilled to the staging directory (the int4 proof's
    reference is built on them, not on the graphs it judges, and deletes the file once it has read
    them: ``int4.proof``), and every graph set's int4 weights checked bit for bit against
    them first (the first that differs refused by name)."""
    quantizer = int4_quantizer(precision.prepared)
    if quantizer is None:
        return None
    sets = [("portable", list(portable.paths.values())), *((g.name, list(g.paths.values())) for g in written)]
    with progress.stage("parity: int4 weights against the quantizer's numbers"):
        return proved_numbers(
            root / NUMBERS_FILE,
            quantizer.placed_numbers(),
            sets,
            f"{out}: exported int4 weights differ from the quantizer's numbers",
        )


def release_weights(module: torch.nn.Module) -> Callable[[], None]:
    """A callback that frees ``module``'s weights (it is unusable afterwards)."""

    def release() -> None:
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            tensor.data = torch.empty(0, dtype=tensor.dtype)
        drop_fp32_buffers(module)

    return release


def _peft_reference(
    loaded: LoadedModel, adapters: tuple[LoraAdapter, ...], release: Callable[[], None] | None, progress: Progress
) -> tuple[torch.nn.Module, Callable[[], None] | None, Callable[[], torch.nn.Module] | None]:
    """With ``--adapter``: parity's reference is PEFT's model of the base (loaded again) and the
    adapters, built once the merged weights are freed (``release``, when the export may free them:
    the two models then never sit in memory together), the callback that frees it and the one
    that builds it again (parity's memory rule: ``check_parity``)."""
    if release is not None:
        release()

    def build() -> torch.nn.Module:
        return adapter_reference(load_model(loaded.source), adapters)

    with progress.stage("parity: PEFT's model of base + adapters"):
        module = build()
    return module, release_weights(module) if release is not None else None, build if release is not None else None


def _settings(reference: Reference, options: ExportOptions) -> ParitySettings:
    """Parity's settings, on the device ``--parity-device`` resolves to (``runners.device``)."""
    return ParitySettings(
        reference.max_context,
        options.graphs.max_batch,
        options.parity.tokens,
        options.graphs.last_logits_only,
        device=resolve(options.parity.device),
    )


def _candidates(
    folded: Folded, options: ExportOptions, portable: GraphSet, written: tuple[TargetGraphs, ...], qdq: bool = False
) -> list[Candidate]:
    """The graph sets parity checks: the portable graphs, then each target's (opened its way);
    with ``qdq`` (an int8 or fp8 export whose Q/DQ numbers were kept) every Q/DQ set is judged
    against PyTorch with them too (``qdq_tolerance``)."""
    feeds = (
        table_feeds(list(folded.tables), options.precision.kv_dtype) if options.ple.tables is PLETables.INPUT else None
    )
    own = qdq_tolerance(options.precision) if qdq else options.precision.weight_only_judge
    candidates = [
        candidate(
            OrtRunner.opener(portable.paths, feeds),
            tuple(portable.paths),
            options.precision,
            own,
            files=portable.paths.values(),
        )
    ]
    for graphs in written:
        chosen = target(graphs.name)
        quantized: Precision | Tolerance | None = chosen.quantized_precision(graphs.precision)
        quantized = (
            qdq_tolerance(graphs.precision)
            if qdq and quantized is None and graphs.precision.value == options.precision.value
            else quantized
        )
        candidates.append(
            candidate(
                chosen.runner(graphs.paths, feeds),
                tuple(graphs.paths),
                graphs.precision,
                quantized,
                graphs.name,
                files=graphs.paths.values(),
            )
        )
    return candidates
