"""The step loop: a prompt, then one token at a time, with the KV cache carried from each step's
``present.*`` outputs to the next step's ``past_key_values.*`` inputs.

Parity (greedy and teacher-forced generation), calibration (its teacher-forced decode feeds)
and ``kiln generate`` all run this one loop; what differs is how a token is chosen (``choose``)
and what runs a step (any object with ``run(kind, feeds) -> outputs``: a parity runner on numpy
arrays, or ``kiln generate``'s IOBinding sessions on OrtValues).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from kiln.exporter.contract.io import ENCODER_MASK, ENCODER_STATES, GraphKind
from kiln.plugins.base import DecoderSpec
from kiln.plugins.cache_layout import Span

__all__ = [
    "Step",
    "StepRunner",
    "Chooser",
    "left_pad",
    "right_pad",
    "prompt_feeds",
    "encoder_decoder_feeds",
    "empty_past",
    "carry",
    "run_steps",
]

Chooser = Callable[[int, np.ndarray], np.ndarray]  # (step, last-position logits [B, vocab]) -> tokens [B]


class StepRunner(Protocol):
    def run(self, kind: GraphKind, feeds: dict[str, Any]) -> Mapping[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class Step:
    index: int  # 0: the prompt's step
    feeds: dict[str, Any]  # what the step ran on
    logits: np.ndarray  # its last-position logits [B, vocab], float32
    tokens: np.ndarray  # the tokens chosen from them [B] int64


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, length: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` ([B, L] int64) of prompts left-padded
    to ``length`` (default: the longest prompt's)."""
    length = max([len(p) for p in prompts] + [length or 0])
    ids = np.full((len(prompts), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), length), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt) :] = prompt
        mask[row, length - len(prompt) :] = 1
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int64)
    return ids, mask, pos


def prompt_feeds(prompts: Sequence[Sequence[int]], pad_id: int, length: int | None = None) -> dict[str, Any]:
    """The prompt step's feeds of ``prompts`` left-padded (to ``length``, as ``left_pad``)."""
    ids, mask, pos = left_pad(prompts, pad_id, length)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}


def right_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, length: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``input_ids`` and ``attention_mask`` ([B, L] int64) of right-padded encoder inputs (to
    ``length``, as ``left_pad``): an encoder with absolute positions (BART, Marian) numbers every
    row from 0, as its tokenizer pads."""
    length = max([len(p) for p in prompts] + [length or 0])
    ids = np.full((len(prompts), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), length), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
        mask[row, : len(prompt)] = 1
    return ids, mask


def encoder_decoder_feeds(
    encode: Callable[[np.ndarray, np.ndarray], np.ndarray],
    prompts: Sequence[Sequence[int]],
    start: int,
    pad_id: int,
    length: int | None = None,
) -> dict[str, Any]:
    """An encoder-decoder's first step (parity and ``kiln generate`` alike): ``prompts`` are the
    encoder's inputs, right-padded and run through ``encode(ids, mask) -> states``; the decoder
    starts from ``start`` (its ``decoder_start_token_id``) in every row, unpadded (its positions
    are its cache's length: a decoder input is never left-padded); ``length`` as ``right_pad``'s."""
    ids, mask = right_pad(prompts, pad_id, length)
    return prompt_feeds([[start]] * len(prompts), pad_id) | {ENCODER_MASK: mask, ENCODER_STATES: encode(ids, mask)}


def empty_past(spec: DecoderSpec, batch: int, dtype: np.dtype) -> dict[str, Any]:
    """A self-attention cache of length 0, and a recurrent state of zeros (its fixed length), for a
    prompt through the unified graph."""
    return {
        f"past_key_values.{i}.{t.suffix}": np.zeros((batch, t.heads, t.length, t.width), dtype=dtype)
        for i, t in spec.cache_layout.tensors()
        if t.span is not Span.ENCODER
    }


def carry(
    feeds: dict[str, Any], outputs: Mapping[str, Any], previous: Mapping[str, Any], pairs: Sequence[tuple[str, str]]
) -> dict[str, Any]:
    """The next step's feeds: each past from this step's present, or (a cross cache, which only
    prefill returns) from the previous step's feeds."""
    for past, present in pairs:
        feeds[past] = outputs[present] if present in outputs else previous[past]
    return feeds


def _last_logits(value: Any) -> np.ndarray:
    """A copy: an OrtValue's ``numpy()`` may be a view of a buffer the next step overwrites
    (``kiln generate`` binds one logits buffer to every decode step)."""
    array = value if isinstance(value, np.ndarray) else value.numpy()  # an OrtValue or a tensor
    return np.array(array[:, -1, :], dtype=np.float32)


def run_steps(
    runner: StepRunner,
    pairs: Sequence[tuple[str, str]],
    first: dict[str, Any],
    steps: int,
    choose: Chooser,
    *,
    first_kind: GraphKind = GraphKind.PREFILL,
    step_kind: GraphKind = GraphKind.DECODE,
) -> Iterator[Step]:
    """Run ``first`` (the prompt's feeds), then up to ``steps - 1`` steps of one token each; yield
    every step (its feeds, last logits and chosen tokens) before the next one runs, so a caller
    may stop early (an end token). ``pairs`` are the ``(past, present)`` names carried."""
    feeds, outputs = first, runner.run(first_kind, first)
    mask, pos = first["attention_mask"], first["position_ids"]
    constant = {ENCODER_MASK: first[ENCODER_MASK]} if ENCODER_MASK in first else {}  # an encoder-decoder's, every step
    for step in range(steps):
        logits = _last_logits(outputs["logits"])
        tokens = np.asarray(choose(step, logits), dtype=np.int64)
        yield Step(step, feeds, logits, tokens)
        if step == steps - 1:
            return
        pos = pos[:, -1:] + 1
        mask = np.concatenate([mask, np.ones((mask.shape[0], 1), dtype=np.int64)], axis=1)
        feeds = carry(
            {"input_ids": tokens[:, None], "attention_mask": mask, "position_ids": pos, **constant},
            outputs,
            feeds,
            pairs,
        )
        outputs = runner.run(step_kind, feeds)
