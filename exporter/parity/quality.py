"""Quantization quality: the exported graphs that carry the export's quantization (the portable
graphs, or a target's quantized graphs beside float portable ones: ``quality_gate.measured_graphs``)
against the checkpoint's model on text, teacher-forced (``parity.quality_text``: real text, or
random tokens that never judge).

What parity's proof does not say: how much the quantization itself costs. Each chunk runs once
through PyTorch (its log-probabilities kept: the reference phase, while the model is in memory,
before any runtime's weights are) and once through the graphs' prefill (the candidate phase), and
is compared position by position: top-1 agreement (the same argmax), mean KL divergence
KL(checkpoint || graphs) in nats, and each one's perplexity of the text's next tokens.

On real text the agreement gates a quantized export at ``THRESHOLDS`` (per low-bit kind,
docs/parity.md gives the measurements behind them), or at ``--quality-gate``'s figure, or not at
all (``--quality-gate off``); float exports are reported, never gated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.contract.steps import prompt_feeds
from kiln.exporter.parity.quality_text import QualityText
from kiln.exporter.runners.base import Runner
from kiln.plugins.base import DecoderSpec

__all__ = [
    "THRESHOLDS",
    "UNQUANTIZED",
    "QualityPlan",
    "QualityResult",
    "graph_quality",
    "measures",
    "quantized",
    "reference_logprobs",
    "threshold_for",
]

# top-1 agreement on real text, at least, per low-bit kind (docs/parity.md: the demo's figures behind them)
THRESHOLDS = {"int8": 0.9, "fp8": 0.9, "int4": 0.85}


def quantized(precision: str) -> bool:
    """Whether graphs of ``precision`` (``int4+fp16``...) are of a low-bit kind quality gates."""
    return any(p in THRESHOLDS for p in precision.split("+"))


def threshold_for(precision: str, gate: str) -> float | None:
    """The agreement that gates an export of ``precision`` (``int4+fp16``...) under ``--quality-gate``
    ``gate`` (``auto``, ``off`` or a figure): None where nothing gates (off, or a float precision)."""
    low_bit = next((p for p in precision.split("+") if p in THRESHOLDS), None)
    if gate == "off" or low_bit is None:
        return None
    return THRESHOLDS[low_bit] if gate == "auto" else float(gate)


UNQUANTIZED = "not measured: fp32 graphs compute the checkpoint's model unquantized (parity proves them)"


def measures(spec: DecoderSpec, last_logits_only: bool, precision: str, *, asked: bool = False) -> str | None:
    """Why quality is not measured on this export (None: it is): its prefill must return every
    position's logits of a decoder-only model, and its measured graphs must change the model's
    numbers (fp32 graphs are the model itself: their agreement is parity's, proved tensor by tensor,
    and measuring it again would cost a PyTorch forward and the graphs' prefill over the whole
    quality text; ``UNQUANTIZED``, which ``quality_gate.measured_graphs`` lifts where a target's
    quantized graphs are measured instead), unless ``asked`` (``--eval-data`` named the text)."""
    if spec.has_encoder or spec.encoder_dim is not None:
        return "not measured: a cross-attention decoder's quality needs its encoder's inputs"
    if last_logits_only:
        return "not measured: the prefill graph returns the last position's logits only (--logits last)"
    return UNQUANTIZED if precision == "fp32" and not asked else None


_ROWS = 32  # positions per slice of the float64 arithmetic: [32, vocab] is 39 MB at a 152k vocabulary


def _logprobs(logits: np.ndarray) -> np.ndarray:
    """log-softmax over the last axis, in float64 for the sums, returned as float32; ``_ROWS``
    positions at a time (a whole chunk's float64 temporaries were 1.5 GB at 256 positions of a
    152k vocabulary: the fp32 export's peak)."""
    out = np.empty(logits.shape, dtype=np.float32)
    for start in range(0, logits.shape[0], _ROWS):
        x = logits[start : start + _ROWS].astype(np.float64)
        x -= x.max(-1, keepdims=True)
        out[start : start + _ROWS] = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return out


def _kl(reference: np.ndarray, got: np.ndarray) -> float:
    """The summed KL(reference || got) over two log-probability arrays (float64, ``_ROWS`` at a time)."""
    total = 0.0
    for start in range(0, reference.shape[0], _ROWS):
        ref = reference[start : start + _ROWS].astype(np.float64)
        total += float((np.exp(ref) * (ref - got[start : start + _ROWS])).sum())
    return total


def _chunk_logits(runner: Runner, spec: DecoderSpec, chunk: np.ndarray) -> np.ndarray:
    """The runner's prefill logits ``[n, vocab]`` at every position of one chunk (batch 1, no padding)."""
    pad = spec.pad_token_id if spec.pad_token_id is not None else 0
    logits = np.asarray(runner.run(GraphKind.PREFILL, prompt_feeds([chunk.tolist()], pad))["logits"], dtype=np.float32)
    assert logits.shape[1] == len(chunk), "quality reads every position's logits"
    row: np.ndarray = logits[0]
    return row


def reference_logprobs(runner: Runner, spec: DecoderSpec, text: QualityText) -> list[np.ndarray]:
    """PyTorch's log-probabilities ``[n, vocab]`` per chunk (a ``TorchRunner`` returning every
    position's logits): kept while the graphs run, bounded by ``quality_text.QUALITY_BYTES``."""
    return [_logprobs(_chunk_logits(runner, spec, chunk)) for chunk in text.chunks]


@dataclasses.dataclass(frozen=True)
class QualityResult:
    """The graphs against the checkpoint's model on ``source``; ``threshold``: the agreement that
    gates it (None: recorded only, as on random tokens or a float precision). ``note``: why
    nothing was measured (the figures are then 0)."""

    source: str
    real: bool
    tokens: int
    agreement: float  # share of positions whose argmax is the checkpoint model's
    kl: float  # mean KL(checkpoint || graphs) per position, nats
    perplexity_checkpoint: float
    perplexity_graphs: float
    threshold: float | None = None
    note: str | None = None
    graphs: str = "portable"  # the graph set measured: the portable graphs, or a target's (its name)

    @property
    def passed(self) -> bool:
        return self.threshold is None or self.agreement >= self.threshold

    @property
    def judged(self) -> str:
        """How the figures count: ``gating at 0.85``, or why they are only recorded."""
        if self.note is not None:
            return self.note
        if self.threshold is not None:
            return f"gating: top-1 agreement at least {self.threshold:g}"
        return "recorded: no real text" if not self.real else "recorded: not gated"

    def figures(self) -> str:
        """``top-1 agreement 0.912, KL 0.031, perplexity 18.7 (checkpoint) -> 19.2 (portable graphs) over 1024
        tokens of SOURCE``."""
        if self.note is not None:
            return self.note
        return (
            f"top-1 agreement {self.agreement:.3f}, KL {self.kl:.3g}, perplexity "
            f"{self.perplexity_checkpoint:.4g} (checkpoint) -> "
            f"{self.perplexity_graphs:.4g} ({self.graphs} graphs) over {self.tokens} tokens of {self.source}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "passed": self.passed, "judged": self.judged}


def graph_quality(
    runner: Runner,
    spec: DecoderSpec,
    text: QualityText,
    reference: Sequence[np.ndarray],
    threshold: float | None,
    graphs: str = "portable",
) -> QualityResult:
    """The graphs' prefill on every chunk against PyTorch's kept log-probabilities (``graphs``: their set's name)."""
    agree = kl = nll_ref = nll_graph = 0.0
    positions = predicted = 0
    for chunk, ref in zip(text.chunks, reference, strict=True):
        got = _logprobs(_chunk_logits(runner, spec, chunk))
        agree += float((ref.argmax(-1) == got.argmax(-1)).sum())
        kl += _kl(ref, got)
        following = chunk[1:]
        nll_ref -= float(ref[np.arange(len(following)), following].astype(np.float64).sum())
        nll_graph -= float(got[np.arange(len(following)), following].astype(np.float64).sum())
        positions += len(chunk)
        predicted += len(following)
    return QualityResult(
        text.source, text.real, text.tokens, agree / positions, max(0.0, kl / positions), math.exp(nll_ref / predicted),
        math.exp(nll_graph / predicted), threshold if text.real else None, graphs=graphs,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class QualityPlan:
    """What ``check_parity`` measures quality on, and the agreement that gates it; ``note``: why
    it is not measured on this export (``measures``); ``target``: the graph set measured, a
    target's name (None: the portable graphs)."""

    text: QualityText
    threshold: float | None
    note: str | None = None
    target: str | None = None

    @property
    def graphs(self) -> str:
        """The measured graph set's name in the reports: ``portable`` or the target's."""
        return self.target or "portable"

    def unmeasured(self) -> QualityResult:
        assert self.note is not None, "only an export quality is not measured on"
        return QualityResult(self.text.source, self.text.real, 0, 0.0, 0.0, 0.0, 0.0, None, self.note, self.graphs)
