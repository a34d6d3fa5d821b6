"""Quality's figures (``parity.quality``) on logits whose answers are known, its gate per precision,
its budget of tokens, and its panel in the plot apart from the proof's."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.parity import ParityResult
from kiln.exporter.parity.plot import figure
from kiln.exporter.parity.quality import QualityResult, graph_quality, reference_logprobs, threshold_for
from kiln.exporter.parity.quality_text import QualityText, budget, chunked
from kiln.exporter.precision import TOLERANCES
from kiln.exporter.runners.base import Feeds
from kiln.plugins.base import DecoderSpec
from kiln.plugins.native.spec import spec_of
from kiln_testing import tiny_config


class _Table:
    """A prefill whose logits at a position depend only on the token there: row ``token`` of ``table``."""

    name = "table"

    def __init__(self, table: np.ndarray) -> None:
        self.table = table

    def graphs(self) -> tuple[GraphKind, ...]:
        return (GraphKind.PREFILL,)

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        assert kind is GraphKind.PREFILL
        return {"logits": self.table[np.asarray(feeds["input_ids"])]}


def _spec() -> DecoderSpec:
    return spec_of(tiny_config())


def test_figures_of_known_logits() -> None:
    spec = _spec()
    text = QualityText("t", True, (np.array([0, 1, 2, 1], dtype=np.int64),))
    table = np.log(np.full((spec.vocab_size, spec.vocab_size), 0.5 / (spec.vocab_size - 1), dtype=np.float32))
    for t in range(spec.vocab_size):
        table[t, (t + 1) % spec.vocab_size] = math.log(0.5)  # each token predicts the next id with p = 0.5
    reference = reference_logprobs(_Table(table), spec, text)
    same = graph_quality(_Table(table), spec, text, reference, 0.9)
    assert same.agreement == 1 and same.kl == pytest.approx(0, abs=1e-6) and same.passed
    assert same.perplexity_checkpoint == pytest.approx(same.perplexity_graphs)
    assert same.perplexity_checkpoint == pytest.approx(
        math.exp(-(2 * math.log(0.5) + math.log(0.5 / (spec.vocab_size - 1))) / 3), rel=1e-5
    )
    flat = graph_quality(_Table(np.zeros_like(table)), spec, text, reference, 0.9)  # uniform: argmax 0 everywhere
    assert (
        flat.agreement == 0 and flat.kl > 0 and not flat.passed
    )  # its argmax (0, the first of equals) is never the reference's
    assert flat.perplexity_graphs == pytest.approx(spec.vocab_size, rel=1e-5)


def test_gate_per_precision_and_budget() -> None:
    assert (
        threshold_for("int4+fp16", "auto") == 0.85
        and threshold_for("fp8", "auto") == 0.9
        and threshold_for("int8", "0.5") == 0.5
    )
    assert threshold_for("fp16", "auto") is None and threshold_for("int4", "off") is None
    assert budget(4096, 512) == (2048, 256) and budget(128_256, 8192) == (523, 256) and budget(100, 8) == (2048, 8)
    text = chunked(list(range(9)), "t", 100, 4)
    assert [c.tolist() for c in text.chunks] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a last chunk of one token dropped


def test_the_quality_panel_is_apart_from_the_proof() -> None:
    result = ParityResult("onnxruntime", "int4", TOLERANCES["int4"])
    result.quality = QualityResult("heldout", True, 2048, 0.891, 0.028, 9.6, 9.8, 0.85)
    _, _, quality = figure(result).axes
    assert "quality, apart from the proof (gating: top-1 agreement at least 0.85)" in quality.get_title()
    (gate,) = quality.get_lines()
    assert list(gate.get_xdata()) == [85, 85]
