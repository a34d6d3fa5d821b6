"""Parity of an export directory's graphs against the PyTorch model (run by ``kiln export`` at
its end and by ``kiln check DIR``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from kiln.errors import ArtifactError, CheckpointError
from kiln.exporter.artifacts import sha256_file
from kiln.exporter.io_contract import GraphKind
from kiln.exporter.options import ExportOptions, LogitsMode, PLEExtendMode, PLETables, Precision
from kiln.exporter.parity import (
    TOLERANCES,
    ParityResult,
    generation_parity,
    greedy,
    make_prompts,
    tensor_feeds,
    tensor_parity,
)
from kiln.exporter.ple import FoldedPLE, fold_ple, ple_sublayers
from kiln.exporter.progress import NullProgress, Progress
from kiln.exporter.reference import prepare_reference, table_feeds
from kiln.exporter.runners import OrtRunner, RecordingRunner, Runner, TorchRunner
from kiln.exporter.verify import require_verified
from kiln.plugins import load_model
from kiln.plugins.base import DecoderSpec

__all__ = ["run_parity", "parity_plan", "check_dir"]


def parity_plan(max_context: int, max_batch: int, tokens: int) -> tuple[list[int], list[int], int]:
    """Prompt lengths for batch 1 and for the left-padded batch, and the number of steps, so
    that prompt + generated tokens fit the exported context."""
    longest = max(2, min(12, max_context // 4))
    steps = max(1, min(tokens, max_context - longest))
    single = [longest]
    padded = [longest, max(1, longest - 4), max(1, longest - 7)][: max(1, min(3, max_batch))]
    return single, padded, steps


def run_parity(
    reference: nn.Module,
    spec: DecoderSpec,
    candidate: Callable[[], contextlib.AbstractContextManager[Runner]],
    graphs: tuple[GraphKind, ...],
    *,
    precision: str,
    max_context: int,
    max_batch: int,
    tokens: int,
    last_logits_only: bool,
    release_reference: Callable[[], None] | None = None,
    recorder: RecordingRunner | None = None,
    seed: int = 0,
    progress: Progress | None = None,
) -> ParityResult:
    """Tensor parity of ``graphs`` on the runner that ``candidate()`` opens, then greedy
    generation through prefill + decode and (when ``graphs`` has it) model.onnx, for batch 1
    and a left-padded batch.

    Every PyTorch output is computed first and recorded; ``release_reference`` (if given) then
    frees the model's weights before the runtime loads its own, so the two never sit in memory
    together; the comparisons replay the recorded outputs. Checks of several graph sets of one
    model (the portable and the ``--target ort`` graphs) share one ``recorder`` (a
    ``RecordingRunner`` of ``reference``): PyTorch then runs once, and later checks replay it.
    """
    progress = progress or NullProgress()
    tolerance = TOLERANCES[precision]
    kv_dtype = np.dtype(Precision(precision).kv_dtype)
    recorder = recorder or RecordingRunner(TorchRunner(reference, spec.n_layers, last_logits_only))
    single, padded, steps = parity_plan(max_context, max_batch, tokens)
    batches = [make_prompts(spec, single, seed), make_prompts(spec, padded, seed + 1)]
    paths = [False, True] if GraphKind.UNIFIED in graphs else [False]
    with progress.stage("parity: PyTorch reference", total=len(graphs) + len(batches)) as bar:
        for kind in graphs:
            recorder.run(kind, tensor_feeds(spec, kind, seed, kv_dtype, recorder))
            bar.advance()
        reference_runs = []
        for prompts in batches:
            reference_runs.append(greedy(recorder, spec, prompts, steps))
            bar.advance()
    recorder.freeze()
    del reference
    if release_reference is not None:
        release_reference()
    with candidate() as runner, progress.stage("parity", total=1 + len(paths) * len(batches)) as bar:
        result = ParityResult(backend=runner.name, precision=precision, tolerance=tolerance)
        result.tensors = tensor_parity(recorder, runner, spec, tolerance, seed, kv_dtype)
        bar.advance()
        for prompts, reference_run in zip(batches, reference_runs, strict=True):
            for unified in paths:
                result.generation.append(
                    generation_parity(
                        recorder,
                        runner,
                        spec,
                        prompts,
                        steps,
                        tolerance,
                        unified=unified,
                        kv_dtype=kv_dtype,
                        reference_run=reference_run,
                    )
                )
                bar.advance()
    return result


def check_dir(
    directory: Path, model: str | Path | None = None, progress: Progress | None = None, backend: str = "onnxruntime"
) -> ParityResult:
    """Re-run parity on an export directory against its checkpoint (or ``model``), on ONNX
    Runtime (the ONNX graphs) or TensorRT (``backend="tensorrt"``: the engines of ``kiln build``,
    refused when built by another TensorRT version or for another compute capability)."""
    progress = progress or NullProgress()
    manifest = require_verified(directory)
    if backend == "tensorrt":  # before loading anything: are there engines at all?
        from kiln.exporter.engine.records import read_records

        read_records(directory)
    ref = model if model is not None else manifest["checkpoint"]["reference"]
    if ref is None:
        raise ArtifactError(f"{directory}: the manifest does not name its checkpoint; pass --model")
    with progress.stage("load checkpoint"):
        loaded = load_model(ref)
    recorded = manifest["checkpoint"]["files"]
    found = {p.name: sha256_file(p) for p in loaded.files}
    if recorded != found:
        changed = sorted(k for k in set(recorded) | set(found) if recorded.get(k) != found.get(k))
        raise CheckpointError(f"{ref}: checkpoint files {changed} differ from the ones {directory} was exported from")
    ple = manifest["export"]["ple"] or {}
    options = ExportOptions(
        max_batch=manifest["limits"]["max_batch"],
        max_context=manifest["limits"]["max_context"],
        logits=LogitsMode(manifest["export"]["logits"]),
        ple_extend=ple.get("rows") if ple.get("extend_mode") else None,
        ple_extend_mode=PLEExtendMode(ple.get("extend_mode") or "clamp"),
        ple_tables=PLETables(ple.get("tables", "constant")),
    )  # the export's graph options; its precision is the manifest's (the graphs already carry it)
    precision = Precision(manifest["precision"])
    reference = prepare_reference(loaded, options)
    extra = None
    if options.ple_tables is PLETables.INPUT:
        folded = fold_ple(reference)
        extra = table_feeds([(m.scale, m.shift) for _, m in ple_sublayers(folded) if isinstance(m, FoldedPLE)], precision.kv_dtype)

    def graph_paths(entries: dict[str, Any]) -> dict[GraphKind, Path]:
        paths = {kind: directory / entries[kind.value]["file"] for kind in GraphKind}
        for path in paths.values():
            if not path.is_file():
                raise ArtifactError(f"{path}: graph file missing")
        return paths

    recorder = RecordingRunner(TorchRunner(reference, loaded.spec.n_layers, options.last_logits_only))  # PyTorch runs once for both sets

    def parity(candidate: Callable[[], contextlib.AbstractContextManager[Any]], kinds: tuple[GraphKind, ...], precision: str) -> ParityResult:
        return run_parity(
            reference,
            loaded.spec,
            candidate,
            kinds,
            precision=precision,
            max_context=options.max_context or loaded.spec.max_context,
            max_batch=options.max_batch,
            tokens=options.parity_tokens,
            last_logits_only=options.last_logits_only,
            recorder=recorder,
            progress=progress,
        )

    graphs = graph_paths(manifest["graphs"])
    if backend == "tensorrt":
        from kiln.exporter.engine import TrtRunner

        def candidate() -> contextlib.AbstractContextManager[Any]:
            return TrtRunner.from_directory(directory, extra_feeds=extra)

        kinds: tuple[GraphKind, ...] = (GraphKind.PREFILL, GraphKind.DECODE)
    else:

        def candidate() -> contextlib.AbstractContextManager[Any]:
            return OrtRunner(graphs, extra_feeds=extra)

        kinds = tuple(graphs)
    result = parity(candidate, kinds, precision.value)
    ort_target = (manifest.get("targets") or {}).get("ort")
    if backend != "tensorrt" and ort_target is not None:  # --target ort graphs: checked the same way
        from kiln.exporter.targets.parity import merge_target_parity

        ort_graphs = graph_paths(ort_target["graphs"])
        merge_target_parity(result, "ort", parity(lambda: OrtRunner(ort_graphs, extra_feeds=extra), tuple(ort_graphs), ort_target["precision"]))
    return result
