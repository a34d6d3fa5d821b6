"""``export``: the chain of stages that turns a checkpoint into an export directory.

    load -> fold -> (calibrate, fp16 policy) -> trace + graph passes -> target graphs
         -> parity -> artifacts (reports, serving configs, manifest) -> commit

Every stage is a function of the one before it; the export is staged in a temporary directory
and renamed into place only when every stage has passed (``artifacts.staging``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

import onnx_ir as ir
import torch
from kiln.calibration import WINDOW, Calibration, load_calibration_data
from kiln.calibration.hessians import Quantize, quantize_layerwise
from kiln.errors import ConfigError, ParityError
from kiln.exporter.emit import write_artifacts
from kiln.exporter.artifacts.hashing import sha256_file
from kiln.exporter.artifacts.layout import CALIBRATION_DIR, ONNX_DIR
from kiln.exporter.artifacts.manifest import Manifest
from kiln.exporter.artifacts.staging import require_replaceable, staged_output
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.fold import Folded, fold, table_feeds
from kiln.exporter.graphs import (
    GraphSet,
    PrecisionPlan,
    fp32_graph,
    write_portable_graphs,
)
from kiln.exporter.load import Reference, adapter_reference, load_reference, merge_adapters, resolve_limits
from kiln.exporter.options import ExportOptions, PLETables
from kiln.exporter.parity import (
    TOLERANCES,
    Candidate,
    ParityResult,
    ParitySettings,
    check_parity,
    quantized_model,
)
from kiln.exporter.precision.int4 import DEFAULT_INT4_FLOAT, Int4Quantizer
from kiln.exporter.precision.int8 import DEFAULT_INT8_FLOAT, Int8Policy
from kiln.exporter.precision.policy import Fp16Policy
from kiln.exporter.precision.sensitivity import (
    SensitivityResult,
    search_against_reference,
)
from kiln.exporter.progress import NullProgress, Progress
from kiln.exporter.report import ExportReport
from kiln.exporter.runners import OrtRunner, TorchRunner
from kiln.exporter.runners.torch_runner import drop_fp32_buffers
from kiln.exporter.targets import target, targets
from kiln.exporter.targets.base import TargetGiven, TargetGraphs
from kiln.exporter.trace import Traced, trace_unified
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


def export(model: str | Path, out: Path, options: ExportOptions, progress: Progress | None = None) -> ExportResult:
    progress = progress or NullProgress()
    require_replaceable(out.absolute(), options.force, inputs=(resolve_checkpoint(model), *options.data_inputs))  # before the load (checked again)
    with progress.stage("load checkpoint"):
        if (spec := config_spec(model)) is not None:
            resolve_limits(spec, options)  # --max-context against the config's limits, before any weight is read
        loaded = load_model(model)
    return export_loaded(loaded, out, options, progress, model_ref=str(model), release_reference=True)


def export_loaded(
    loaded: LoadedModel,
    out: Path,
    options: ExportOptions,
    progress: Progress | None = None,
    model_ref: str | None = None,
    release_reference: bool = False,
) -> ExportResult:
    """Export ``loaded``. With ``release_reference`` its weights are freed once parity has its
    PyTorch outputs (``export`` does this: it loaded the model itself), so a big model's
    weights and the runtime's never sit in memory together; ``loaded`` is unusable afterwards."""
    progress = progress or NullProgress()
    adapters = merge_adapters(loaded, options, model_ref)  # --adapter: before anything reads the weights
    reference = load_reference(loaded, options)
    inputs = (loaded.source, *loaded.files, *options.data_inputs)  # never replaced by the output, whatever --force says
    needs = int(sum(p.numel() for p in reference.module.parameters()) * options.precision.min_bytes_per_weight)
    with staged_output(out, options.force, inputs=inputs, note=progress.note, needs=needs) as root:
        with progress.stage("fold PLE"):
            folded = fold(reference.module, loaded.ple)
        checkpoint = {path.name: sha256_file(path) for path in loaded.files}  # hashed once
        calibration = _calibration(reference, options, checkpoint, progress)
        traced = trace_unified(reference, folded, options, progress)  # its own stage
        fp16, sensitivity = _fp16_policy(reference, folded, options, traced, progress)
        int4 = _int4(reference, options, progress)
        plan = PrecisionPlan(
            fp16, _int8_policy(options), _calibrate(reference, options, calibration, progress), int4.quantizer if int4 else None, int4.policy if int4 else None
        )
        (root / ONNX_DIR).mkdir()
        portable = write_portable_graphs(reference, folded, options, traced, plan, root / ONNX_DIR, progress)
        calibrated = calibration.finish(root / CALIBRATION_DIR) if calibration is not None else None
        given = TargetGiven(root / ONNX_DIR, portable.paths, reference.spec, options, reference.max_context, progress)
        written = tuple(target.write(given) for target in targets() if target.wanted(options))
        release = release_weights(reference.module) if release_reference else None
        parity_module = reference.module
        if adapters:
            parity_module, release = _peft_reference(loaded, adapters, release, progress)
        parity = check_parity(
            parity_module,
            reference.spec,
            _candidates(folded, options, portable, written),
            _settings(reference, options),
            release_reference=release,
            progress=progress,
            quantized=quantized_model(options.precision, portable.paths.values(), options.parity_agreement == "gate"),
        )
        if not parity.passed:
            raise ParityError(f"{out}: exported graphs differ from PyTorch: " + "; ".join(parity.failures()[:5]))
        report = ExportReport(
            reference.spec, options, model_ref, checkpoint, reference.max_context, folded.checks, fp16.keep, portable, calibrated, sensitivity, written, parity,
            loaded.tokenizer, loaded.serving_files, _quantization(options, portable, int4),
            checkpoint_path=str(loaded.source.absolute()) if loaded.source.exists() else None, adapters=adapters,
        )
        manifest = write_artifacts(root, report)
    return ExportResult(out, manifest, parity, report)


def release_weights(module: torch.nn.Module) -> Callable[[], None]:
    """A callback that frees ``module``'s weights (it is unusable afterwards)."""

    def release() -> None:
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            tensor.data = torch.empty(0, dtype=tensor.dtype)
        drop_fp32_buffers(module)

    return release


def _peft_reference(
    loaded: LoadedModel, adapters: tuple[LoraAdapter, ...], release: Callable[[], None] | None, progress: Progress
) -> tuple[torch.nn.Module, Callable[[], None] | None]:
    """With ``--adapter``: parity's reference is PEFT's model of the base (loaded again) and the
    adapters, built once the merged weights are freed (``release``, when the export may free them:
    the two models then never sit in memory together), and the callback that frees it."""
    if release is not None:
        release()
    with progress.stage("parity: PEFT's model of base + adapters"):
        module = adapter_reference(load_model(loaded.source), adapters)
    return module, release_weights(module) if release is not None else None


def _calibration(reference: Reference, options: ExportOptions, checkpoint: dict[str, str], progress: Progress) -> Calibration | None:
    """int8 and fp8: the calibration data and settings (and ranges, when the cache has them)."""
    if not options.precision.needs_ranges:
        return None
    assert options.calib_data is not None, "ExportOptions refuses --int8 without --calib-data"
    files = reference.loaded.files
    calibration = Calibration.prepare(
        options.calib_data,
        spec=reference.spec,
        tokenizer=reference.loaded.tokenizer,
        weights_sha256=checkpoint[files[1].name] if len(files) > 1 else "",
        samples=options.samples,
        method=options.calib_method,
        percentile=options.calib_percentile,
        context=reference.max_context,
        graph_settings={
            "opset": options.opset,
            "logits": options.logits.value,
            "ple_extend": options.ple_extend,
            "ple_extend_mode": options.ple_extend_mode.value,
            "ple_tables": options.ple_tables.value,
        },
        cache_dir=options.calib_cache,
    )
    if calibration.cache_hit:
        progress.note(f"calibration: reusing cached ranges {options.calib_cache}/{calibration.key}.json")
    return calibration


def _calibrate(
    reference: Reference, options: ExportOptions, calibration: Calibration | None, progress: Progress
) -> Callable[[GraphKind, ir.Model], dict[str, tuple[float, float]]] | None:
    if calibration is None:
        return None
    runner = TorchRunner(reference.module, reference.spec.n_layers, options.last_logits_only)  # runs the teacher-forced decode feeds
    return lambda kind, model: calibration.ranges_for(kind, model, reference.spec, runner, progress)


def _fp16_policy(reference: Reference, folded: Folded, options: ExportOptions, traced: Traced, progress: Progress) -> tuple[Fp16Policy, SensitivityResult | None]:
    """The fp32 islands: the default policy, ``--keep-fp32`` and what ``--auto-keep-fp32`` finds."""
    policy = Fp16Policy().widened(options.keep_fp32)
    if not options.auto_keep_fp32:
        return policy, None
    with progress.stage("fp16 sensitivity search"):
        unified = fp32_graph(reference, folded, options, GraphKind.UNIFIED, traced)
        found = search_against_reference(reference.module, reference.spec, unified, policy, TOLERANCES["fp16"].logits_atol)
    return policy.widened(tuple(g.rule for g in found.groups)), found


def _int8_policy(options: ExportOptions) -> Int8Policy:
    return Int8Policy(() if options.int8_all_matmuls else DEFAULT_INT8_FLOAT + options.int8_float + options.fp8_float)


@dataclasses.dataclass(frozen=True)
class _Int4Setup:
    quantizer: Int4Quantizer
    policy: Int8Policy
    calibration: dict[str, object] | None  # GPTQ: the data the Hessians come from


def _int4(reference: Reference, options: ExportOptions, progress: Progress) -> _Int4Setup | None:
    """int4: the quantizer all graphs share (GPTQ: layer by layer over --calib-data through PyTorch,
    the first time a weight is quantized) and the policy of what stays float."""
    if not options.precision.has_int4:
        return None
    policy = Int8Policy(() if options.int4_all_matmuls else DEFAULT_INT4_FLOAT + options.int4_float)
    layerwise, record = None, None
    if options.gptq:
        assert options.calib_data is not None, "ExportOptions refuses gptq without --calib-data"
        if reference.spec.encoder_dim is not None:
            raise ConfigError("--int4-method gptq is not supported for cross-attention decoders yet: its calibration runs prompts without encoder_hidden_states; use --int4-method rtn")
        data = load_calibration_data(
            options.calib_data, tokenizer=reference.loaded.tokenizer, vocab_size=reference.spec.vocab_size, samples=options.samples, window=min(WINDOW, reference.max_context)
        )
        prefix = reference.loaded.layers.prefix if reference.loaded.layers is not None else None

        def layerwise(todo: Collection[str], done: Collection[str], quantize: Quantize) -> None:
            quantize_layerwise(reference.module, prefix, reference.spec.n_layers, data.windows, todo, done, quantize, progress)

        record = {"source": data.source, "data_sha256": data.sha256, "windows": len(data.windows), "window": int(len(data.windows[0]))}
    return _Int4Setup(Int4Quantizer(options.int4_method, options.int4_block, layerwise), policy, record)


def _quantization(options: ExportOptions, portable: GraphSet, int4: _Int4Setup | None) -> dict[str, object] | None:
    """What the manifest records of an int4 or fp8 export (``export.quantization``)."""
    if int4 is not None:
        reports = [g.passes.get("int4", {}) for g in portable.graphs.values()]
        blocks = {n: b for r in reports for n, b in r.get("blocks", {}).items() if b != options.int4_block}
        kept = {n: why for r in reports for n, why in r.get("kept_float", {}).items()}
        return {
            "format": "int4 weight-only: DequantizeLinear(INT4 [K, N], scale [K/B, N], axis=0, block_size=B), symmetric, no zero point",
            "method": options.int4_method.value,
            "block_size": options.int4_block,
            "layer_block_sizes": dict(sorted(blocks.items())),  # layers whose K the block size does not divide
            "kept_float": {"rules": list(int4.policy.keep_float), "nodes": dict(sorted(kept.items()))},
            "calibration": int4.calibration,
        }
    if options.precision.has_fp8:
        return {
            "format": "fp8 E4M3 Q/DQ: weights float8e4m3fn per output channel (DequantizeLinear axis 1), activations per tensor, scales amax/448 in fp16",
            "method": options.calib_method,
            "kept_float": {"rules": list(_int8_policy(options).keep_float), "nodes": {}},
        }
    return None


def _settings(reference: Reference, options: ExportOptions) -> ParitySettings:
    return ParitySettings(reference.max_context, options.max_batch, options.parity_tokens, options.last_logits_only)


def _candidates(folded: Folded, options: ExportOptions, portable: GraphSet, written: tuple[TargetGraphs, ...]) -> list[Candidate]:
    """The graph sets parity checks: the portable graphs, then each target's (opened its way)."""
    feeds = table_feeds(list(folded.tables), options.precision.kv_dtype) if options.ple_tables is PLETables.INPUT else None
    candidates = [Candidate(OrtRunner.opener(portable.paths, feeds), tuple(portable.paths), options.precision.value, quantized=options.precision.weight_only_float)]
    for graphs in written:
        chosen = target(graphs.name)
        candidates.append(Candidate(chosen.runner(graphs.paths, feeds), tuple(graphs.paths), graphs.precision, target=graphs.name, quantized=chosen.quantized_precision(graphs.precision)))
    return candidates
