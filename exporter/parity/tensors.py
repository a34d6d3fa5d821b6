"""Tensor-level parity: every output of every graph against the reference on the same inputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kiln.exporter.contract.io import ENCODER_FEATURES, ENCODER_MASK, ENCODER_STATES, GraphKind, carried_cache, is_cross
from kiln.exporter.contract.steps import empty_past
from kiln.exporter.parity.generation import encoder_states
from kiln.exporter.parity.results import TensorCheck
from kiln.exporter.runners.base import Feeds, Runner
from kiln.exporter.tolerance import Bound, Tolerance
from kiln.plugins.base import DecoderSpec

__all__ = ["compare_outputs", "empty_cache", "prompt_check", "real_positions", "tensor_feeds", "tensor_parity"]


def _compare(
    graph: str,
    name: str,
    want: np.ndarray,
    got: np.ndarray,
    bound: Bound,
    min_cos: float,
    real: np.ndarray | None = None,
) -> TensorCheck:
    """``got`` against ``want`` by ``bound``'s rule, row by row (the last axis); with ``real`` (a
    boolean mask broadcastable to both) the values are compared at the real positions only,
    while every value must be finite. The check records the row that comes closest to its limit
    (or passes it furthest): its error and its scale, the figures the reports show."""
    if want.shape != got.shape:
        return TensorCheck(
            graph, name, float("inf"), float("inf"), 0.0, None, bound.atol, bound.rtol, float("inf"), 0.0, False
        )
    finite, row = bool(np.isfinite(got).all()), want.shape[-1] if want.ndim else 1
    if real is not None:  # broadcast along the last axis: whole rows are kept or dropped
        keep = np.broadcast_to(real, want.shape)
        want, got = want[keep], got[keep]
    w, g = want.astype(np.float64).reshape(-1, row), got.astype(np.float64).reshape(-1, row)
    if not w.size:
        return TensorCheck(graph, name, 0.0, 0.0, 1.0, None, bound.atol, bound.rtol, 0.0, 0.0, finite)
    diff = np.abs(w - g)
    error, scale = bound.worst_row(w, g)
    max_rel = float((diff / np.maximum(np.abs(w), 1e-6)).max())
    denom = float(np.linalg.norm(w) * np.linalg.norm(g))
    cosine = float(np.dot(w.ravel(), g.ravel()) / denom) if denom > 0 else float(np.array_equal(w, g))
    top1 = float((w.argmax(-1) == g.argmax(-1)).mean()) if name == "logits" else None
    passed = finite and error <= bound.limit(scale) and cosine >= min_cos
    return TensorCheck(
        graph, name, float(diff.max()), max_rel, cosine, top1, bound.atol, bound.rtol, error, scale, passed
    )


def real_positions(name: str, attention_mask: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """Where an output holds a real token's value: logits at the query positions, a self-attention
    cache at the key positions the attention mask marks as real. A padding position has no
    defined value: its query attends to nothing, so every runtime fills it in its own way (fp16
    graphs differ there by how the runtime rounds the mask, ONNX Runtime's fused attention writes
    zeros) and nothing ever reads it, its keys being masked. Cross caches (the encoder's) are
    all real, and so is an encoder's output (its padded positions' queries still see the real
    tokens), and a recurrent state (its fixed length is no position; padding leaves it zero)."""
    if name == ENCODER_STATES or is_cross(name):
        return None
    if name != "logits" and shape[2] != attention_mask.shape[1]:  # a recurrent state (fixed length): no positions
        return None
    real = attention_mask.astype(bool)
    if name == "logits":
        return real[:, -shape[1] :, None]  # the last positions: all of them, or the last one (--logits last)
    return real[:, None, :, None]  # [batch, heads, past + seq, head_dim]


def tensor_feeds(
    spec: DecoderSpec,
    kind: GraphKind,
    seed: int,
    kv_dtype: np.dtype = np.dtype(np.float32),
    reference: Runner | None = None,
    *,
    single_row: bool = False,
) -> Feeds:
    """Inputs for one graph: batch 2, the first row left-padded, a non-empty past where allowed
    (``single_row``: the unpadded row alone, batch 1). With a ``reference`` runner the past is the
    keys/values it computes for random past tokens (what a graph sees in use); without one,
    random normal values."""
    feeds = _batch_of_two(spec, kind, seed, kv_dtype, reference)
    return (
        {name: value[1:2] for name, value in feeds.items()} if single_row else feeds
    )  # every feed's first axis is the batch


def _batch_of_two(spec: DecoderSpec, kind: GraphKind, seed: int, kv_dtype: np.dtype, reference: Runner | None) -> Feeds:
    rng = np.random.default_rng(seed)
    if kind is GraphKind.ENCODER and spec.encoder_features is not None:  # log-mel features, fp16-exact values
        features = rng.standard_normal((2, *spec.encoder_features)).astype(np.float16)
        return {ENCODER_FEATURES: features.astype(kv_dtype)}
    if kind is GraphKind.ENCODER:
        return {
            "input_ids": rng.integers(0, spec.vocab_size, size=(2, 6), dtype=np.int64),
            "attention_mask": _encoder_mask(2, 6),
        }
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
    masked = (
        {ENCODER_MASK: _encoder_mask(2, encoder.shape[1])}
        if spec.has_encoder and spec.encoder_features is None and encoder is not None
        else {}
    )  # (a speech encoder's decoder reads no mask)
    feeds |= masked
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
                prompt |= {ENCODER_STATES: encoder, **masked}
            presents = reference.run(GraphKind.PREFILL, prompt)
        shapes = {
            name: (t.heads, t.width, t.length)  # length: a recurrent state's fixed one, else 0
            for (name, _), (_, t) in zip(carried_cache(spec), spec.cache_layout.tensors(), strict=True)
        }
        for name, present in carried_cache(spec):
            length = encoder.shape[1] if encoder is not None and is_cross(name) else shapes[name][2] or past
            value = (
                presents[present]
                if presents is not None
                else rng.standard_normal((2, shapes[name][0], length, shapes[name][1]))
            )
            feeds[name] = np.asarray(value).astype(kv_dtype)
    return feeds


def _encoder_mask(batch: int, length: int) -> np.ndarray:
    """An encoder-decoder's encoder mask with the last two positions of row 1 padding."""
    mask = np.ones((batch, length), dtype=np.int64)
    mask[1, length - 2 :] = 0
    return mask


def tensor_parity(
    reference: Runner,
    candidate: Runner,
    spec: DecoderSpec,
    tolerance: Tolerance,
    seed: int = 0,
    kv_dtype: np.dtype = np.dtype(np.float32),
    *,
    single_row: bool = False,
    keep: list[tuple[GraphKind, Feeds, Feeds]] | None = None,
    kinds: Sequence[GraphKind] | None = None,
) -> list[TensorCheck]:
    """Every output of each of the candidate's graphs (``kinds``: those of them) against the
    reference's on ``tensor_feeds`` (batch 2); with ``single_row``, on their unpadded row alone
    (batch 1). ``keep`` collects each graph's feeds and the candidate's outputs, to judge against
    another reference later."""
    checks: list[TensorCheck] = []
    for kind in kinds if kinds is not None else candidate.graphs():
        feeds = tensor_feeds(spec, kind, seed, kv_dtype, reference, single_row=single_row)
        calls = [(feeds, reference.run(kind, feeds))]
        if kind is GraphKind.UNIFIED:  # and its prompt call from an empty cache, as prefill's
            calls.append(prompt_check(reference, spec, seed, kv_dtype, single_row=single_row))
        for fed, want in calls:
            got = candidate.run(kind, fed)
            if keep is not None:
                keep.append((kind, fed, got))
            checks += compare_outputs(kind, fed, want, got, tolerance)
    return checks


def prompt_check(
    reference: Runner, spec: DecoderSpec, seed: int, kv_dtype: np.dtype, *, single_row: bool
) -> tuple[Feeds, Feeds]:
    """The unified graph's feeds from an empty cache (prefill's tensor feeds, with an empty past
    and, for a cross-attention decoder, the reference's cross cache of them) and the reference's
    outputs there: prefill's own (already recorded) where they hold every position's logits, as
    prefill from an empty cache computes what the unified graph does; else one unified forward."""
    prefill = tensor_feeds(spec, GraphKind.PREFILL, seed, kv_dtype, reference, single_row=single_row)
    want = reference.run(GraphKind.PREFILL, prefill)
    cross = {
        past: np.asarray(want[present]).astype(kv_dtype) for past, present in carried_cache(spec) if is_cross(past)
    }
    batch = len(prefill["input_ids"])
    feeds = {k: v for k, v in prefill.items() if k != ENCODER_STATES} | empty_past(spec, batch, kv_dtype) | cross
    if want["logits"].shape[1] == prefill["input_ids"].shape[1]:  # not --logits last
        return feeds, {name: value for name, value in want.items() if not is_cross(name)}  # (only prefill returns it)
    return feeds, reference.run(GraphKind.UNIFIED, feeds)


def empty_cache(kind: GraphKind, feeds: Feeds) -> bool:
    """Whether ``feeds`` are the unified graph's prompt call (its attention mask no longer than its
    input: no past), which its checks name apart (``TensorCheck.empty_cache``)."""
    return kind is GraphKind.UNIFIED and feeds["attention_mask"].shape[1] == feeds["input_ids"].shape[1]


def compare_outputs(kind: GraphKind, feeds: Feeds, want: Feeds, got: Feeds, tolerance: Tolerance) -> list[TensorCheck]:
    """Every output of one graph's run on ``feeds`` against the reference's (``want``)."""
    checks: list[TensorCheck] = []
    for name, value in want.items():
        # (a speech encoder's graph has no mask: its output is all real)
        real = real_positions(name, feeds["attention_mask"], value.shape) if "attention_mask" in feeds else None
        check = _compare(kind.value, name, value, got[name], tolerance.bound(name), tolerance.min_cosine, real)
        # every output's first axis is the batch
        checks.append(dataclasses.replace(check, batch=len(value), empty_cache=empty_cache(kind, feeds)))
    return checks
