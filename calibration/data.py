"""Calibration data: token windows from a text file, ``.jsonl`` (field ``text``), ``.npy``/``.npz``
token ids, or ``synthetic`` random tokens (with a loud warning: ranges from noise are poor).

Only the first ``samples * window`` tokens are used, so only they are read: text is tokenized
a window of ``CHUNK`` characters at a time until there are enough (without special tokens: the
data is one stream), a ``.npy`` file is memory-mapped. Time and memory follow the samples asked
for, not the file's size (a 50 MB one-line text took 78 s and 8.4 GiB when it was tokenized whole).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kiln.errors import CalibrationError
from kiln.inputs import TOKENIZER_MAX_BYTES, check_input, open_input, read_input

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["CHUNK", "SYNTHETIC", "CalibrationData", "load_calibration_data"]

SYNTHETIC = "synthetic"
CHUNK = 1 << 16  # characters of text tokenized at a time
DATA_MAX_BYTES = 1 << 36  # 64 GiB: only the first samples * window tokens are read, but a .npz array is read whole


@dataclasses.dataclass(frozen=True)
class CalibrationData:
    windows: tuple[np.ndarray, ...]  # each [window] int64
    source: str
    sha256: str  # of the token ids used, for the cache key


def _tokenizer(tokenizer: Path | None, path: Path, vocab_size: int) -> Tokenizer:
    if tokenizer is None:
        raise CalibrationError(
            f"{path}: text calibration data needs the checkpoint's tokenizer.json, and the checkpoint has none; "
            "pass token ids as .npy/.npz"
        )
    from tokenizers import Tokenizer

    text = read_input(tokenizer, CalibrationError, TOKENIZER_MAX_BYTES, what="a tokenizer.json")
    tok = Tokenizer.from_str(text.decode("utf-8"))
    if tok.get_vocab_size() > vocab_size:
        raise CalibrationError(
            f"{tokenizer}: the tokenizer has {tok.get_vocab_size()} tokens but the model's vocabulary has "
            f"{vocab_size}: "
            "it does not belong to this checkpoint"
        )
    return tok


def _cut(text: str) -> int:
    """Where ``text`` may be split without changing how it tokenizes: before the last whitespace
    character that a non-whitespace one follows (the byte-level and whitespace pre-tokenizers
    start a word there); the whole text when it has no such place."""
    for i in range(len(text) - 2, 0, -1):
        if text[i].isspace() and not text[i + 1].isspace():
            return i
    return len(text)


def _pieces(path: Path) -> Iterator[str]:
    """The file's text in pieces of at most ``CHUNK`` characters, read as they are asked for: a
    text file as it is, a ``.jsonl`` file's ``text`` fields joined by newlines (blank lines skipped)."""
    raw = open_input(path, CalibrationError, DATA_MAX_BYTES, what="calibration data")  # never a FIFO or a device
    with io.TextIOWrapper(raw, encoding="utf-8") as file:
        if path.suffix.lower() != ".jsonl":
            while piece := file.read(CHUNK):
                yield piece
            return
        first = True
        for n, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise CalibrationError(f"{path}:{n}: each line needs a string field 'text'")
            text = record["text"] if first else "\n" + record["text"]
            first = False
            for i in range(0, len(text), CHUNK):
                yield text[i : i + CHUNK]


def _text_ids(path: Path, tokenizer: Path | None, vocab_size: int, limit: int) -> list[int]:
    """The first ``limit`` (or more) token ids of a text or ``.jsonl`` file, tokenized a window
    of about ``CHUNK`` characters at a time, so time and memory follow ``limit``, not the file."""
    tok = _tokenizer(tokenizer, path, vocab_size)
    ids: list[int] = []
    carry = ""
    try:
        for piece in _pieces(path):
            carry += piece
            if len(carry) >= CHUNK:
                cut = _cut(carry)
                ids += tok.encode(carry[:cut], add_special_tokens=False).ids
                carry = carry[cut:]
                if len(ids) >= limit:
                    return ids
    except UnicodeDecodeError:
        raise CalibrationError(f"{path}: not UTF-8 text; use .txt, .jsonl (field 'text'), .npy or .npz") from None
    return ids + (tok.encode(carry, add_special_tokens=False).ids if carry else [])


def _read_ids(path: Path, tokenizer: Path | None, vocab_size: int, limit: int) -> list[int]:
    """The first ``limit`` token ids of the file (all of them when it has fewer)."""
    suffix = path.suffix.lower()
    if suffix not in (".npy", ".npz"):
        return _text_ids(path, tokenizer, vocab_size, limit)[:limit]
    check_input(path, CalibrationError, DATA_MAX_BYTES, what="calibration data")  # numpy opens it by name
    try:
        loaded = np.load(
            path, allow_pickle=False, mmap_mode="r" if suffix == ".npy" else None
        )  # .npy: only what is read is paged in
    except (ValueError, OSError) as exc:
        raise CalibrationError(f"{path}: not a readable numpy file ({exc})") from None
    if isinstance(loaded, np.lib.npyio.NpzFile) and not loaded.files:
        raise CalibrationError(f"{path}: the .npz file holds no array; the calibration data is empty")
    array = loaded[loaded.files[0]] if isinstance(loaded, np.lib.npyio.NpzFile) else loaded
    if array.dtype.kind not in "iu":
        raise CalibrationError(f"{path}: token ids must be integers, found dtype {array.dtype}")
    return [int(t) for t in np.asarray(array).reshape(-1)[:limit]]


def load_calibration_data(
    source: str, *, tokenizer: Path | None, vocab_size: int, samples: int, window: int, seed: int = 0
) -> CalibrationData:
    """``samples`` windows of ``window`` tokens (fewer when the data is shorter, at least one)."""
    if source == SYNTHETIC:
        warnings.warn(
            "calibrating on SYNTHETIC random tokens: activation ranges will be poor and int8 accuracy "
            "with them; pass real text with --calib-data",
            stacklevel=2,
        )
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, vocab_size, size=samples * window).tolist()
    else:
        path = Path(source)
        if not path.exists():  # a FIFO or a device is there, and refused by what it is (inputs.check_input)
            raise CalibrationError(f"{path}: calibration data file not found")
        ids = _read_ids(
            path, tokenizer, vocab_size, max(samples * window, 2)
        )  # what the windows take (a datum is 2 tokens at least)
    if not ids:
        raise CalibrationError(f"{source}: the calibration data is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise CalibrationError(
            f"{source}: {len(bad)} token ids are outside the vocabulary [0, {vocab_size}) (e.g. {bad[0]}); "
            "is this data tokenized for another model?"
        )
    if len(ids) < 2:
        raise CalibrationError(f"{source}: the calibration data has {len(ids)} token; at least 2 are needed")
    window = min(window, len(ids))
    count = max(1, min(samples, len(ids) // window))
    windows = tuple(np.array(ids[i * window : (i + 1) * window], dtype=np.int64) for i in range(count))
    digest = hashlib.sha256(np.concatenate(windows).tobytes()).hexdigest()
    return CalibrationData(windows, source, digest)
