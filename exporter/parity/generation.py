"""Generation-level parity: each candidate generates greedily as users run it, its unified graph is
fed those tokens in chunks, and every step is judged against the reference's logits at the same
prefix (the reference scores the candidate's sequence: ``parity.scoring``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.exporter.contract.io import (
    ENCODER_FEATURES,
    ENCODER_MASK,
    ENCODER_STATES,
    GraphKind,
    carried_cache,
    is_cross,
)
from kiln.exporter.contract.steps import carry, empty_past, encoder_decoder_feeds, left_pad, prompt_feeds, run_steps
from kiln.exporter.parity.results import GenerationCheck
from kiln.exporter.runners.base import Feeds, Runner
from kiln.exporter.tolerance import Tolerance
from kiln.plugins.base import DecoderSpec

__all__ = [
    "greedy",
    "candidate_run",
    "unified_chunks",
    "judge",
    "make_prompts",
    "left_pad",
    "encoder_states",
    "first_feeds",
    "stand_in_features",
]  # left_pad: contract.steps


def make_prompts(spec: DecoderSpec, lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Random prompts of the given lengths, avoiding special tokens."""
    rng = np.random.default_rng(seed)
    special = {t for t in (spec.bos_token_id, spec.eos_token_id, spec.pad_token_id) if t is not None}
    allowed = np.array([t for t in range(spec.vocab_size) if t not in special])
    return [rng.choice(allowed, size=n).tolist() for n in lengths]


def encoder_states(
    spec: DecoderSpec, batch: int, seed: int = 0, length: int = 6, dtype: np.dtype = np.dtype(np.float32)
) -> np.ndarray | None:
    """Deterministic stand-in encoder output ``[batch, length, encoder_dim]`` for a cross-attention
    decoder (None for any other): what parity feeds every backend alike."""
    if spec.encoder_dim is None:
        return None
    return np.random.default_rng(seed).standard_normal((batch, length, spec.encoder_dim)).astype(dtype)


def greedy(
    runner: Runner,
    spec: DecoderSpec,
    prompts: Sequence[Sequence[int]],
    steps: int,
    *,
    unified: bool = False,
    forced: np.ndarray | None = None,
    kv_dtype: np.dtype = np.dtype(np.float32),
    length: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding through prefill + decode (or the unified graph alone), the prompts padded
    to ``length`` (default: the longest prompt's).

    Returns the tokens ``[B, steps]`` and the last-position logits of every step
    ``[steps, B, vocab]`` (float32). With ``forced``, those tokens are fed instead of the argmax.
    A cross-attention decoder reads ``encoder_states(spec, B)``; the unified graph takes the
    cross cache as an input (like decode), so that path starts from the runner's own prefill
    graph's cross cache, as a user of model.onnx would. An encoder-decoder's ``prompts`` are
    its encoder's inputs (right-padded): the runner's own encoder graph encodes them, and the
    decoder starts from ``decoder_start_token_id``, as transformers' ``generate()`` does.
    """
    feeds, encoder = first_feeds(runner, spec, prompts, length, kv_dtype)
    batch = len(prompts)
    if encoder is not None:
        feeds[ENCODER_STATES] = encoder.astype(kv_dtype)  # (via float32, as every other caller rounds it)
    if unified:
        feeds = _unified_first(runner, spec, feeds, encoder is not None, kv_dtype)
    kinds = (GraphKind.UNIFIED, GraphKind.UNIFIED) if unified else (GraphKind.PREFILL, GraphKind.DECODE)
    tokens = np.zeros((batch, steps), dtype=np.int64)
    logits_per_step = np.zeros((steps, batch, spec.vocab_size), dtype=np.float32)

    def choose(step: int, logits: np.ndarray) -> np.ndarray:
        return forced[:, step] if forced is not None else logits.argmax(-1)

    for step in run_steps(runner, carried_cache(spec), feeds, steps, choose, first_kind=kinds[0], step_kind=kinds[1]):
        tokens[:, step.index] = step.tokens
        logits_per_step[step.index] = step.logits
    return tokens, logits_per_step


def _unified_first(runner: Runner, spec: DecoderSpec, feeds: Feeds, cross: bool, kv_dtype: np.dtype) -> Feeds:
    """The unified graph's prompt feeds from the prompt step's: an empty self-attention cache and,
    for a cross-attention decoder, the cross cache of the runner's own prefill graph (the unified
    graph takes it as an input, like decode)."""
    caches: Feeds = {}
    if cross:
        prefill = runner.run(GraphKind.PREFILL, feeds)
        caches = {past: prefill[present].astype(kv_dtype) for past, present in carried_cache(spec) if is_cross(past)}
    batch = len(feeds["input_ids"])
    return {k: v for k, v in feeds.items() if k != ENCODER_STATES} | empty_past(spec, batch, kv_dtype) | caches


def stand_in_features(spec: DecoderSpec, prompts: Sequence[Sequence[int]]) -> np.ndarray:
    """A speech encoder's log-mel input for parity ``[B, n_mels, frames]`` float32: each prompt
    stands for random features seeded by its tokens (so a row's input is the same in any batch),
    rounded to values fp16 holds exactly (an fp16 graph and the fp32 reference read the same)."""
    assert spec.encoder_features is not None, "only a speech encoder-decoder reads features"
    rows = [np.random.default_rng([7, *prompt]).standard_normal(spec.encoder_features) for prompt in prompts]
    return np.stack(rows).astype(np.float16).astype(np.float32)


def first_feeds(
    runner: Runner,
    spec: DecoderSpec,
    prompts: Sequence[Sequence[int]],
    length: int | None,
    kv_dtype: np.dtype = np.dtype(np.float32),
) -> tuple[Feeds, np.ndarray | None]:
    """The prompt step's feeds and the encoder states it reads (None: no cross-attention); an
    encoder-decoder's are the runner's own encoder's (a speech encoder's on ``stand_in_features``
    of the prompts, fed in ``kv_dtype``, the graphs' float dtype)."""
    pad = spec.pad_token_id if spec.pad_token_id is not None else 0
    if not spec.has_encoder:
        return prompt_feeds(prompts, pad, length), encoder_states(spec, len(prompts))
    assert spec.decoder_start_token_id is not None, "the family refuses an encoder-decoder without a start token"
    if spec.encoder_features is not None:
        features = {ENCODER_FEATURES: stand_in_features(spec, prompts).astype(kv_dtype)}
        states = np.asarray(runner.run(GraphKind.ENCODER, features)[ENCODER_STATES], dtype=np.float32)
        return prompt_feeds([[spec.decoder_start_token_id]] * len(prompts), pad), states

    def encode(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return np.asarray(
            runner.run(GraphKind.ENCODER, {"input_ids": ids, "attention_mask": mask})[ENCODER_STATES], dtype=np.float32
        )

    feeds = encoder_decoder_feeds(encode, prompts, spec.decoder_start_token_id, pad, length)
    return feeds, feeds.pop(ENCODER_STATES)


def unified_chunks(
    runner: Runner,
    spec: DecoderSpec,
    prompts: Sequence[Sequence[int]],
    tokens: np.ndarray,
    *,
    kv_dtype: np.dtype = np.dtype(np.float32),
    length: int | None = None,
) -> np.ndarray:
    """The unified graph teacher-forced on ``tokens`` ``[B, steps]`` in two calls with its cache,
    as a user who feeds it whole chunks runs it: the prompt (padded as ``greedy`` pads it) from an
    empty cache, then every token but the last in one call. Returns the logits that chose each
    token ``[steps, B, vocab]`` (float32): the prompt's last position's, then each fed token's."""
    feeds, encoder = first_feeds(runner, spec, prompts, length, kv_dtype)
    if encoder is not None:
        feeds[ENCODER_STATES] = encoder.astype(kv_dtype)
    first = _unified_first(runner, spec, feeds, encoder is not None, kv_dtype)
    outputs = runner.run(GraphKind.UNIFIED, first)
    logits = [np.asarray(outputs["logits"][:, -1:], dtype=np.float32)]
    fed = tokens.shape[1] - 1
    if fed > 0:
        batch, mask = tokens.shape[0], first["attention_mask"]
        chunk = {
            "input_ids": np.ascontiguousarray(tokens[:, :fed], dtype=np.int64),
            "attention_mask": np.concatenate([mask, np.ones((batch, fed), dtype=np.int64)], axis=1),
            "position_ids": first["position_ids"][:, -1:] + 1 + np.arange(fed, dtype=np.int64),
            **({ENCODER_MASK: first[ENCODER_MASK]} if ENCODER_MASK in first else {}),
        }
        outputs = runner.run(GraphKind.UNIFIED, carry(chunk, outputs, first, carried_cache(spec)))
        logits.append(np.asarray(outputs["logits"], dtype=np.float32))
    return np.concatenate(logits, axis=1).transpose(1, 0, 2)


def candidate_run(
    runner: Runner,
    spec: DecoderSpec,
    prompts: Sequence[Sequence[int]],
    steps: int,
    *,
    unified: bool,
    kv_dtype: np.dtype = np.dtype(np.float32),
    length: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A candidate's own greedy run through prefill + decode (its tokens ``[B, steps]`` and the
    logits that chose them ``[steps, B, vocab]``) and, with ``unified``, the unified graph's logits
    teacher-forced on those tokens in chunks (``unified_chunks``; None without it)."""
    tokens, logits = greedy(runner, spec, prompts, steps, kv_dtype=kv_dtype, length=length)
    chunked = unified_chunks(runner, spec, prompts, tokens, kv_dtype=kv_dtype, length=length) if unified else None
    return tokens, logits, chunked


def judge(
    prompts: Sequence[Sequence[int]],
    ref_logits: np.ndarray,
    cand_logits: np.ndarray,
    tolerance: Tolerance,
    unified: bool,
    length: int | None,
) -> GenerationCheck:
    """One batch's candidate logits ``[steps, B, vocab]`` against the reference's logits at the
    same positions of the candidate's own sequence (``parity.scoring``): at every step the token
    the candidate chose must be the reference's argmax at that prefix, or a tie (``_divergence``).
    A sequence whose every token is the reference's argmax at its prefix is the reference's own
    greedy sequence (by induction), so this proves what generating with the reference would.
    A precision with a token-match floor (int8's and fp8's 0.9, int4's agreement 0.7) counts a
    near-tie as agreement: its two logits are within the precision's own tolerance, so a correct
    graph may order them either way (random prompts never judge quantization quality: real text
    does, ``parity.quality``)."""
    ref_tokens = ref_logits.argmax(-1).T  # [B, steps]: the reference's choice at each of the candidate's prefixes
    cand_tokens = cand_logits.argmax(-1).T  # [B, steps]
    mismatch = cand_tokens != ref_tokens
    scale = np.abs(ref_logits).max(axis=2)  # [steps, B]: each row's own scale, as the tensor checks'
    first, ties = _divergence(ref_logits, ref_tokens, cand_tokens, tolerance.logits.limit(scale))
    match = float(1.0 - mismatch.mean())
    return GenerationCheck(
        path="model" if unified else "prefill+decode",
        batch=len(prompts),
        prompt_lengths=tuple(len(p) for p in prompts),
        padded_to=max([len(p) for p in prompts] + [length or 0]),
        steps=ref_tokens.shape[1],
        token_match_rate=match,
        first_divergence=first,
        ties=ties,
        per_step_max_abs=tuple(float(x) for x in np.abs(cand_logits - ref_logits).max(axis=(1, 2))),
        per_step_scale=tuple(float(x) for x in scale.max(axis=1)),
        per_step_match=tuple(float(x) for x in 1.0 - mismatch.mean(axis=0)),
        passed=first is None
        if tolerance.min_token_match >= 1.0
        else match + ties / mismatch.size >= tolerance.min_token_match,
    )


def _divergence(
    ref_logits: np.ndarray, ref_tokens: np.ndarray, cand_tokens: np.ndarray, limit: np.ndarray
) -> tuple[int | None, int]:
    """The first step where the candidate's argmax differs from the reference's argmax other than
    by a tie, and the number of ties: a mismatch where the reference's own logits of the two
    tokens are within twice that row's logits limit (``limit``, [steps, B]) of each other, an
    order that a candidate within tolerance on both may reverse."""
    ties, first = 0, None
    for b, t in zip(*np.nonzero(cand_tokens != ref_tokens), strict=True):
        margin = ref_logits[t, b, ref_tokens[b, t]] - ref_logits[t, b, cand_tokens[b, t]]
        if margin <= 2 * limit[t, b]:
            ties += 1
        elif first is None or t < first:
            first = int(t)
    return first, ties
