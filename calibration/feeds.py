"""Feeds for calibrating each graph: prompts through prefill, and teacher-forced decode steps
whose past keys/values come from the PyTorch model itself, so the activation ranges cover the
KV path, not only the prompt."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.exporter.io_contract import GraphKind, past_names, present_names
from kiln.exporter.runners import Feeds, TorchRunner
from kiln.plugins.base import DecoderSpec

__all__ = ["calibration_feeds", "DECODE_STEPS"]

DECODE_STEPS = 4  # teacher-forced decode steps after each prompt


def _prompt(ids: np.ndarray) -> Feeds:
    row = ids[None, :]
    return {"input_ids": row, "attention_mask": np.ones_like(row), "position_ids": np.arange(row.shape[1], dtype=np.int64)[None, :]}


def calibration_feeds(spec: DecoderSpec, kind: GraphKind, windows: Sequence[np.ndarray], reference: TorchRunner) -> list[Feeds]:
    """fp32 feeds for ``kind``: prefill gets each window's prompt, decode the next
    ``DECODE_STEPS`` true tokens one by one, the unified graph both."""
    out: list[Feeds] = []
    for window in windows:
        steps = min(DECODE_STEPS, len(window) - 1)
        prompt = window[: len(window) - steps]
        first = _prompt(prompt)
        if kind is GraphKind.PREFILL:
            out.append(first)
            continue
        if kind is GraphKind.UNIFIED:
            empty = np.zeros((1, spec.n_kv_heads, 0, spec.head_dim), dtype=np.float32)
            out.append({**first, **{n: empty for i in range(spec.n_layers) for n in past_names(i)}})
        outputs = reference.run(GraphKind.PREFILL, first)
        mask = first["attention_mask"]
        for t in range(steps):
            position = len(prompt) + t
            mask = np.concatenate([mask, np.ones((1, 1), dtype=np.int64)], axis=1)
            feeds: Feeds = {
                "input_ids": window[position : position + 1][None, :],
                "attention_mask": mask,
                "position_ids": np.array([[position]], dtype=np.int64),
            }
            for i in range(spec.n_layers):
                for past, present in zip(past_names(i), present_names(i), strict=True):
                    feeds[past] = outputs[present]
            out.append(feeds)
            outputs = reference.run(GraphKind.DECODE, feeds)
    return out
