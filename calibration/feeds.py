"""Feeds for calibrating each graph: prompts through prefill, and teacher-forced decode steps
whose past cache (the layout's own tensors: keys/values or recurrent states) comes from the
PyTorch model itself (the contract's step loop, forced on the data's own next tokens), so the
activation ranges cover the cache path, not only the prompt."""

from __future__ import annotations

import numpy as np

from kiln.exporter.contract.io import GraphKind, carried_cache
from kiln.exporter.contract.steps import empty_past, prompt_feeds, run_steps
from kiln.exporter.runners import Feeds, TorchRunner
from kiln.plugins.base import DecoderSpec

__all__ = ["calibration_feeds", "DECODE_STEPS"]

DECODE_STEPS = 4  # teacher-forced decode steps after each prompt


def calibration_feeds(spec: DecoderSpec, kind: GraphKind, window: np.ndarray, reference: TorchRunner) -> list[Feeds]:
    """fp32 feeds of one calibration window for ``kind``: prefill gets the window's prompt,
    decode the next ``DECODE_STEPS`` true tokens one by one, the unified graph both."""
    steps = min(DECODE_STEPS, len(window) - 1)
    prompt = window[: len(window) - steps]
    first = prompt_feeds([prompt.tolist()], 0)  # one unpadded row
    if kind is GraphKind.PREFILL:
        return [first]
    out = [{**first, **empty_past(spec, 1, np.dtype(np.float32))}] if kind is GraphKind.UNIFIED else []
    forced = window[len(prompt) :]  # the data's own continuation

    def choose(step: int, logits: np.ndarray) -> np.ndarray:
        return forced[step : step + 1]

    run = run_steps(reference, carried_cache(spec), first, steps + 1, choose)
    return out + [step.feeds for step in run if step.index > 0]
