"""Running parity for one graph set: record the PyTorch reference first, then compare a runner's
outputs with the recording (run by ``kiln export`` at its end and by ``kiln check DIR``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.options import Precision
from kiln.exporter.parity.generation import generation_parity, greedy, make_prompts
from kiln.exporter.parity.results import ParityResult
from kiln.exporter.parity.tensors import tensor_feeds, tensor_parity
from kiln.exporter.parity.tolerances import TOLERANCES
from kiln.exporter.progress import NullProgress, Progress
from kiln.exporter.runners import RecordingRunner, Runner, TorchRunner
from kiln.plugins.base import DecoderSpec
from torch import nn

__all__ = ["Candidate", "ParitySettings", "check_parity", "run_parity", "parity_plan"]


def parity_plan(max_context: int, max_batch: int, tokens: int) -> tuple[list[int], list[int], int]:
    """Prompt lengths for batch 1 and for the padded batch, and the number of steps, so that
    prompt + generated tokens fit the exported context. Every run is padded to the longest
    prompt (``single``'s): at ``max_batch`` 1 the padded batch is one shorter prompt padded to
    it, so that padding is tested there too."""
    longest = max(2, min(12, max_context // 4))
    steps = max(1, min(tokens, max_context - longest))
    shorter = [max(1, longest - 4), max(1, longest - 7)]
    padded = [longest, *shorter][: min(3, max_batch)] if max_batch > 1 else shorter[:1]
    return [longest], padded, steps


@dataclasses.dataclass(frozen=True)
class ParitySettings:
    """What every parity check of one export shares: the export's limits and the generation length."""

    max_context: int
    max_batch: int
    tokens: int  # greedy steps (bounded by the context)
    last_logits_only: bool
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One graph set to check: how to open its runner (sessions exist only while it is open),
    which graphs it runs, whose tolerances apply, and, for a target set, the name its checks
    are merged under (``None``: the export's own portable graphs, or the engines)."""

    open: Callable[[], contextlib.AbstractContextManager[Runner]]
    graphs: tuple[GraphKind, ...]
    precision: str
    target: str | None = None


def check_parity(
    reference: nn.Module,
    spec: DecoderSpec,
    candidates: Sequence[Candidate],
    settings: ParitySettings,
    *,
    release_reference: Callable[[], None] | None = None,
    progress: Progress | None = None,
) -> ParityResult:
    """Every candidate against PyTorch, in one result: the first candidate's checks, then each
    target's under its name. PyTorch runs once, for the first candidate; later ones replay its
    recording (``release_reference`` frees the model's weights as soon as it is recorded)."""
    recorder = RecordingRunner(TorchRunner(reference, spec.n_layers, settings.last_logits_only))
    del reference
    result: ParityResult | None = None
    for candidate in candidates:
        checked = run_parity(recorder, spec, candidate, settings, release_reference=release_reference if result is None else None, progress=progress)
        if result is None:
            result = checked
        else:
            assert candidate.target is not None, "only the first candidate is not a target"
            result.merge(candidate.target, checked)
    assert result is not None, "check_parity needs a candidate"
    return result


def _reference_runs(reference: Runner, spec: DecoderSpec, batches: list[list[list[int]]], steps: int, length: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The reference's greedy tokens and logits for each batch of prompts (every one padded to
    ``length``), all rows in one batch: one forward per step for every run instead of one per
    batch per step (the PyTorch reference's time is its weights read per step, nearly the same
    for 4 rows as for 1). Rows are independent (each row's mask and positions are its own), so
    row b of the joined run is row b of its batch's own run, up to the float rounding of a
    different batch size (the candidates are checked against these tokens, teacher-forced, with
    ties allowed). A cross-attention decoder's stand-in encoder states depend on the batch size
    (``encoder_states``): its batches run apart."""
    if spec.encoder_dim is not None and not spec.has_encoder:
        return [greedy(reference, spec, prompts, steps, length=length) for prompts in batches]
    tokens, logits = greedy(reference, spec, [p for prompts in batches for p in prompts], steps, length=length)
    runs, start = [], 0
    for prompts in batches:
        rows = slice(start, start + len(prompts))
        runs.append((tokens[rows], logits[:, rows]))
        start += len(prompts)
    return runs


def run_parity(
    recorder: RecordingRunner,
    spec: DecoderSpec,
    candidate: Candidate,
    settings: ParitySettings,
    *,
    release_reference: Callable[[], None] | None = None,
    progress: Progress | None = None,
) -> ParityResult:
    """Tensor parity of the candidate's graphs, then greedy generation through prefill + decode
    and (when it has it) model.onnx, for batch 1 and a padded batch (``parity_plan``).

    Every PyTorch output is computed first and recorded; ``release_reference`` (if given) then
    frees the model's weights before the runtime loads its own, so the two never sit in memory
    together; the comparisons replay the recorded outputs (a recording already frozen by an
    earlier candidate replays only)."""
    progress = progress or NullProgress()
    tolerance = TOLERANCES[candidate.precision]
    kv_dtype = np.dtype(Precision(candidate.precision).kv_dtype)
    seed, graphs = settings.seed, candidate.graphs
    single, padded, steps = parity_plan(settings.max_context, settings.max_batch, settings.tokens)
    batches, length = [make_prompts(spec, single, seed), make_prompts(spec, padded, seed + 1)], single[0]
    paths = [False, True] if GraphKind.UNIFIED in graphs else [False]
    with progress.stage("parity: PyTorch reference", total=len(graphs) + len(batches)) as bar:
        for kind in graphs:
            recorder.run(kind, tensor_feeds(spec, kind, seed, kv_dtype, recorder))
            bar.advance()
        reference_runs = _reference_runs(recorder, spec, batches, steps, length)
        bar.advance(len(batches))
    recorder.freeze()
    if release_reference is not None:
        release_reference()
    label = f"parity: {candidate.precision} {candidate.target + ' ' if candidate.target else ''}graphs"  # the session's start counts in it
    with progress.stage(label, total=1 + len(paths) * len(batches)) as bar, candidate.open() as runner:
        result = ParityResult(backend=runner.name, precision=candidate.precision, tolerance=tolerance)
        result.tensors = tensor_parity(recorder, runner, spec, tolerance, seed, kv_dtype)
        bar.advance()
        for prompts, reference_run in zip(batches, reference_runs, strict=True):
            for unified in paths:
                result.generation.append(
                    generation_parity(
                        recorder, runner, spec, prompts, steps, tolerance, unified=unified, kv_dtype=kv_dtype, reference_run=reference_run, length=length
                    )
                )
                bar.advance()
    return result
