"""Calibration data: token windows from a text file, ``.jsonl`` (field ``text``), ``.npy``/``.npz``
token ids, or ``synthetic`` random tokens (with a loud warning: ranges from noise are poor)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from pathlib import Path

import numpy as np

from kiln.errors import CalibrationError

__all__ = ["SYNTHETIC", "CalibrationData", "load_calibration_data"]

SYNTHETIC = "synthetic"


@dataclasses.dataclass(frozen=True)
class CalibrationData:
    windows: tuple[np.ndarray, ...]  # each [window] int64
    source: str
    sha256: str  # of the token ids used, for the cache key


def _tokenize(text: str, tokenizer: Path | None, path: Path, vocab_size: int) -> list[int]:
    if tokenizer is None:
        raise CalibrationError(f"{path}: text calibration data needs the checkpoint's tokenizer.json, and the checkpoint has none; pass token ids as .npy/.npz")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    if tok.get_vocab_size() > vocab_size:
        raise CalibrationError(
            f"{tokenizer}: the tokenizer has {tok.get_vocab_size()} tokens but the model's vocabulary has {vocab_size}: "
            "it does not belong to this checkpoint"
        )
    return list(tok.encode(text).ids)


def _read_ids(path: Path, tokenizer: Path | None, vocab_size: int) -> list[int]:
    suffix = path.suffix.lower()
    if suffix in (".npy", ".npz"):
        try:
            loaded = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise CalibrationError(f"{path}: not a readable numpy file ({exc})") from None
        if isinstance(loaded, np.lib.npyio.NpzFile) and not loaded.files:
            raise CalibrationError(f"{path}: the .npz file holds no array; the calibration data is empty")
        array = loaded[loaded.files[0]] if isinstance(loaded, np.lib.npyio.NpzFile) else loaded
        if array.dtype.kind not in "iu":
            raise CalibrationError(f"{path}: token ids must be integers, found dtype {array.dtype}")
        return [int(t) for t in np.asarray(array).ravel()]
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise CalibrationError(f"{path}: not UTF-8 text; use .txt, .jsonl (field 'text'), .npy or .npz") from None
    if suffix == ".jsonl":
        parts = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise CalibrationError(f"{path}:{n}: each line needs a string field 'text'")
            parts.append(record["text"])
        text = "\n".join(parts)
    return _tokenize(text, tokenizer, path, vocab_size)


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
        if not path.is_file():
            raise CalibrationError(f"{path}: calibration data file not found")
        ids = _read_ids(path, tokenizer, vocab_size)
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
