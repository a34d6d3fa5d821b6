"""Tensor-level parity: every output of every graph against the reference on the same inputs."""

from __future__ import annotations

import numpy as np
from kiln.exporter.contract.io import ENCODER_STATES, GraphKind, carried_cache, is_cross
from kiln.exporter.parity.generation import encoder_states
from kiln.exporter.parity.results import TensorCheck
from kiln.exporter.parity.tolerances import Tolerance
from kiln.exporter.runners.base import Feeds, Runner
from kiln.plugins.base import DecoderSpec

__all__ = ["tensor_feeds", "tensor_parity"]


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
