"""The rule every parity check applies: per row (the last axis), |a - b| <= atol + rtol * max|b| of
the row; a generation mismatch is a tie only within twice that row's logits limit."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.parity import generation_parity
from kiln.exporter.parity.tensors import tensor_parity
from kiln.exporter.precision import TOLERANCES
from kiln.exporter.runners.base import Feeds
from kiln.plugins.base import DecoderSpec

SPEC = DecoderSpec(family="test", n_layers=1, n_kv_heads=1, head_dim=4, vocab_size=11, max_context=32)
FP32 = TOLERANCES["fp32"]


class _Outputs:
    """A prefill graph whose logits rows are ``rows`` (the same for every feed), then ``edit``ed."""

    name = "outputs"

    def __init__(self, rows: np.ndarray, edit=None) -> None:
        self._rows, self._edit = rows, edit

    def graphs(self) -> tuple[GraphKind, ...]:
        return (GraphKind.PREFILL,)

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        batch, seq = feeds["input_ids"].shape
        logits = np.broadcast_to(self._rows[None, :seq], (batch, seq, SPEC.vocab_size)).copy()
        out = {
            "logits": logits,
            "present.0.key": np.ones((batch, 1, seq, 4), np.float32),
            "present.0.value": np.ones((batch, 1, seq, 4), np.float32),
        }
        if self._edit is not None:
            self._edit(out)
        return out


def _rows(scales: list[float]) -> np.ndarray:
    """Logits rows of 7 positions: row i's values reach ``scales[i % len]``, its element 0 near zero."""
    rng = np.random.default_rng(0)
    rows = (
        rng.uniform(0.5, 1.0, size=(7, SPEC.vocab_size))
        * np.array([scales[i % len(scales)] for i in range(7)])[:, None]
    )
    rows[:, 0] = 1e-3
    rows[:, 1] = np.array([scales[i % len(scales)] for i in range(7)])  # the row's max |b|
    return rows.astype(np.float32)


def _logits_check(rows: np.ndarray, error: float, row: int, element: int = 0):
    def edit(out: Feeds) -> None:
        out["logits"][1, row, element] += error  # row 1 of the batch is unpadded: every position is real

    (check,) = [c for c in tensor_parity(_Outputs(rows), _Outputs(rows, edit), SPEC, FP32) if c.output == "logits"]
    return check


@pytest.mark.parametrize(("factor", "passed"), [(0.99, True), (1.01, False)])
def test_the_limit_is_atol_plus_rtol_times_the_rows_max(factor: float, passed: bool) -> None:
    rows = _rows([40.0])
    limit = 1e-5 + 1e-4 * 40.0
    check = _logits_check(rows, factor * limit, row=3)
    assert check.passed is passed
    assert check.scale == 40.0 and check.error == pytest.approx(factor * limit, rel=1e-3)
    assert check.describe() == f"{factor * limit:.3g} (tolerance 1e-05 + 0.0001 x max|row| = 0.00401 at max|row| 40)"


def test_an_element_near_zero_is_judged_by_its_rows_scale() -> None:
    """0.002 off a logit of 0.001 beside logits of 40: rounding of that size (the row's inputs are
    the same) passes; numpy's element-wise form would need rtol 2 or an atol that does not scale."""
    check = _logits_check(_rows([40.0]), 2e-3, row=3, element=0)
    assert check.passed and check.max_rel == pytest.approx(2.0, rel=1e-3)


def test_an_outlier_row_does_not_loosen_the_others() -> None:
    """Rows at 1000 and at 1: an error of 0.01 in a row at 1 fails (a per-tensor scale would allow 0.1)."""
    check = _logits_check(_rows([1000.0, 1.0]), 1e-2, row=1)
    assert not check.passed and check.scale == 1.0 and check.error == pytest.approx(1e-2, rel=1e-3)
    assert _logits_check(_rows([1000.0, 1.0]), 1e-2, row=0).passed  # the same error in the outlier row passes


def test_the_kv_cache_by_the_same_rule() -> None:
    def edit(out: Feeds) -> None:
        out["present.0.key"][1, 0, 2, 3] += 1.2e-4  # its rows reach 1: limit 1e-5 + 1e-4

    checks = {c.output: c for c in tensor_parity(_Outputs(_rows([1.0])), _Outputs(_rows([1.0]), edit), SPEC, FP32)}
    assert not checks["present.0.key"].passed and checks["present.0.value"].passed
    assert checks["present.0.key"].describe() == "0.00012 (tolerance 1e-05 + 0.0001 x max|row| = 0.00011 at max|row| 1)"


def test_precisions_are_ordered() -> None:
    order = ["fp32", "fp16", "int8", "int4"]
    for bound in ("logits", "kv"):
        for tight, loose in zip(order, order[1:], strict=False):
            a, b = getattr(TOLERANCES[tight], bound), getattr(TOLERANCES[loose], bound)
            assert a.atol < b.atol and a.rtol < b.rtol, (bound, tight, loose)
    assert (
        TOLERANCES["fp8"] == TOLERANCES["int8"]
        and TOLERANCES["int8+fp16"] == TOLERANCES["int8"]
        and TOLERANCES["int4+fp16"] == TOLERANCES["int4"]
    )


class _Steps:
    """Generation through a prefill graph only (one step): logits of 40 at tokens 3 and 4, token 4
    ``margin`` below (reference) or ``margin`` above (a candidate that swaps them)."""

    name = "steps"

    def __init__(self, margin: float) -> None:
        self._margin = margin

    def graphs(self) -> tuple[GraphKind, ...]:
        return (GraphKind.PREFILL,)

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        batch, seq = feeds["input_ids"].shape
        logits = np.zeros((batch, seq, SPEC.vocab_size), np.float32)
        logits[..., 3], logits[..., 4] = 40.0, 40.0 + self._margin
        return {
            "logits": logits,
            "present.0.key": np.zeros((batch, 1, seq, 4), np.float32),
            "present.0.value": np.zeros((batch, 1, seq, 4), np.float32),
        }


@pytest.mark.parametrize(("margin", "tie"), [(1.9 * (1e-5 + 1e-4 * 40), True), (2.1 * (1e-5 + 1e-4 * 40), False)])
def test_a_tie_is_within_twice_the_rows_limit(margin: float, tie: bool) -> None:
    check = generation_parity(_Steps(-margin), _Steps(margin), SPEC, [[5, 6]], 1, FP32, unified=False)
    assert check.token_match_rate == 0.0 and check.per_step_scale == (40.0,) and check.per_step_match == (0.0,)
    assert (check.ties, check.first_divergence, check.passed) == ((1, None, True) if tie else (0, 0, False))
