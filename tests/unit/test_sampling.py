"""kiln generate's token choice apart from the loop: the sampling functions against greedy and
hand-computed distributions, seeds, bad values; the text stream's pieces and stop strings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from kiln.errors import GenerateError
from kiln.runtime.sampling import Sampler, SamplingOptions, apply_repetition_penalty, logits_to_probs, sample
from kiln.runtime.text import TextStream

DEMO_TOKENIZER = Path(__file__).resolve().parents[2] / "demo" / "checkpoint" / "tokenizer.json"


def _rows(n: int = 40, vocab: int = 50, seed: int = 0) -> np.ndarray:
    """Logits rows [n, vocab] whose top two differ by at least 1e-2 (so the argmax is clear)."""
    rows = np.random.default_rng(seed).normal(scale=3.0, size=(n, vocab)).astype(np.float32)
    top2 = np.sort(rows, axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 1e-2
    return rows


def _tokens(options: SamplingOptions, rows: np.ndarray, prompt: tuple[int, ...] = ()) -> list[int]:
    sampler = Sampler(options, prompt)
    return [int(sampler.choose(step, row[None, :])[0]) for step, row in enumerate(rows)]


def test_greedy_is_the_default_and_the_argmax() -> None:
    rows = _rows()
    assert SamplingOptions().greedy
    assert _tokens(SamplingOptions(), rows) == rows.argmax(-1).tolist()


def test_a_seed_reproduces_the_tokens() -> None:
    rows = _rows(seed=1) / 3.0  # flatter: many tokens have a fair chance
    options = SamplingOptions(temperature=1.0, seed=7)
    first = _tokens(options, rows)
    assert _tokens(options, rows) == first
    assert _tokens(SamplingOptions(temperature=1.0, seed=8), rows) != first  # another seed, another draw
    assert first != rows.argmax(-1).tolist()  # it did sample


@pytest.mark.parametrize(
    "options",
    [
        SamplingOptions(temperature=1.0, top_k=1, seed=0),
        SamplingOptions(temperature=1e-7, seed=0),
        SamplingOptions(temperature=2.0, top_p=1e-9, seed=0),
    ],
    ids=["top-k 1", "temperature -> 0", "top-p tiny"],
)
def test_degenerate_sampling_equals_greedy(options: SamplingOptions) -> None:
    rows = _rows(seed=2)
    assert _tokens(options, rows) == rows.argmax(-1).tolist()


def test_repetition_penalty_on_a_hand_made_row() -> None:
    row = np.array([2.0, -1.0, 0.5, 3.0, 0.0])
    got = apply_repetition_penalty(row, [0, 1, 1, 4], 2.0)  # token 1 twice: penalised once
    np.testing.assert_array_equal(got, [1.0, -2.0, 0.5, 3.0, 0.0])
    np.testing.assert_array_equal(row, [2.0, -1.0, 0.5, 3.0, 0.0])  # the input is not changed
    np.testing.assert_array_equal(apply_repetition_penalty(row, [0, 3], 1.0), row)
    # greedy with a penalty, over the prompt and the tokens chosen: 3 (3.0 -> 1.2, in the prompt)
    # loses to 0 (2.0); then 0 is penalised too (0.8) and 3 wins again
    sampler = Sampler(SamplingOptions(repetition_penalty=2.5), prompt=(3,))
    assert [int(sampler.choose(step, row[None, :])[0]) for step in range(2)] == [0, 3]


def test_distributions_by_hand() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    np.testing.assert_allclose(logits_to_probs(logits), [0.5, 0.3, 0.2])
    np.testing.assert_allclose(logits_to_probs(logits, top_p=0.7), [0.625, 0.375, 0.0])  # 0.5 + 0.3 reach 0.7
    np.testing.assert_allclose(logits_to_probs(logits, top_p=0.5), [1.0, 0.0, 0.0])
    np.testing.assert_allclose(logits_to_probs(logits, top_k=2), [0.625, 0.375, 0.0])
    np.testing.assert_allclose(logits_to_probs(logits, temperature=0.5), np.array([0.25, 0.09, 0.04]) / 0.38)
    row = np.array([1.0, 2.0, 3.0])
    np.testing.assert_allclose(logits_to_probs(row, top_k=2), [0.0, 1 / (1 + np.e), np.e / (1 + np.e)])


def test_draws_follow_the_distribution() -> None:
    probs = np.array([0.1, 0.0, 0.6, 0.3])
    rng = np.random.default_rng(0)
    counts = np.bincount([sample(probs, rng) for _ in range(20000)], minlength=4) / 20000
    assert counts[1] == 0.0
    np.testing.assert_allclose(counts, probs, atol=0.015)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -0.5}, "--temperature must be at least 0 (0 is greedy), found -0.5"),
        ({"temperature": float("nan")}, "--temperature must be at least 0 (0 is greedy), found nan"),
        (
            {"temperature": float("inf")},
            "--temperature inf would draw every token alike (uniformly, whatever the model says); give a finite "
            "temperature",
        ),
        ({"temperature": 1.0, "seed": -1}, "--seed must be at least 0, found -1"),
        (
            {"temperature": 1.0, "repetition_penalty": float("inf")},
            "--repetition-penalty must be above 0 (1 changes nothing), found inf",
        ),
        ({"temperature": 1.0, "top_k": -1}, "--top-k must be at least 0 (0 keeps every token), found -1"),
        ({"temperature": 1.0, "top_p": 0.0}, "--top-p must be in (0, 1] (1 keeps every token), found 0.0"),
        ({"temperature": 1.0, "top_p": 1.5}, "--top-p must be in (0, 1] (1 keeps every token), found 1.5"),
        ({"repetition_penalty": 0.0}, "--repetition-penalty must be above 0 (1 changes nothing), found 0.0"),
        (
            {"top_k": 5},
            "--top-k and --top-p shape sampling: give --temperature above 0 too (0, the default, is greedy)",
        ),
    ],
)
def test_bad_values_are_one_line_errors(fields: dict[str, float], message: str) -> None:
    with pytest.raises(GenerateError) as err:
        SamplingOptions(**fields)  # type: ignore[arg-type]
    assert str(err.value) == f"generate: {message}"


def _stream(tokenizer: Tokenizer, ids: list[int], stops: tuple[str, ...] = ()) -> tuple[list[str], TextStream]:
    stream = TextStream(tokenizer, stops)
    pieces = []
    for token in ids:
        pieces.append(stream.add(token))
        if stream.stopped:
            break
    pieces.append(stream.rest())
    return pieces, stream


def test_stream_pieces_add_up_and_never_split_a_character() -> None:
    tok = Tokenizer.from_file(str(DEMO_TOKENIZER))
    text = "print('héllo €uro ✓')\n"
    ids = tok.encode(text).ids
    pieces, stream = _stream(tok, ids)
    assert "".join(pieces) == stream.text == tok.decode(ids) == text and not stream.stopped
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p) > 3  # it streamed, not all at the end


def test_stop_string_ends_the_text() -> None:
    tok = Tokenizer.from_file(str(DEMO_TOKENIZER))
    ids = tok.encode("def main(argv):\n    return 0\n").ids
    pieces, stream = _stream(tok, ids, stops=("):", "never"))
    assert stream.stopped and stream.text == "def main(argv" == "".join(pieces)
    assert all(")" not in p for p in pieces)  # the start of a stop string is held back, never shown
