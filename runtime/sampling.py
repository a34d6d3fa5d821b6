"""How ``kiln generate`` picks each token from a step's logits: greedy (the default, what parity
runs), or sampled with temperature, top-k, top-p and a repetition penalty, reproducibly from a seed.

Functions apart from the loop, as gpt-fast has them (``logits_to_probs``, ``sample``): the step
loop (``exporter.contract.steps.run_steps``) calls a ``Chooser``, and ``Sampler.choose`` is one.
Order, as in Hugging Face's ``generate``: repetition penalty on the raw logits, then temperature,
then top-k, then top-p (over what top-k kept), then one draw from the renormalised distribution.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from kiln.errors import GenerateError

# a positive temperature below this is taken as this: sampling is argmax in effect there (the limit
# T -> 0), and logits / T would overflow
MIN_TEMPERATURE = 1e-5

__all__ = ["MIN_TEMPERATURE", "SamplingOptions", "Sampler", "apply_repetition_penalty", "logits_to_probs", "sample"]


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """``temperature`` 0 is greedy (argmax), a positive one below ``MIN_TEMPERATURE`` is taken as it;
    ``top_k`` 0 and ``top_p`` 1 keep every token;
    ``repetition_penalty`` 1 changes nothing; ``seed`` None draws from fresh OS entropy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:  # also refuses NaN
            raise GenerateError(f"--temperature must be at least 0 (0 is greedy), found {self.temperature}")
        if self.temperature == math.inf:
            raise GenerateError(
                "--temperature inf would draw every token alike (uniformly, whatever the model says); give a "
                "finite temperature"
            )
        if self.seed is not None and self.seed < 0:
            raise GenerateError(f"--seed must be at least 0, found {self.seed}")
        if self.top_k < 0:
            raise GenerateError(f"--top-k must be at least 0 (0 keeps every token), found {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise GenerateError(f"--top-p must be in (0, 1] (1 keeps every token), found {self.top_p}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise GenerateError(
                f"--repetition-penalty must be above 0 (1 changes nothing), found {self.repetition_penalty}"
            )
        if self.greedy and (self.top_k or self.top_p < 1.0):
            raise GenerateError(
                "--top-k and --top-p shape sampling: give --temperature above 0 too (0, the default, is greedy)"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def apply_repetition_penalty(logits: np.ndarray, previous: Sequence[int], penalty: float) -> np.ndarray:
    """A copy of ``logits`` [vocab] where every token in ``previous`` is made less likely: a
    positive logit divided by ``penalty``, a negative one multiplied (CTRL, Keskar et al. 2019, as
    Hugging Face's RepetitionPenaltyLogitsProcessor). Each token counts once however often it came."""
    out = np.array(logits, dtype=np.float64)
    if penalty == 1.0 or not len(previous):
        return out
    seen = np.unique(np.asarray(previous, dtype=np.int64))
    values = out[seen]
    out[seen] = np.where(values > 0, values / penalty, values * penalty)
    return out


def logits_to_probs(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution [vocab] (float64, sums to 1) a token is drawn from: softmax of
    ``logits / temperature`` over the ``top_k`` largest, then over the smallest set of those whose
    probabilities reach ``top_p`` (the most likely token always stays)."""
    scaled = np.asarray(logits, dtype=np.float64) / max(temperature, MIN_TEMPERATURE)
    if 0 < top_k < scaled.shape[-1]:
        kth = np.partition(scaled, -top_k)[-top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs: np.ndarray = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]  # probability mass of the more likely tokens
        probs[order[before >= top_p]] = 0.0
        probs /= probs.sum()
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token id drawn from ``probs`` [vocab] (inverse CDF of one uniform draw)."""
    cdf = np.cumsum(probs)
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(index, len(probs) - 1)


class Sampler:
    """A step loop ``Chooser`` for batch 1: ``choose(step, logits [1, vocab]) -> [token]``. The
    repetition penalty sees the prompt and every token chosen so far."""

    def __init__(self, options: SamplingOptions, prompt: Sequence[int]) -> None:
        self.options = options
        self._rng = np.random.default_rng(options.seed)
        self._history = list(prompt)

    def choose(self, step: int, logits: np.ndarray) -> np.ndarray:
        o = self.options
        row = apply_repetition_penalty(logits[0], self._history, o.repetition_penalty)
        token = (
            int(row.argmax()) if o.greedy else sample(logits_to_probs(row, o.temperature, o.top_k, o.top_p), self._rng)
        )
        self._history.append(token)
        return np.array([token], dtype=np.int64)
