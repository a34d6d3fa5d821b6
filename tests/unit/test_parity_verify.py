"""Generation parity's verdict on a candidate's own sequence (``parity.generation.judge``) and the
rule that keeps the PyTorch model in memory beside the graphs (``parity.memory``).

Each step's token is the candidate's own choice; the reference's logits are those at the same
prefix (what PyTorch's teacher-forced scoring returns). A different token passes only as a tie:
the reference's own two logits within twice the row's logits limit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.exporter.parity import memory
from kiln.exporter.parity.generation import judge
from kiln.exporter.parity.memory import keeps_model, module_bytes
from kiln.exporter.precision import TOLERANCES

FP32 = TOLERANCES["fp32"]
PROMPTS = [[1, 2, 3]]


def _logits(steps: int, vocab: int = 5) -> np.ndarray:
    """Reference logits ``[steps, 1, vocab]`` whose argmax is token ``step % vocab`` by a margin of 3."""
    logits = np.zeros((steps, 1, vocab), dtype=np.float32)
    for step in range(steps):
        logits[step, 0, step % vocab] = 3.0
    return logits


def test_the_reference_argmax_at_every_step_passes() -> None:
    ref = _logits(4)
    check = judge(PROMPTS, ref, ref + 1e-6, FP32, False, None)
    assert check.passed and check.token_match_rate == 1.0 and check.first_divergence is None and check.ties == 0, check
    assert (
        check.per_step_match == (1.0,) * 4 and check.per_step_scale == (3.0,) * 4 and max(check.per_step_max_abs) < 2e-6
    )


@pytest.mark.parametrize(("margin", "tie"), [(1e-4, True), (0.5, False)])
def test_a_different_token_is_a_tie_only_within_twice_the_limit(margin: float, tie: bool) -> None:
    """Step 2's reference logits: token 2 at 3.0, token 4 at ``3.0 - margin``; the candidate picks
    token 4 there. fp32's limit at scale 3 is 1e-5 + 1e-4 x 3 = 3.1e-4: a margin of 1e-4 is a tie
    (counted, passing), one of 0.5 a divergence at step 2 (refused, whatever else matched)."""
    ref = _logits(4)
    ref[2, 0, 4] = 3.0 - margin
    cand = ref.copy()
    cand[2, 0, 4] = 3.0 + margin  # the candidate's own argmax at step 2 is token 4
    check = judge(PROMPTS, ref, cand, FP32, True, None)
    assert check.token_match_rate == 0.75 and check.per_step_match == (1.0, 1.0, 0.0, 1.0), check
    assert (check.ties, check.first_divergence, check.passed) == ((1, None, True) if tie else (0, 2, False)), check
    assert check.path == "model"


def test_a_floor_below_one_counts_near_ties_as_agreement() -> None:
    """A precision with a token-match floor (int8's 0.9) counts a near-tie within its own tolerance
    as agreement (a correct graph may order two such logits either way: issue 40's refusals of
    correct low-bit graphs), and refuses when the steps that diverge beyond it fall under the floor."""
    ref = _logits(4)
    cand = ref.copy()
    cand[1, 0, 3] = 9.0  # int8's wide limit makes this mismatch a tie
    check = judge(PROMPTS, ref, cand, TOLERANCES["int8"], False, None)
    assert check.token_match_rate == 0.75 and check.ties == 1 and check.first_divergence is None and check.passed, check
    ref[
        1, 0, 3
    ] = -5.0  # the reference's margin, 8, now beyond twice the limit (2 x 1.65): a divergence, 3 of 4 under the floor
    check = judge(PROMPTS, ref, cand, TOLERANCES["int8"], False, None)
    assert check.token_match_rate == 0.75 and check.ties == 0 and check.first_divergence == 1 and not check.passed, (
        check
    )


def test_the_model_is_kept_only_when_it_and_the_graphs_fit_half_the_memory() -> None:
    module = torch.nn.Linear(100, 10)  # 1010 float32 values
    assert module_bytes(module) == 4040
    assert keeps_model(module, 0, memory=8080) and keeps_model(module, 960, memory=10_000)
    assert not keeps_model(module, 961, memory=10_000) and not keeps_model(module, 0, memory=8000)


def test_a_model_that_would_raise_the_graphs_peak_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above ``KEEP_ALWAYS_BYTES``, the model is kept only when it is at most ``KEEP_BESIDE`` of the
    graph set's weights: an fp32 export's model (as large as its graphs) is freed while they run."""
    monkeypatch.setattr(memory, "KEEP_ALWAYS_BYTES", 1000)
    module = torch.nn.Linear(100, 10)  # 4040 bytes
    assert keeps_model(module, 4 * 4040, memory=10**9), "a quarter of the graphs' weights is kept"
    assert not keeps_model(module, 4 * 4040 - 4, memory=10**9), "more than a quarter is not"
    assert not keeps_model(module, 4040, memory=10**9), "as large as the graphs (fp32) is not"
    assert not keeps_model(module, 4 * 4040, memory=2 * (5 * 4040) - 1), "both must still fit half the memory"
    monkeypatch.setattr(memory, "KEEP_ALWAYS_BYTES", 4040)
    assert keeps_model(module, 0, memory=10**9), "a model this small is always kept"


def test_a_shared_weight_is_counted_once() -> None:
    tied = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    assert module_bytes(tied) == 160
