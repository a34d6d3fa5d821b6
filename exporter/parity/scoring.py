"""The reference scores the candidates' sequences: every row's prompt and generated tokens fed
teacher-forced in one forward (chunked where long), its logits read at each generated position.

This is what verifying a draft costs (speculative decoding's check): one forward for a whole
sequence, where generating it costs one forward per token. Rows of every candidate, graph path
and batch share the forwards (rows are independent: each has its own mask and positions, and a
cross-attention decoder's row its own stand-in encoder states), and a sequence two of them share
(the unified graph is fed prefill + decode's tokens; graph sets that generate alike) is scored once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.exporter.contract.io import ENCODER_MASK, ENCODER_STATES, GraphKind, carried_cache
from kiln.exporter.contract.steps import carry
from kiln.exporter.parity.generation import candidate_run, first_feeds, judge
from kiln.exporter.parity.results import GenerationCheck
from kiln.exporter.runners.base import Feeds, Runner
from kiln.exporter.tolerance import Tolerance
from kiln.plugins.base import DecoderSpec

__all__ = ["LOGITS_BYTES", "generation_parity", "score"]

LOGITS_BYTES = 1 << 28  # the logits one forward may return (256 MB): positions per forward = this / (4 x vocab)


def score(
    reference: Runner,
    spec: DecoderSpec,
    groups: Sequence[Sequence[Sequence[int]]],
    length: int | None,
    sequences: Sequence[tuple[int, np.ndarray]],
) -> list[np.ndarray]:
    """The reference's logits ``[steps, B, vocab]`` that each sequence's tokens were chosen from,
    teacher-forced: ``sequences`` are ``(group, tokens [B, steps])``, row ``b`` of a group's prompts
    followed by its tokens. ``reference``'s prefill must return every position's logits (a
    ``TorchRunner`` with ``last_logits_only`` off); its prompts are padded as ``greedy`` pads them."""
    firsts = [_first(reference, spec, prompts, length) for prompts in groups]
    index: dict[tuple[int, int, bytes], int] = {}
    rows: list[Feeds] = []
    picks: list[list[int]] = []  # each sequence's rows among those scored
    for group, tokens in sequences:
        picks.append([])
        for b in range(tokens.shape[0]):
            key = (
                group,
                b,
                np.ascontiguousarray(tokens[b, :-1], dtype=np.int64).tobytes(),
            )  # the last token is chosen, never fed
            if key not in index:
                index[key] = len(rows)
                rows.append(_row(firsts[group], b, tokens[b]))
            picks[-1].append(index[key])
    if not rows:
        return []
    stacked = {name: np.concatenate([row[name] for row in rows]) for name in rows[0]}
    logits = _forward(reference, spec, stacked, firsts[0]["input_ids"].shape[1])  # [rows, steps, vocab]
    return [logits[pick].transpose(1, 0, 2) for pick in picks]


def _first(reference: Runner, spec: DecoderSpec, prompts: Sequence[Sequence[int]], length: int | None) -> Feeds:
    """A group's prompt feeds as the reference reads them (its encoder states in float32)."""
    feeds, encoder = first_feeds(reference, spec, prompts, length)
    return feeds | ({ENCODER_STATES: encoder} if encoder is not None else {})


def _row(first: Feeds, b: int, tokens: np.ndarray) -> Feeds:
    """Row ``b`` of a group's prompt feeds, followed by every token but the last."""
    fed = np.asarray(tokens[:-1], dtype=np.int64)[None]
    pos = first["position_ids"][b : b + 1]
    row = {
        "input_ids": np.concatenate([first["input_ids"][b : b + 1], fed], axis=1),
        "attention_mask": np.concatenate([first["attention_mask"][b : b + 1], np.ones_like(fed)], axis=1),
        "position_ids": np.concatenate([pos, pos[:, -1:] + 1 + np.arange(fed.shape[1], dtype=np.int64)], axis=1),
    }
    return row | {name: first[name][b : b + 1] for name in (ENCODER_STATES, ENCODER_MASK) if name in first}


def _forward(reference: Runner, spec: DecoderSpec, feeds: Feeds, prompt: int) -> np.ndarray:
    """Every row's logits at positions ``prompt - 1`` onwards ``[rows, steps, vocab]``, in as few
    forwards as ``LOGITS_BYTES`` allows: rows together, a row too long for one forward in chunks
    of positions (the first through prefill, the next through the unified contract with the cache)."""
    rows, total = feeds["input_ids"].shape
    budget = max(1, LOGITS_BYTES // (4 * spec.vocab_size))
    per = max(1, budget // total)
    span = max(1, budget // per)
    return np.concatenate(
        [
            _rows(reference, spec, {k: v[r : r + per] for k, v in feeds.items()}, prompt, span)
            for r in range(0, rows, per)
        ]
    )


def _rows(reference: Runner, spec: DecoderSpec, feeds: Feeds, prompt: int, span: int) -> np.ndarray:
    """One forward's rows, in chunks of ``span`` positions carried through the cache."""
    total, kept = feeds["input_ids"].shape[1], []
    previous: Feeds = {}
    outputs: Feeds = {}
    for start in range(0, total, span):
        end = min(total, start + span)
        step = {name: feeds[name][:, start:end] for name in ("input_ids", "position_ids")} | {
            "attention_mask": feeds["attention_mask"][:, :end]
        }
        step |= {ENCODER_MASK: feeds[ENCODER_MASK]} if ENCODER_MASK in feeds else {}
        if start == 0:
            kind = GraphKind.PREFILL
            step |= {ENCODER_STATES: feeds[ENCODER_STATES]} if ENCODER_STATES in feeds else {}
        else:
            kind, step = GraphKind.UNIFIED, carry(step, outputs, previous, carried_cache(spec))
        outputs, previous = reference.run(kind, step), step
        logits = np.asarray(outputs["logits"], dtype=np.float32)
        assert logits.shape[1] == end - start, "the reference's prefill returns every position's logits"
        kept.append(logits[:, max(0, prompt - 1 - start) :])
    return np.concatenate(kept, axis=1)


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
    length: int | None = None,
) -> GenerationCheck:
    """One batch's generation check: the candidate generates greedily through prefill + decode
    (``unified``: the unified graph is then fed those tokens in chunks and judged), and the
    reference (a runner whose prefill returns every position's logits) scores that sequence
    teacher-forced (``parity.scoring``); each step is judged against the reference's logits at it."""
    tokens, logits, chunked = candidate_run(
        candidate, spec, prompts, steps, unified=unified, kv_dtype=kv_dtype, length=length
    )
    (scored,) = score(reference, spec, [prompts], length, [(0, tokens)])
    return judge(prompts, scored, chunked if chunked is not None else logits, tolerance, unified, length)
