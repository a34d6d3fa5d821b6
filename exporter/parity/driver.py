"""Running parity for one graph set: record the PyTorch reference first, then compare a runner's
outputs with the recording (run by ``kiln export`` at its end and by ``kiln check DIR``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.parity.generation import greedy, joined_generation_parity, make_prompts
from kiln.exporter.parity.quantized import Int4Weight, read_int4_weights, use_int4_weights
from kiln.exporter.parity.results import GenerationCheck, ParityResult
from kiln.exporter.parity.tensors import tensor_feeds, tensor_parity
from kiln.exporter.parity.tolerances import Tolerance
from kiln.exporter.progress import NullProgress, Progress
from kiln.exporter.runners import RecordingRunner, Runner, TorchRunner
from kiln.plugins.base import DecoderSpec
from torch import nn

__all__ = ["Candidate", "ParitySettings", "QuantizedModel", "check_parity", "quantized_model", "run_parity", "parity_plan"]


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
    which graphs it runs, its precision's name, tolerances and KV dtype (``exporter.candidates``
    makes them from the name), and, for a target set, the name its checks are merged under
    (``None``: the export's own portable graphs, or the engines). ``quantized``: the tolerances
    that judge it against the quantized model (its float precision's, for a weight-only int4
    set; None: not checked against one)."""

    open: Callable[[], contextlib.AbstractContextManager[Runner]]
    graphs: tuple[GraphKind, ...]
    precision: str
    tolerance: Tolerance
    kv_dtype: str = "float32"
    target: str | None = None
    quantized: Tolerance | None = None


@dataclasses.dataclass(frozen=True)
class QuantizedModel:
    """The second reference of a low-bit export (``parity.quantized``): the int4 weights its
    graphs hold, and whether agreement with the checkpoint's model gates the export (else it is
    recorded only: ``--parity-agreement record``)."""

    int4: Callable[[], Iterable[Int4Weight]]  # read when the checkpoint's model has been recorded
    agreement_gates: bool = True


def quantized_model(paths: Iterable[Path], agreement_gates: bool = True) -> QuantizedModel:
    """The quantized model of a weight-only int4 export whose graphs are at ``paths`` (any other
    precision has no such model: its graphs have only the checkpoint's model to be judged against)."""
    graphs = tuple(paths)
    return QuantizedModel(lambda: read_int4_weights(graphs), agreement_gates)


@dataclasses.dataclass(frozen=True)
class _Recorded:
    """One reference's recorded outputs: its runner (frozen) and its greedy runs per batch."""

    runner: RecordingRunner
    runs: list[tuple[np.ndarray, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What every run of one parity check feeds: the prompts per batch, their padded length, the steps."""

    batches: list[list[list[int]]]
    length: int
    steps: int
    seed: int
    joined: bool  # every batch's rows in one greedy run (``joins_batches``), within the export's max batch
    max_batch: int  # no run feeds more rows (an engine's profile ends there)

    @classmethod
    def of(cls, spec: DecoderSpec, settings: ParitySettings) -> _Plan:
        single, padded, steps = parity_plan(settings.max_context, settings.max_batch, settings.tokens)
        seed, joined = settings.seed, joins_batches(spec) and len(single) + len(padded) <= settings.max_batch
        return cls([make_prompts(spec, single, seed), make_prompts(spec, padded, seed + 1)], single[0], steps, seed, joined, settings.max_batch)

    def groups(self) -> list[list[list[list[int]]]]:
        """The batches as they run: all in one group when joined, else one group each."""
        return [self.batches] if self.joined else [[prompts] for prompts in self.batches]


def check_parity(
    reference: nn.Module,
    spec: DecoderSpec,
    candidates: Sequence[Candidate],
    settings: ParitySettings,
    *,
    release_reference: Callable[[], None] | None = None,
    progress: Progress | None = None,
    quantized: QuantizedModel | None = None,
) -> ParityResult:
    """Every candidate against PyTorch, in one result: the first candidate's checks, then each
    target's under its name. PyTorch runs first, once, and is recorded; ``release_reference``
    then frees the model's weights, before any runtime loads its own, so the two never sit in
    memory together; the comparisons replay the recording. With ``quantized``, the module is
    then made to compute with the graphs' int4 weights and recorded again (before the release),
    and every candidate with a ``quantized`` precision is also judged against that recording, at
    that precision's tolerances (``ParityResult.quantized``)."""
    progress = progress or NullProgress()
    plan, first = _Plan.of(spec, settings), candidates[0]
    kv_dtype = np.dtype(first.kv_dtype)
    graphs = tuple(dict.fromkeys(kind for c in candidates for kind in c.graphs))
    recorded = _record(TorchRunner(reference, spec.n_layers, settings.last_logits_only), spec, graphs, plan, kv_dtype, progress, "parity: PyTorch reference")
    quantized_recorded = None
    if quantized is not None:
        use_int4_weights(reference, quantized.int4())
        runner = TorchRunner(reference, spec.n_layers, settings.last_logits_only)
        quantized_recorded = _record(runner, spec, graphs, plan, kv_dtype, progress, "parity: PyTorch on the int4 weights")
    del reference
    if release_reference is not None:
        release_reference()
    result: ParityResult | None = None
    for candidate in candidates:
        checked, against_quantized = _check_candidate(recorded, quantized_recorded, spec, candidate, plan, progress)
        if result is None:
            result = checked
            if quantized is not None:
                result.agreement_gates = quantized.agreement_gates
        else:
            assert candidate.target is not None, "only the first candidate is not a target"
            result.merge(candidate.target, checked)
        if against_quantized is not None:
            result.merge_quantized(candidate.target, against_quantized)
    assert result is not None, "check_parity needs a candidate"
    return result


def _record(
    torch_runner: Runner, spec: DecoderSpec, graphs: tuple[GraphKind, ...], plan: _Plan, kv_dtype: np.dtype, progress: Progress, label: str
) -> _Recorded:
    """Every PyTorch output parity compares with, recorded, then frozen: the outputs of each
    graph's tensor feeds, and the tokens and logits of every batch's greedy run (the runs go
    around the recorder: it would keep every step's outputs, the whole KV cache of each step,
    3 GB per reference at 8B, which nothing replays)."""
    recorder = RecordingRunner(torch_runner)
    with progress.stage(label, total=len(graphs) + len(plan.batches)) as bar:
        for kind in graphs:
            for single_row in (False, True):  # tensor_parity's two cases
                recorder.run(kind, tensor_feeds(spec, kind, plan.seed, kv_dtype, recorder, single_row=single_row))
            bar.advance()
        runs = _reference_runs(torch_runner, spec, plan)
        bar.advance(len(plan.batches))
    recorder.freeze()
    return _Recorded(recorder, runs)


def _reference_runs(reference: Runner, spec: DecoderSpec, plan: _Plan) -> list[tuple[np.ndarray, np.ndarray]]:
    """The reference's greedy tokens and logits for each batch of prompts (every one padded to
    the plan's length), a joined plan's rows in one batch: one forward per step for every run
    instead of one per batch per step (the PyTorch reference's time is its weights read per step,
    nearly the same for 4 rows as for 1). Row b of the joined run is row b of its batch's own run,
    up to the float rounding of a different batch size (the candidates are checked against these
    tokens, teacher-forced, with ties allowed)."""
    runs = []
    for group in plan.groups():
        tokens, logits = greedy(reference, spec, [p for prompts in group for p in prompts], plan.steps, length=plan.length)
        start = 0
        for prompts in group:
            rows = slice(start, start + len(prompts))
            runs.append((tokens[rows], logits[:, rows]))
            start += len(prompts)
    return runs


def joins_batches(spec: DecoderSpec) -> bool:
    """Whether parity's batches may run as one (every row in one greedy run; ``_reference_runs``,
    ``joined_generation_parity``): not a cross-attention decoder's, whose stand-in encoder
    states depend on the batch size. ``_Plan`` also keeps the rows within the export's max batch."""
    return spec.encoder_dim is None or spec.has_encoder


def _check_candidate(
    recorded: _Recorded, quantized: _Recorded | None, spec: DecoderSpec, candidate: Candidate, plan: _Plan, progress: Progress
) -> tuple[ParityResult, ParityResult | None]:
    """The candidate against the recording (by its precision's tolerances) and, when it has a
    ``quantized`` precision and there is a quantized recording, against that one too: one
    session for both."""
    against_quantized = quantized is not None and candidate.quantized is not None
    runs = len(plan.groups()) * (2 if GraphKind.UNIFIED in candidate.graphs else 1)
    label = f"parity: {candidate.precision} {candidate.target + ' ' if candidate.target else ''}graphs"  # the session's start counts in it
    with progress.stage(label, total=(1 + runs) * (2 if against_quantized else 1)) as bar, candidate.open() as runner:
        checked = run_parity(recorded.runner, runner, spec, candidate, candidate.tolerance, plan, recorded.runs, bar.advance)
        if not against_quantized:
            return checked, None
        assert quantized is not None and candidate.quantized is not None
        return checked, run_parity(quantized.runner, runner, spec, candidate, candidate.quantized, plan, quantized.runs, bar.advance)


def run_parity(
    reference: RecordingRunner,
    runner: Runner,
    spec: DecoderSpec,
    candidate: Candidate,
    tolerance: Tolerance,
    plan: _Plan,
    reference_runs: list[tuple[np.ndarray, np.ndarray]],
    advance: Callable[[int], None],
) -> ParityResult:
    """Tensor parity of the candidate's graphs against a frozen recording (batch 2 with a padded
    row, unless the export's max batch is 1, and batch 1), then greedy generation through prefill + decode and (when it has it)
    model.onnx of batch 1 and a padded batch (``parity_plan``), teacher-forced on the recording's
    greedy runs: both batches' rows in one run per path where the plan joins them (``_Plan``),
    judged batch by batch as their own runs would be."""
    kv_dtype = np.dtype(candidate.kv_dtype)
    paths = [False, True] if GraphKind.UNIFIED in candidate.graphs else [False]
    result = ParityResult(backend=runner.name, precision=candidate.precision, tolerance=tolerance)
    result.tensors = tensor_parity(reference, runner, spec, tolerance, plan.seed, kv_dtype) if plan.max_batch > 1 else []  # batch 2
    result.tensors += tensor_parity(reference, runner, spec, tolerance, plan.seed, kv_dtype, single_row=True)
    advance(1)
    runs = iter(reference_runs)
    by_path: dict[bool, list[GenerationCheck]] = {unified: [] for unified in paths}
    for batches in plan.groups():
        mine = [next(runs) for _ in batches]
        for unified in paths:
            checks = joined_generation_parity(runner, spec, batches, mine, plan.steps, tolerance, unified=unified, kv_dtype=kv_dtype, length=plan.length)
            by_path[unified] += checks
            advance(1)
    result.generation = [check for row in zip(*by_path.values(), strict=True) for check in row]  # batch by batch, each path's
    return result
