"""The text quantization quality is measured on (``parity.quality``): token chunks of real text, or
random tokens when the export has none (then quality is recorded, never judged).

Where the real text comes from, first found first: ``--eval-data FILE`` (UTF-8 text, read through
``inputs.open_input`` like every input, only its first ``EVAL_READ_CHARS`` characters); the demo's
held-out text (``demo/checkpoint/heldout.txt``; its last tokens, which the demo's documented
calibration, its first tokens, never reads) when the demo is exported; the calibration data
(``--calib-data``, any of its forms but ``synthetic``; token ids in ``.npy``/``.npz``
are not known to be text: quality on them is recorded, never judged). Only ``QUALITY_TOKENS`` tokens are used, in
chunks of ``CHUNK_TOKENS`` (within the export's context), fewer where the vocabulary is large
(PyTorch's log-probabilities of every chunk are kept while the graphs run: ``QUALITY_BYTES``).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kiln.errors import ConfigError
from kiln.inputs import TOKENIZER_MAX_BYTES, open_input, read_input

__all__ = [
    "CHUNK_TOKENS",
    "EVAL_READ_CHARS",
    "QUALITY_BYTES",
    "QUALITY_TOKENS",
    "QualityText",
    "chunked",
    "quality_text_of",
    "random_text",
    "read_eval_ids",
]

QUALITY_TOKENS = 2048  # tokens scored (teacher-forced), at most
CHUNK_TOKENS = 256  # tokens per chunk (one prefill each), at most the export's context
QUALITY_BYTES = (
    1 << 28
)  # PyTorch's kept log-probabilities, 4 x tokens x vocab, at most (256 MB): 512 tokens at a 128k vocabulary
EVAL_READ_CHARS = 1 << 20  # characters of --eval-data read: far more than QUALITY_TOKENS tokens take


@dataclasses.dataclass(frozen=True)
class QualityText:
    """Token chunks to score, where they came from, and whether they are real text (only real
    text judges quality)."""

    source: str
    real: bool
    chunks: tuple[np.ndarray, ...]  # each [n] int64, n >= 2

    @property
    def tokens(self) -> int:
        return sum(len(c) for c in self.chunks)


def budget(vocab_size: int, max_context: int) -> tuple[int, int]:
    """The tokens to score and the chunk length: ``QUALITY_TOKENS`` in chunks of ``CHUNK_TOKENS``,
    within the context and within ``QUALITY_BYTES`` of kept log-probabilities."""
    tokens = max(2, min(QUALITY_TOKENS, QUALITY_BYTES // (4 * vocab_size)))
    return tokens, max(2, min(CHUNK_TOKENS, max_context, tokens))


def chunked(ids: Sequence[int], source: str, vocab_size: int, max_context: int, real: bool = True) -> QualityText:
    """The first tokens of ``ids`` the budget allows, in chunks (a last one shorter than 2 dropped)."""
    tokens, chunk = budget(vocab_size, max_context)
    kept = np.asarray(ids[:tokens], dtype=np.int64)
    chunks = tuple(kept[i : i + chunk] for i in range(0, len(kept), chunk) if len(kept) - i >= 2)
    return QualityText(source, real, chunks)


def random_text(vocab_size: int, max_context: int, seed: int = 0) -> QualityText:
    """One chunk of random tokens: quality recorded on it, never judged."""
    _, chunk = budget(vocab_size, max_context)
    ids = np.random.default_rng(seed).integers(0, vocab_size, size=chunk).tolist()
    return chunked(ids, "random tokens (no real text)", vocab_size, max_context, real=False)


def read_eval_ids(path: Path, tokenizer: Path | None, vocab_size: int, flag: str = "--eval-data") -> list[int]:
    """The token ids of the first ``EVAL_READ_CHARS`` characters of a UTF-8 text file; refused in
    one line (``ConfigError``) when it is missing, not a regular file, not text, or empty."""
    if not path.exists():
        raise ConfigError(f"{flag} {path}: file not found")
    raw = open_input(path, ConfigError, None, what="evaluation text")  # a FIFO or a device refused unopened
    try:
        with io.TextIOWrapper(raw, encoding="utf-8") as file:
            text = file.read(EVAL_READ_CHARS)
    except UnicodeDecodeError:
        raise ConfigError(f"{flag} {path}: not UTF-8 text (a binary file?); pass a text file") from None
    if "\x00" in text:
        raise ConfigError(f"{flag} {path}: holds NUL bytes, not text (a binary file?); pass a text file")
    if not text.strip():
        raise ConfigError(f"{flag} {path}: holds no text; pass a text file with at least two tokens")
    if tokenizer is None:
        raise ConfigError(f"{flag} {path}: text needs the checkpoint's tokenizer.json, and the checkpoint has none")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(
        read_input(tokenizer, ConfigError, TOKENIZER_MAX_BYTES, what="a tokenizer.json").decode("utf-8")
    )
    ids = tok.encode(text, add_special_tokens=False).ids
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ConfigError(
            f"{flag} {path}: the tokenizer gives ids outside the model's vocabulary [0, {vocab_size}) (e.g. {bad[0]})"
        )
    if len(ids) < 2:
        raise ConfigError(f"{flag} {path}: {len(ids)} token of text; at least 2 are needed")
    return ids


def quality_text_of(
    eval_data: Path | None,
    demo_heldout: Path | None,
    calibration: tuple[str, Callable[[int, int], Sequence[int]], bool] | None,
    tokenizer: Path | None,
    vocab_size: int,
    max_context: int,
) -> QualityText:
    """The export's quality text (the module's order), random tokens without any. ``calibration``:
    the calibration data's name, what reads its first ids (given the tokens and the chunk length),
    and whether it is text (a ``.npy``/``.npz`` file of ids may be anything: it never gates)."""
    if eval_data is not None:
        return chunked(
            read_eval_ids(eval_data, tokenizer, vocab_size), f"--eval-data {eval_data}", vocab_size, max_context
        )
    if demo_heldout is not None and tokenizer is not None:
        held = read_eval_ids(demo_heldout, tokenizer, vocab_size, "the demo's held-out text")
        return chunked(
            held[-budget(vocab_size, max_context)[0] :],
            "demo/checkpoint/heldout.txt (its last tokens)",
            vocab_size,
            max_context,
        )
    if calibration is not None:
        name, ids, text = calibration
        what = "the calibration data" if text else "the calibration token ids (not known to be text: recorded only)"
        return chunked(ids(*budget(vocab_size, max_context)), f"{what} ({name})", vocab_size, max_context, real=text)
    return random_text(vocab_size, max_context)
