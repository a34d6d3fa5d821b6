"""Parity: every graph against the PyTorch model, tensor by tensor and token by token.

- Tensor level: each output of each graph against PyTorch on the same inputs (left-padded
  batches, non-empty past): max abs, max rel, cosine, and top-1 agreement of the logits.
- Generation level: PyTorch generates greedily with its KV cache; the graphs are then fed the
  same tokens (teacher forcing) through prefill + decode, and through model.onnx alone, and at
  every step their argmax and logits are compared with PyTorch's. If every step's argmax
  agrees, the graphs' own greedy generation is the same token sequence (by induction), and a
  divergence is pinned to its first step with the logit error of every step recorded.
  A mismatch where PyTorch's own top two logits are closer than the tolerance is a tie, which
  no runtime can be blamed for; it is counted apart and does not fail the check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from kiln.exporter.io_contract import ENCODER_STATES, GraphKind, carried_cache, is_cross, past_names
from kiln.exporter.runners import Feeds, Runner
from kiln.plugins.base import DecoderSpec

__all__ = [
    "Tolerance",
    "TOLERANCES",
    "TensorCheck",
    "GenerationCheck",
    "ParityResult",
    "tensor_parity",
    "generation_parity",
    "greedy",
    "make_prompts",
    "left_pad",
    "encoder_states",
]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    logits_atol: float  # max abs error of logits
    kv_atol: float  # max abs error of present keys/values
    min_cosine: float  # of each output, flattened
    min_token_match: float = 1.0  # teacher-forced argmax agreement; 1.0: any non-tie difference fails


TOLERANCES = {
    "fp32": Tolerance(logits_atol=1e-4, kv_atol=1e-4, min_cosine=0.999999),
    # fp16 weights, activations and KV (10-bit mantissa) against fp32 PyTorch
    "fp16": Tolerance(logits_atol=5e-2, kv_atol=2e-2, min_cosine=0.9999),
    # int8 MatMuls: an approximation by design; judged by agreement, not by exact tokens
    "int8": Tolerance(logits_atol=1.5, kv_atol=1.0, min_cosine=0.99, min_token_match=0.9),
    "int8+fp16": Tolerance(logits_atol=1.5, kv_atol=1.0, min_cosine=0.99, min_token_match=0.9),
}


@dataclasses.dataclass(frozen=True)
class TensorCheck:
    graph: str
    output: str
    max_abs: float
    max_rel: float
    cosine: float
    top1: float | None  # logits only: fraction of positions whose argmax agrees
    atol: float
    passed: bool


@dataclasses.dataclass(frozen=True)
class GenerationCheck:
    path: str  # "prefill+decode" or "model"
    batch: int
    prompt_lengths: tuple[int, ...]
    steps: int
    token_match_rate: float
    first_divergence: int | None  # first step where a non-tie argmax differs
    ties: int
    per_step_max_abs: tuple[float, ...]  # logits, max over the batch
    passed: bool


@dataclasses.dataclass
class ParityResult:
    backend: str
    precision: str
    tolerance: Tolerance
    tensors: list[TensorCheck] = dataclasses.field(default_factory=list)
    generation: list[GenerationCheck] = dataclasses.field(default_factory=list)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.tensors) and all(g.passed for g in self.generation)

    def failures(self) -> list[str]:
        tol = self.tolerance
        out = [
            f"{t.graph}:{t.output} max abs {t.max_abs:.3g} (tolerance {t.atol:g}), cosine {t.cosine:.6f} (at least {tol.min_cosine:g})"
            for t in self.tensors
            if not t.passed
        ]
        out += [
            f"generation via {g.path} (batch {g.batch}): token match {g.token_match_rate:.3f}, first divergence at step {g.first_divergence}"
            for g in self.generation
            if not g.passed
        ]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "precision": self.precision,
            "passed": self.passed,
            "tolerance": dataclasses.asdict(self.tolerance),
            "tensors": [dataclasses.asdict(t) for t in self.tensors],
            "generation": [dataclasses.asdict(g) for g in self.generation],
            **self.extra,
        }


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` ([B, L] int64) of left-padded prompts."""
    length = max(len(p) for p in prompts)
    ids = np.full((len(prompts), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), length), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt) :] = prompt
        mask[row, length - len(prompt) :] = 1
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int64)
    return ids, mask, pos


def make_prompts(spec: DecoderSpec, lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Random prompts of the given lengths, avoiding special tokens."""
    rng = np.random.default_rng(seed)
    special = {t for t in (spec.bos_token_id, spec.eos_token_id, spec.pad_token_id) if t is not None}
    allowed = np.array([t for t in range(spec.vocab_size) if t not in special])
    return [rng.choice(allowed, size=n).tolist() for n in lengths]


def encoder_states(spec: DecoderSpec, batch: int, seed: int = 0, length: int = 6, dtype: np.dtype = np.dtype(np.float32)) -> np.ndarray | None:
    """Deterministic stand-in encoder output ``[batch, length, encoder_dim]`` for a cross-attention
    decoder (None for any other): what parity feeds every backend alike."""
    if spec.encoder_dim is None:
        return None
    return np.random.default_rng(seed).standard_normal((batch, length, spec.encoder_dim)).astype(dtype)


def _empty_past(spec: DecoderSpec, batch: int, dtype: np.dtype) -> Feeds:
    shape = (batch, spec.n_kv_heads, 0, spec.head_dim)
    return {name: np.zeros(shape, dtype=dtype) for i in range(spec.n_layers) for name in past_names(i)}


def _carry(feeds: Feeds, outputs: Feeds, previous: Feeds, spec: DecoderSpec) -> Feeds:
    """The next step's feeds: each past from this step's present, or (the cross cache, which
    only prefill returns) from the previous step's feeds."""
    for past, present in carried_cache(spec):
        feeds[past] = outputs[present] if present in outputs else previous[past]
    return feeds


def greedy(
    runner: Runner,
    spec: DecoderSpec,
    prompts: Sequence[Sequence[int]],
    steps: int,
    *,
    unified: bool = False,
    forced: np.ndarray | None = None,
    kv_dtype: np.dtype = np.dtype(np.float32),
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding through prefill + decode (or the unified graph alone).

    Returns the tokens ``[B, steps]`` and the last-position logits of every step
    ``[steps, B, vocab]`` (float32). With ``forced``, those tokens are fed instead of the argmax.
    A cross-attention decoder reads ``encoder_states(spec, B)``; the unified graph takes the
    cross cache as an input (like decode), so that path starts from the runner's own prefill
    graph's cross cache, as a user of model.onnx would.
    """
    pad = spec.pad_token_id if spec.pad_token_id is not None else 0
    ids, mask, pos = left_pad(prompts, pad)
    batch = ids.shape[0]
    feeds: Feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    encoder = encoder_states(spec, batch)
    if encoder is not None:
        feeds[ENCODER_STATES] = encoder.astype(kv_dtype)  # (via float32, as every other caller rounds it)
    if unified:
        cross: Feeds = {}
        if encoder is not None:
            prefill = runner.run(GraphKind.PREFILL, feeds)
            cross = {past: prefill[present].astype(kv_dtype) for past, present in carried_cache(spec) if is_cross(past)}
        feeds = {k: v for k, v in feeds.items() if k != ENCODER_STATES} | _empty_past(spec, batch, kv_dtype) | cross
    first = GraphKind.UNIFIED if unified else GraphKind.PREFILL
    step_kind = GraphKind.UNIFIED if unified else GraphKind.DECODE
    tokens = np.zeros((batch, steps), dtype=np.int64)
    logits_per_step = np.zeros((steps, batch, spec.vocab_size), dtype=np.float32)
    outputs = runner.run(first, feeds)
    for step in range(steps):
        logits = outputs["logits"][:, -1, :].astype(np.float32)
        logits_per_step[step] = logits
        token = forced[:, step] if forced is not None else logits.argmax(-1)
        tokens[:, step] = token
        if step == steps - 1:
            break
        pos = pos[:, -1:] + 1
        mask = np.concatenate([mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
        step_feeds: Feeds = {"input_ids": token[:, None].astype(np.int64), "attention_mask": mask, "position_ids": pos}
        feeds = _carry(step_feeds, outputs, feeds, spec)
        outputs = runner.run(step_kind, feeds)
    return tokens, logits_per_step


def generation_parity(
    reference: Runner,
    candidate: Runner,
    spec: DecoderSpec,
    prompts: Sequence[Sequence[int]],
    steps: int,
    tolerance: Tolerance,
    *,
    unified: bool,
    kv_dtype: np.dtype = np.dtype(np.float32),
    reference_run: tuple[np.ndarray, np.ndarray] | None = None,
) -> GenerationCheck:
    ref_tokens, ref_logits = reference_run or greedy(reference, spec, prompts, steps)
    _, cand_logits = greedy(candidate, spec, prompts, steps, unified=unified, forced=ref_tokens, kv_dtype=kv_dtype)
    cand_tokens = cand_logits.argmax(-1).T  # [B, steps]
    mismatch = cand_tokens != ref_tokens
    rows, cols = np.nonzero(mismatch)
    ties = 0
    first: int | None = None
    for b, t in zip(rows, cols, strict=True):
        margin = ref_logits[t, b, ref_tokens[b, t]] - ref_logits[t, b, cand_tokens[b, t]]
        if margin <= 2 * tolerance.logits_atol:
            ties += 1
        elif first is None or t < first:
            first = int(t)
    per_step = np.abs(cand_logits - ref_logits).max(axis=(1, 2))
    return GenerationCheck(
        path="model" if unified else "prefill+decode",
        batch=len(prompts),
        prompt_lengths=tuple(len(p) for p in prompts),
        steps=steps,
        token_match_rate=float(1.0 - mismatch.mean()),
        first_divergence=first,
        ties=ties,
        per_step_max_abs=tuple(float(x) for x in per_step),
        passed=first is None if tolerance.min_token_match >= 1.0 else float(1.0 - mismatch.mean()) >= tolerance.min_token_match,
    )


def _compare(graph: str, name: str, want: np.ndarray, got: np.ndarray, atol: float, min_cos: float) -> TensorCheck:
    w, g = want.astype(np.float64), got.astype(np.float64)
    if w.shape != g.shape:
        return TensorCheck(graph, name, float("inf"), float("inf"), 0.0, None, atol, False)
    diff = np.abs(w - g)
    max_abs = float(diff.max()) if diff.size else 0.0
    max_rel = float((diff / np.maximum(np.abs(w), 1e-6)).max()) if diff.size else 0.0
    denom = float(np.linalg.norm(w) * np.linalg.norm(g))
    cosine = float(np.dot(w.ravel(), g.ravel()) / denom) if denom > 0 else float(np.array_equal(w, g))
    top1 = float((w.argmax(-1) == g.argmax(-1)).mean()) if name == "logits" else None
    passed = bool(np.isfinite(g).all()) and max_abs <= atol and cosine >= min_cos
    return TensorCheck(graph, name, max_abs, max_rel, cosine, top1, atol, passed)


def tensor_feeds(
    spec: DecoderSpec, kind: GraphKind, seed: int, kv_dtype: np.dtype = np.dtype(np.float32), reference: Runner | None = None
) -> Feeds:
    """Inputs for one graph: batch 2, the first row left-padded, a non-empty past where allowed.
    With a ``reference`` runner the past is the keys/values it computes for random past tokens
    (what a graph sees in use); without one, random normal values."""
    rng = np.random.default_rng(seed)
    seq = {GraphKind.PREFILL: 7, GraphKind.DECODE: 1, GraphKind.UNIFIED: 4}[kind]
    past = {GraphKind.PREFILL: 0, GraphKind.DECODE: 9, GraphKind.UNIFIED: 6}[kind]
    total = past + seq
    mask = np.ones((2, total), dtype=np.int64)
    mask[0, : min(3, total - 1)] = 0  # left padding in row 0
    pos_all = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    feeds: Feeds = {
        "input_ids": rng.integers(0, spec.vocab_size, size=(2, seq), dtype=np.int64),
        "attention_mask": mask,
        "position_ids": pos_all[:, past:].astype(np.int64),
    }
    encoder = encoder_states(spec, 2, seed, dtype=kv_dtype)
    if kind is GraphKind.PREFILL and encoder is not None:
        feeds[ENCODER_STATES] = encoder
    if kind is not GraphKind.PREFILL:
        presents = None
        if reference is not None:
            prompt = {
                "input_ids": rng.integers(0, spec.vocab_size, size=(2, past), dtype=np.int64),
                "attention_mask": mask[:, :past],
                "position_ids": pos_all[:, :past].astype(np.int64),
            }
            if encoder is not None:
                prompt[ENCODER_STATES] = encoder
            presents = reference.run(GraphKind.PREFILL, prompt)
        for name, present in carried_cache(spec):
            length = encoder.shape[1] if encoder is not None and is_cross(name) else past
            value = presents[present] if presents is not None else rng.standard_normal((2, spec.n_kv_heads, length, spec.head_dim))
            feeds[name] = np.asarray(value).astype(kv_dtype)
    return feeds


def tensor_parity(
    reference: Runner, candidate: Runner, spec: DecoderSpec, tolerance: Tolerance, seed: int = 0, kv_dtype: np.dtype = np.dtype(np.float32)
) -> list[TensorCheck]:
    checks: list[TensorCheck] = []
    for kind in candidate.graphs():
        feeds = tensor_feeds(spec, kind, seed, kv_dtype, reference)
        want = reference.run(kind, feeds)
        got = candidate.run(kind, feeds)
        for name, value in want.items():
            atol = tolerance.logits_atol if name == "logits" else tolerance.kv_atol
            checks.append(_compare(kind.value, name, value, got[name], atol, tolerance.min_cosine))
    return checks
