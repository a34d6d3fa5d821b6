"""``export``: checkpoint -> folded module -> three ONNX graphs sharing one weights file ->
parity -> manifest and reports, staged in a temporary directory and renamed into place."""

from __future__ import annotations

import dataclasses
import itertools
import shutil
from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir
import torch

from kiln.errors import ConfigError, ParityError
from kiln.exporter import manifest as manifest_mod
from kiln.calibration import Calibration
from kiln.exporter.artifacts import hash_tree, sha256_file, staged_output
from kiln.exporter.check import run_parity
from kiln.exporter.io_contract import GraphKind, graph_io
from kiln.exporter.options import ExportOptions, PLETables, Target
from kiln.exporter.parity import ParityResult
from kiln.exporter.passes import apply_contract, name_nodes, ple_tables_to_inputs
from kiln.exporter.parity import TOLERANCES
from kiln.exporter.precision import Fp16Policy, convert_to_fp16
from kiln.exporter.precision.int8 import DEFAULT_INT8_FLOAT, Int8Policy, quantize_int8
from kiln.exporter.precision.sensitivity import search_against_reference
from kiln.exporter.ple import FoldedPLE, check_folding, fold_ple, ple_sublayers
from kiln.exporter.reference import prepare_reference, resolve_limits, table_feeds
from kiln.exporter.progress import NullProgress, Progress
from kiln.exporter.report import write_parity_reports
from kiln.exporter.runners import OrtRunner, RecordingRunner, TorchRunner
from kiln.exporter.serving import write_genai_config
from kiln.exporter.targets.ort import OrtTarget, write_ort_target
from kiln.exporter.targets.parity import merge_target_parity
from kiln.exporter.trace import trace_graph
from kiln.exporter.weights import SharedWeightsWriter
from kiln.plugins import LoadedModel, load_model

__all__ = ["ExportResult", "export", "export_loaded", "ONNX_DIR"]

ONNX_DIR = "onnx"


@dataclasses.dataclass(frozen=True)
class ExportResult:
    out: Path
    manifest: dict[str, object]
    parity: ParityResult


def export(model: str | Path, out: Path, options: ExportOptions, progress: Progress | None = None) -> ExportResult:
    progress = progress or NullProgress()
    with progress.stage("load checkpoint"):
        loaded = load_model(model)
    return export_loaded(loaded, out, options, progress, model_ref=str(model), release_reference=True)


def release_weights(module: torch.nn.Module) -> Callable[[], None]:
    """A callback that frees ``module``'s weights (it is unusable afterwards)."""

    def release() -> None:
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            tensor.data = torch.empty(0, dtype=tensor.dtype)

    return release


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
    spec = loaded.spec
    if spec.encoder_dim is not None and options.precision.has_int8:
        raise ConfigError(
            "--int8 is not supported for cross-attention decoders yet: calibration needs encoder_hidden_states"
            " samples, which kiln's calibration data formats do not carry; export --fp16 or fp32"
        )
    if spec.encoder_dim is not None and options.target is Target.ORT:
        raise ConfigError("--target ort is not supported for cross-attention decoders yet: its attention rewrite knows causal self-attention only")
    max_context = resolve_limits(loaded, options)
    with staged_output(out, options.force) as tmp:
        reference = prepare_reference(loaded, options)
        with progress.stage("fold PLE"):
            folded = fold_ple(reference)
            fold_checks = check_folding(reference, folded)
        tables = [(m.scale, m.shift) for _, m in ple_sublayers(folded) if isinstance(m, FoldedPLE)]
        table_shapes = tuple(tuple(t.shape) for t, _ in tables) if options.ple_tables is PLETables.INPUT else ()

        onnx_dir = tmp / ONNX_DIR
        onnx_dir.mkdir()
        graphs: dict[GraphKind, Path] = {}
        policy = Fp16Policy().widened(options.keep_fp32)
        kept_fp32: dict[str, dict[str, list[str]]] = {}
        def traced(kind: GraphKind) -> ir.Model:
            """The fp32 graph of ``kind``, with the contract's I/O and module-named nodes."""
            io_spec = graph_io(spec, kind, last_logits_only=options.last_logits_only, ple_tables=table_shapes)
            model = trace_graph(
                folded,
                kind,
                io_spec,
                n_layers=spec.n_layers,
                vocab=spec.vocab_size,
                opset=options.opset,
                last_logits_only=options.last_logits_only,
                max_batch=options.max_batch,
                max_context=max_context,
            )
            if table_shapes:
                ple_tables_to_inputs(model, tables)
            apply_contract(model, io_spec, kind)
            return name_nodes(model)

        calibration = None
        int8_nodes: dict[str, list[str]] = {}
        int8_policy = Int8Policy(() if options.int8_all_matmuls else DEFAULT_INT8_FLOAT + options.int8_float)
        if options.precision.has_int8:
            assert options.calib_data is not None
            calibration = Calibration.prepare(
                options.calib_data,
                spec=spec,
                tokenizer=loaded.tokenizer,
                weights_sha256=sha256_file(loaded.files[1]) if len(loaded.files) > 1 else "",
                samples=options.calib_samples,
                method=options.calib_method,
                percentile=options.calib_percentile,
                context=max_context,
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
        torch_runner = TorchRunner(reference, spec.n_layers, options.last_logits_only)  # calibration and parity

        sensitivity = None
        if options.auto_keep_fp32:
            with progress.stage("fp16 sensitivity search"):
                sensitivity = search_against_reference(reference, spec, traced(GraphKind.UNIFIED), policy, TOLERANCES["fp16"].logits_atol)
                policy = policy.widened(tuple(g.rule for g in sensitivity.groups))

        # one graph at a time: trace, pass, move its weights into the shared file, save, drop
        with progress.stage("trace + write graphs", total=len(GraphKind)) as bar, SharedWeightsWriter(onnx_dir) as writer:
            for kind in GraphKind:
                model = traced(kind)
                if calibration is not None:
                    ranges = calibration.ranges_for(kind, model, spec, torch_runner)
                    model, int8_nodes[kind.value] = quantize_int8(model, ranges, int8_policy)
                if options.precision.has_fp16:
                    model, fp16 = convert_to_fp16(model, policy)
                    final_io = graph_io(spec, kind, last_logits_only=options.last_logits_only, ple_tables=table_shapes, kv_dtype="float16")
                    apply_contract(model, final_io, kind)
                    kept_fp32[kind.value] = {"nodes": list(fp16.kept_fp32), "tables": list(fp16.fp32_tables)}
                writer.externalize(model)
                graphs[kind] = onnx_dir / f"{kind.value}.onnx"
                ir.save(model, graphs[kind])
                del model
                bar.advance()
            weights = writer.close()
        calibration_info = calibration.finish(tmp / "calibration") if calibration is not None else None
        if loaded.tokenizer is not None:
            shutil.copyfile(loaded.tokenizer, onnx_dir / "tokenizer.json")

        ort_target: OrtTarget | None = None
        if options.target is Target.ORT:
            with progress.stage("ONNX Runtime target graphs"):
                ort_target = write_ort_target(onnx_dir, graphs, spec, max_context=max_context, int8=options.ort_int8)

        parity_feeds = table_feeds(tables, options.precision.kv_dtype) if table_shapes else None
        release = release_weights(reference) if release_reference else None

        # one recording of PyTorch for both graph sets: it runs once, the model is freed after it
        recorder = RecordingRunner(torch_runner)

        def check(paths: dict[GraphKind, Path], precision: str, release: Callable[[], None] | None = None) -> ParityResult:
            return run_parity(
                reference,
                spec,
                lambda: OrtRunner(paths, extra_feeds=parity_feeds),
                tuple(paths),
                precision=precision,
                max_context=max_context,
                max_batch=options.max_batch,
                tokens=options.parity_tokens,
                last_logits_only=options.last_logits_only,
                release_reference=release,
                recorder=recorder,
                progress=progress,
            )

        parity = check(graphs, options.precision.value, release)
        if ort_target is not None:
            merge_target_parity(parity, "ort", check(ort_target.graphs, ort_target.precision))
        if kept_fp32:
            parity.extra["kept_fp32"] = kept_fp32
        if calibration_info is not None:
            parity.extra["calibration"] = calibration_info
            parity.extra["int8_nodes"] = int8_nodes
        if sensitivity is not None:
            parity.extra["fp16_sensitivity"] = dataclasses.asdict(sensitivity)
        parity.extra["ple_folding"] = [dataclasses.asdict(c) for c in fold_checks]
        write_parity_reports(parity, tmp / "reports")
        if not parity.passed:
            raise ParityError(f"{out}: exported graphs differ from PyTorch: " + "; ".join(parity.failures()[:5]))
        manifest = manifest_mod.build(
            tmp,
            loaded,
            options,
            max_context=max_context,
            weights=weights,
            table_shapes=table_shapes,
            parity=parity,
            model_ref=model_ref,
            kept_fp32=kept_fp32,
            policy=policy,
            int8_nodes=int8_nodes,
            calibration=calibration_info,
            ort_target=ort_target.manifest_entry(tmp) if ort_target is not None else None,
        )
        if spec.encoder_dim is None:  # GenAI's decoder-only models have no way to feed a cross cache
            write_genai_config(tmp / ONNX_DIR, manifest)  # beside model.onnx, so it is hashed too
        manifest["files"] = hash_tree(tmp, exclude=(manifest_mod.MANIFEST,))
        manifest_mod.write(tmp, manifest)
    return ExportResult(out=out, manifest=manifest, parity=parity)
