"""Running parity for an export's graph sets (``kiln export`` at its end, ``kiln check DIR``): the
PyTorch reference records its tensor outputs, each graph set runs (tensors judged, greedy tokens
generated), then PyTorch scores every set's tokens in batched forwards and each step is judged."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
from torch import nn

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.parity.against import Judged, judged_against
from kiln.exporter.parity.generation import greedy, judge, make_prompts, unified_chunks
from kiln.exporter.parity.memory import keeps_model
from kiln.exporter.parity.qdq_check import against_qdq
from kiln.exporter.parity.qdq_numbers import QdqNumbers
from kiln.exporter.parity.quality import QualityPlan, QualityResult, graph_quality, reference_logprobs
from kiln.exporter.parity.quantized import Int4Weight, read_int4_weights, use_int4_weights
from kiln.exporter.parity.results import ParityResult, TensorCheck
from kiln.exporter.parity.schedule import tensors_after_generation, tensors_before_generation
from kiln.exporter.parity.scoring import score
from kiln.exporter.parity.tensors import prompt_check, tensor_feeds, tensor_parity
from kiln.exporter.progress import NullProgress, Progress
from kiln.exporter.runners import RecordingRunner, Runner, TorchRunner
from kiln.exporter.runners.base import Feeds
from kiln.exporter.runners.device import CPU, ParityDevice, on
from kiln.exporter.tolerance import Tolerance
from kiln.plugins.base import DecoderSpec

__all__ = ["Candidate", "ParitySettings", "QuantizedModel", "check_parity", "quantized_model", "parity_plan"]


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
    device: ParityDevice = CPU  # where PyTorch and ONNX Runtime run (``runners.device``)


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
    weight_bytes: int = (
        0  # its graph files' and weights files' bytes: what a runtime holds beside the model (``keeps_model``)
    )


@dataclasses.dataclass(frozen=True)
class QuantizedModel:
    """The second reference of a low-bit export: the int4 weights its graphs hold
    (``parity.quantized``) or its Q/DQ numbers (``parity.qdq_model``), and whether agreement with
    the checkpoint's model gates the export (else it is recorded only: ``--parity-agreement record``)."""

    int4: Callable[[], Iterable[Int4Weight]] = lambda: ()  # read when the checkpoint's model has been recorded
    agreement_gates: bool = True
    qdq: Callable[[], QdqNumbers] | None = None  # int8, fp8: read then too


def quantized_model(paths: Iterable[Path], agreement_gates: bool = True) -> QuantizedModel:
    """The quantized model of a weight-only int4 export whose graphs are at ``paths`` (any other
    precision has no such model: its graphs have only the checkpoint's model to be judged against)."""
    graphs = tuple(paths)
    return QuantizedModel(lambda: read_int4_weights(graphs), agreement_gates)


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
        return cls(
            [make_prompts(spec, single, seed), make_prompts(spec, padded, seed + 1)],
            single[0],
            steps,
            seed,
            joined,
            settings.max_batch,
        )

    def groups(self) -> list[list[list[list[int]]]]:
        """The batches as they run: all in one group when joined, else one group each."""
        return [self.batches] if self.joined else [[prompts] for prompts in self.batches]

    def rows(self) -> list[list[list[int]]]:
        """Each group's prompts as one greedy run's rows."""
        return [[p for prompts in group for p in prompts] for group in self.groups()]


def check_parity(
    reference: nn.Module,
    spec: DecoderSpec,
    candidates: Sequence[Candidate],
    settings: ParitySettings,
    *,
    release_reference: Callable[[], None] | None = None,
    reload_reference: Callable[[], nn.Module] | None = None,
    progress: Progress | None = None,
    quantized: QuantizedModel | None = None,
    quality: QualityPlan | None = None,
) -> ParityResult:
    """Every candidate against PyTorch, in one result: the first candidate's checks, then each
    target's under its name. PyTorch first records its outputs on every graph's tensor feeds; each
    candidate then runs (its tensors judged, its greedy sequences generated); PyTorch last scores
    those sequences teacher-forced (``parity.scoring``) and every step is judged. The model stays in
    memory meanwhile only when it adds little beside the largest graph set and both fit (``keeps_model``) or
    cannot be loaded again (no ``release_reference`` or ``reload_reference``); else
    ``release_reference`` frees it before any runtime loads its weights, and ``reload_reference``
    loads it again to score. With ``quantized``, the module is then made to compute with the
    graphs' int4 weights (or an int8/fp8 export's Q/DQ numbers: ``parity.qdq_check``), and every
    candidate with a ``quantized`` precision is also judged against it, at that precision's
    tolerances (``ParityResult.quantized``). With ``quality``, PyTorch's
    log-probabilities on its text are kept with the recording, and the prefill of the candidate
    ``quality.target`` names (the first, the portable graphs, by default) is measured against them
    while its session is open (``ParityResult.quality``). Everything
    runs on ``settings.device`` (one note names it when it is not the CPU)."""
    progress = progress or NullProgress()
    if settings.device.cuda:
        progress.note("parity on cuda: PyTorch's reference on the GPU, the graphs on ONNX Runtime's CUDA provider")
    with on(settings.device):
        return _check_parity(
            reference, spec, candidates, settings, release_reference, reload_reference, progress, quantized, quality
        )


def _check_parity(
    reference: nn.Module,
    spec: DecoderSpec,
    candidates: Sequence[Candidate],
    settings: ParitySettings,
    release_reference: Callable[[], None] | None,
    reload_reference: Callable[[], nn.Module] | None,
    progress: Progress,
    quantized: QuantizedModel | None,
    quality: QualityPlan | None,
) -> ParityResult:
    """``check_parity`` on the device already set."""
    plan = _Plan.of(spec, settings)
    graphs = tuple(dict.fromkeys(kind for c in candidates for kind in c.graphs))
    runner = TorchRunner(reference, spec.n_layers, settings.last_logits_only)
    recorded = _record(runner, spec, graphs, plan, np.dtype(candidates[0].kv_dtype), progress)
    measure = _quality(reference, spec, quality, progress)
    measured = _measured(candidates, quality)
    keep = (
        release_reference is None
        or reload_reference is None
        or keeps_model(reference, max(c.weight_bytes for c in candidates))
    )
    held: nn.Module | None = reference
    del reference, runner
    if not keep:
        assert release_reference is not None
        held = None
        release_reference()
    ran = [
        _run(
            recorded, spec, candidate, plan, progress, quantized is not None, measure if candidate is measured else None
        )
        for candidate in candidates
    ]
    with progress.stage(
        f"parity: PyTorch scores the graphs' tokens ({'model kept in memory' if keep else 'model loaded again'})"
    ):
        module = held if held is not None else _reload(reload_reference)
        del held
        scored = _score(module, spec, plan, ran)
    results = [_result(r, r.candidate.tolerance, r.tensors, s, plan) for r, s in zip(ran, scored, strict=True)]
    against = _against(module, spec, plan, quantized, ran, settings.last_logits_only, progress)
    if keep and release_reference is not None:
        release_reference()  # the model the export loaded is not read again
    del module
    merged = _merged(ran, results, against, quantized)
    measured_quality = next((r.quality for r in ran if r.quality is not None), None)
    merged.quality = measured_quality if quality is None or quality.note is None else quality.unmeasured()
    return merged


def _against(
    module: nn.Module,
    spec: DecoderSpec,
    plan: _Plan,
    quantized: QuantizedModel | None,
    ran: Sequence[_Ran],
    last_logits_only: bool,
    progress: Progress,
) -> list[ParityResult | None]:
    """Each quantized candidate against the model it computes (``quantized``: the Q/DQ numbers or
    the int4 weights); None for every candidate without ``quantized``."""
    if quantized is None:
        return [None] * len(ran)
    if quantized.qdq is not None:
        with progress.stage("parity: PyTorch with the calibrated Q/DQ scales"):
            return _against_qdq(module, spec, plan, quantized.qdq(), ran, last_logits_only)
    with progress.stage("parity: PyTorch on the int4 weights"):
        return _against_quantized(module, spec, plan, quantized, ran, last_logits_only)


def _quality(
    reference: nn.Module, spec: DecoderSpec, quality: QualityPlan | None, progress: Progress
) -> Callable[[Runner], QualityResult] | None:
    """PyTorch's log-probabilities on the quality text (``parity.quality``), computed while the
    model is in memory, and what measures a graph set's runner against them."""
    if quality is None or quality.note is not None:
        return None
    with progress.stage(f"parity: PyTorch on {quality.text.tokens} tokens of {quality.text.source} (quality)"):
        kept = reference_logprobs(TorchRunner(reference, spec.n_layers), spec, quality.text)
    return lambda runner: graph_quality(runner, spec, quality.text, kept, quality.threshold, quality.graphs)


def _measured(candidates: Sequence[Candidate], quality: QualityPlan | None) -> Candidate | None:
    """The candidate quality is measured on: the one ``quality.target`` names (None: the portable graphs, the first)."""
    if quality is None:
        return None
    chosen = next((c for c in candidates if c.target == quality.target), None)
    assert chosen is not None, f"quality is measured on graphs parity checks ({quality.graphs})"
    return chosen


def _merged(
    ran: Sequence[_Ran],
    results: list[ParityResult],
    against: list[ParityResult | None],
    quantized: QuantizedModel | None,
) -> ParityResult:
    """The first candidate's result with every target's merged in, and each one's checks against
    the quantized model."""
    result = results[0]
    if quantized is not None:
        result.agreement_gates = quantized.agreement_gates
    for r, checked in zip(ran[1:], results[1:], strict=True):
        assert r.candidate.target is not None, "only the first candidate is not a target"
        result.merge(r.candidate.target, checked)
    for r, q in zip(ran, against, strict=True):
        if q is not None:
            result.merge_quantized(r.candidate.target, q)
    return result


def _reload(reload_reference: Callable[[], nn.Module] | None) -> nn.Module:
    assert reload_reference is not None, "the model is released only where it can be loaded again"
    return reload_reference()


def _record(
    runner: Runner,
    spec: DecoderSpec,
    graphs: tuple[GraphKind, ...],
    plan: _Plan,
    kv_dtype: np.dtype,
    progress: Progress,
) -> RecordingRunner:
    """PyTorch's outputs on each graph's tensor feeds (batch 2 and batch 1; the unified graph's from
    an empty cache too: ``prompt_check``), recorded, then frozen."""
    recorder = RecordingRunner(runner)
    with progress.stage("parity: PyTorch reference tensors", total=len(graphs)) as bar:
        for kind in graphs:
            for single_row in (False, True):  # tensor_parity's two cases
                recorder.run(kind, tensor_feeds(spec, kind, plan.seed, kv_dtype, recorder, single_row=single_row))
                if kind is GraphKind.UNIFIED:  # its prompt call: prefill's outputs (unless --logits last)
                    prompt_check(recorder, spec, plan.seed, kv_dtype, single_row=single_row)
            bar.advance()
    recorder.freeze()
    return recorder


def joins_batches(spec: DecoderSpec) -> bool:
    """Whether parity's batches may run as one (every row in one greedy run of a candidate): not a
    cross-attention decoder's, whose stand-in encoder states depend on the batch size. ``_Plan``
    also keeps the rows within the export's max batch."""
    return spec.encoder_dim is None or spec.has_encoder


@dataclasses.dataclass(frozen=True)
class _Ran:
    """One candidate's outputs, kept from its session until PyTorch has scored them: its tensor
    checks, its outputs on the tensor feeds (to judge against the quantized model; empty when it
    is not), and per group of batches its greedy tokens and logits (and the unified graph's)."""

    candidate: Candidate
    backend: str
    tensors: list[TensorCheck]
    outputs: list[tuple[GraphKind, Feeds, Feeds]]
    runs: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]
    quality: QualityResult | None = None  # the measured candidate's (``QualityPlan.target``), on the quality text


def _run(
    recorded: RecordingRunner,
    spec: DecoderSpec,
    candidate: Candidate,
    plan: _Plan,
    progress: Progress,
    quantized: bool,
    measure: Callable[[Runner], QualityResult] | None = None,
) -> _Ran:
    """The candidate's tensors against the recording (batch 2 with a padded row, unless the
    export's max batch is 1, and batch 1), its greedy run per group of batches (``_Plan``), the
    unified graph's chunks on its tokens and ``measure`` (quality) on its runner, each graph's work
    together (``parity.schedule``)."""
    kv_dtype, unified = np.dtype(candidate.kv_dtype), GraphKind.UNIFIED in candidate.graphs
    kept = quantized and candidate.quantized is not None
    target = f"{candidate.target} " if candidate.target else ""
    label = f"parity: {candidate.precision} {target}graphs"  # the session's start counts in it
    with progress.stage(label, total=1 + len(plan.groups())) as bar, candidate.open() as runner:
        checks = _TensorChecks(recorded, runner, spec, candidate.tolerance, plan, kv_dtype, kept)
        checks.run(tensors_before_generation(runner.graphs()))  # in the order of ``parity.schedule``
        quality = measure(runner) if measure is not None else None
        greedy_runs = []
        for rows in plan.rows():
            greedy_runs.append(greedy(runner, spec, rows, plan.steps, kv_dtype=kv_dtype, length=plan.length))
            bar.advance()
        checks.run(tensors_after_generation(runner.graphs()))
        runs: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]] = []
        for rows, (tokens, logits) in zip(plan.rows(), greedy_runs, strict=True):
            chunked = (
                unified_chunks(runner, spec, rows, tokens, kv_dtype=kv_dtype, length=plan.length) if unified else None
            )
            runs.append((tokens, logits, chunked))
        bar.advance()
        tensors, outputs = checks.in_report_order(runner.graphs())
        return _Ran(candidate, runner.name, tensors, outputs, runs, quality)


class _TensorChecks:
    """One candidate's tensor checks, run graph by graph (``parity.schedule``: each graph's session once),
    reported in their usual order: every graph's batch-2 checks (unless the export's max batch is 1),
    then every graph's batch-1 checks; with ``keep``, its outputs on the tensor feeds in that order too."""

    def __init__(
        self,
        recorded: Runner,
        runner: Runner,
        spec: DecoderSpec,
        tolerance: Tolerance,
        plan: _Plan,
        kv_dtype: np.dtype,
        keep: bool,
    ) -> None:
        self._args = (recorded, runner, spec, tolerance, plan.seed, kv_dtype)
        self._rows = ([False] if plan.max_batch > 1 else []) + [True]  # single_row: batch 2, then batch 1
        self._keep = keep
        self._done: dict[tuple[bool, GraphKind], tuple[list[TensorCheck], list[tuple[GraphKind, Feeds, Feeds]]]] = {}

    def run(self, kinds: Sequence[GraphKind]) -> None:
        for kind in kinds:
            for single_row in self._rows:
                kept: list[tuple[GraphKind, Feeds, Feeds]] = []
                checks = tensor_parity(
                    *self._args, single_row=single_row, keep=kept if self._keep else None, kinds=(kind,)
                )
                self._done[(single_row, kind)] = (checks, kept)

    def in_report_order(
        self, graphs: Sequence[GraphKind]
    ) -> tuple[list[TensorCheck], list[tuple[GraphKind, Feeds, Feeds]]]:
        assert len(self._done) == len(graphs) * len(self._rows), "every graph's tensors are checked"
        done = [self._done[(single_row, kind)] for single_row in self._rows for kind in graphs]
        return [c for checks, _ in done for c in checks], [k for _, kept in done for k in kept]


def _score(module: nn.Module | Runner, spec: DecoderSpec, plan: _Plan, ran: Sequence[_Ran]) -> list[list[np.ndarray]]:
    """PyTorch's logits at every step of each candidate's runs (per candidate, per group), all
    candidates' rows scored together (``parity.scoring``); ``module`` or a runner of it whose
    prefill returns every position's logits."""
    groups = plan.rows()
    sequences = [(g, tokens) for r in ran for g, (tokens, _, _) in enumerate(r.runs)]
    runner = TorchRunner(module, spec.n_layers) if isinstance(module, nn.Module) else module
    scored = iter(score(runner, spec, groups, plan.length, sequences))  # every position's logits
    return [[next(scored) for _ in r.runs] for r in ran]


def _against_qdq(
    module: nn.Module, spec: DecoderSpec, plan: _Plan, numbers: QdqNumbers, ran: Sequence[_Ran], last_logits_only: bool
) -> list[ParityResult | None]:
    """Each candidate with a ``quantized`` tolerance against the module with the export's Q/DQ
    numbers (``parity.qdq_check``), each generation path against its own graphs' scales."""
    judged = [r for r in ran if r.candidate.quantized is not None]
    checks = against_qdq(
        module, spec, numbers, ran, last_logits_only, plan.length, lambda runner: _score(runner, spec, plan, judged)
    )
    return _judged_results(ran, checks, plan)


def _judged_results(ran: Sequence[_Ran], checks: list[Judged | None], plan: _Plan) -> list[ParityResult | None]:
    """Each candidate's checks against the quantized model (``parity.against``) as its result."""
    return [_result(r, *c[:3], plan, c[3]) if c is not None else None for r, c in zip(ran, checks, strict=True)]


def _result(
    ran: _Ran,
    tolerance: Tolerance,
    tensors: list[TensorCheck],
    scored: list[np.ndarray],
    plan: _Plan,
    scored_chunked: list[np.ndarray] | None = None,
) -> ParityResult:
    """One candidate's checks: its tensors, then batch by batch each graph path's generation,
    judged against the reference's logits at the candidate's own prefixes (the unified graph's
    chunks against ``scored_chunked`` where given: the Q/DQ reference scores each path with its
    own graphs' scales)."""
    result = ParityResult(
        backend=ran.backend, precision=ran.candidate.precision, tolerance=tolerance, tensors=list(tensors)
    )
    for group, (_, logits, chunked), reference, unified in zip(
        plan.groups(), ran.runs, scored, scored_chunked or scored, strict=True
    ):
        start = 0
        for prompts in group:
            rows = slice(start, start + len(prompts))
            result.generation.append(judge(prompts, reference[:, rows], logits[:, rows], tolerance, False, plan.length))
            if chunked is not None:
                result.generation.append(
                    judge(prompts, unified[:, rows], chunked[:, rows], tolerance, True, plan.length)
                )
            start += len(prompts)
    return result


def _against_quantized(
    module: nn.Module,
    spec: DecoderSpec,
    plan: _Plan,
    quantized: QuantizedModel,
    ran: Sequence[_Ran],
    last_logits_only: bool,
) -> list[ParityResult | None]:
    """Each candidate with a ``quantized`` precision against the module on the graphs' int4
    weights (converted in place): its tensor outputs on the same feeds, and its runs scored again
    (``parity.against``, as the Q/DQ numbers' check)."""
    use_int4_weights(module, quantized.int4())
    runner = TorchRunner(module, spec.n_layers, last_logits_only)
    judged = [r for r in ran if r.candidate.quantized is not None]
    checks = judged_against(ran, lambda kind: runner, iter(_score(module, spec, plan, judged)))
    return _judged_results(ran, checks, plan)
