"""Tensor parity compares values at real positions only, and finiteness everywhere.

A left-padded row's padding positions have no defined output (their query attends to nothing)
and nothing reads them; an fp16 graph fills them differently from PyTorch. A candidate that
differs there passes; one that differs at a real position, or is NaN anywhere, fails.
"""

from __future__ import annotations

import numpy as np
import pytest

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.parity.tensors import real_positions, tensor_feeds, tensor_parity
from kiln.exporter.precision import TOLERANCES
from kiln.exporter.runners.base import Feeds
from kiln.plugins.base import DecoderSpec

SPEC = DecoderSpec(family="test", n_layers=1, n_kv_heads=1, head_dim=4, vocab_size=11, max_context=32)


class _Fixed:
    """Outputs computed from the feeds (the same for reference and candidate), then ``spoil``ed."""

    name = "fixed"

    def __init__(self, spoil=None) -> None:
        self._spoil = spoil

    def graphs(self) -> tuple[GraphKind, ...]:
        return (GraphKind.PREFILL,)

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        batch, seq = feeds["input_ids"].shape
        rng = np.random.default_rng(1)
        out = {
            "logits": rng.standard_normal((batch, seq, SPEC.vocab_size)).astype(np.float32),
            "present.0.key": rng.standard_normal((batch, 1, seq, 4)).astype(np.float32),
            "present.0.value": rng.standard_normal((batch, 1, seq, 4)).astype(np.float32),
        }
        if self._spoil is not None:
            self._spoil(out)
        return out


def _checks(spoil) -> dict[str, bool]:
    checks = tensor_parity(_Fixed(), _Fixed(spoil), SPEC, TOLERANCES["fp32"])
    return {c.output: c.passed for c in checks}


def test_the_prefill_feeds_pad_the_first_row() -> None:
    mask = tensor_feeds(SPEC, GraphKind.PREFILL, 0)["attention_mask"]
    assert mask[0, :3].tolist() == [0, 0, 0] and mask[0, 3:].all() and mask[1].all()


def test_a_difference_at_padding_positions_passes() -> None:
    def spoil(out: Feeds) -> None:
        out["logits"][0, :3] += 5.0  # row 0's three padding positions
        out["present.0.key"][0, :, :3] -= 3.0

    assert _checks(spoil) == {"logits": True, "present.0.key": True, "present.0.value": True}


@pytest.mark.parametrize(
    ("output", "index"),
    [("logits", (0, 3)), ("logits", (1, 0)), ("present.0.key", (0, 0, 3)), ("present.0.value", (1, 0, 0))],
)
def test_a_difference_at_a_real_position_fails(output: str, index: tuple[int, ...]) -> None:
    def spoil(out: Feeds) -> None:
        out[output][index] += 1e-3  # over 3x the fp32 limit (1e-5 + 1e-4 x the row's max |value|, under 3 here)

    assert _checks(spoil)[output] is False


def test_nan_at_a_padding_position_fails() -> None:
    def spoil(out: Feeds) -> None:
        out["present.0.value"][0, 0, 1, 2] = np.nan  # a masked key, but 0 * NaN poisons attention

    assert _checks(spoil)["present.0.value"] is False


def test_real_positions_by_output() -> None:
    mask = np.array([[0, 1, 1], [1, 1, 1]])
    assert real_positions("logits", mask, (2, 3, 11))[:, :, 0].tolist() == [[False, True, True], [True, True, True]]
    assert real_positions("logits", mask, (2, 1, 11))[:, :, 0].tolist() == [[True], [True]]  # --logits last
    assert real_positions("present.0.key", mask, (2, 1, 3, 4)).shape == (2, 1, 3, 1)
    assert real_positions("present.0.cross_key", mask, (2, 1, 5, 4)) is None
