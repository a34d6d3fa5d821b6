"""``kiln generate --features FILE.npy``: a speech encoder-decoder's (Whisper's) input. Its
encoder graph takes log-mel ``input_features`` ``[batch, n_mels, frames]`` (both sizes fixed by
the checkpoint, ``contract.io``); the file holds one utterance's ``[n_mels, frames]`` (or ``[1,
n_mels, frames]``), as transformers' ``WhisperFeatureExtractor`` computes it (padded to the
frame count). The decoder starts from the checkpoint's ``decoder_start_token_id``, or from the
prefix ``--ids`` gives (Whisper's language and task tokens, which kiln never adds itself)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import GenerateError
from kiln.exporter.artifacts.manifest import Manifest, TensorEntry
from kiln.exporter.contract.io import ENCODER_FEATURES, ENCODER_STATES, GraphKind
from kiln.exporter.contract.steps import prompt_feeds

__all__ = ["features_input", "read_features", "speech_feeds", "refuse_mismatch"]


def features_input(manifest: Manifest) -> TensorEntry | None:
    """The encoder graph's ``input_features`` entry of a speech encoder-decoder's export, else None."""
    entry = manifest.graphs.get(GraphKind.ENCODER.value)
    return entry.inputs[0] if entry is not None and entry.inputs[0].name == ENCODER_FEATURES else None


def refuse_mismatch(directory: Path, takes_features: bool, features: Path | None, prompt: str | None) -> None:
    """A one-line GenerateError when the input does not fit the export: features for a token-id
    model, none for a speech model, or text for a speech model's decoder."""
    if features is not None and not takes_features:
        raise GenerateError(
            f"--features: {directory} takes token ids (--prompt or --ids), not log-mel features; --features is for "
            "a speech encoder-decoder's (Whisper's) export"
        )
    if features is None and takes_features:
        raise GenerateError(
            f"{directory} is a speech encoder-decoder (Whisper): it transcribes log-mel features; pass --features "
            "FILE.npy (and --ids for a decoder prefix, if any)"
        )
    if features is not None and prompt is not None:
        raise GenerateError("--features: the decoder's prefix is given as --ids (its token ids), not --prompt text")


def read_features(path: Path, entry: TensorEntry) -> np.ndarray:
    """``path``'s features as the encoder graph takes them ``[1, n_mels, frames]``, in its dtype."""
    mels, frames = (int(d) for d in entry.shape[1:])
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise GenerateError(f"--features {path}: not a readable .npy file ({str(exc).splitlines()[0]})") from None
    if not isinstance(array, np.ndarray) or array.dtype.kind != "f":
        raise GenerateError(f"--features {path}: dtype {getattr(array, 'dtype', type(array).__name__)}, expected "
                            "floating-point log-mel features")  # fmt: skip
    if array.shape not in ((mels, frames), (1, mels, frames)):
        raise GenerateError(
            f"--features {path}: shape {list(array.shape)}, expected [{mels}, {frames}] (n_mels x frames; the export's "
            f"encoder takes exactly {frames} frames: pad shorter audio as the feature extractor does)"
        )
    if not np.isfinite(array).all():
        raise GenerateError(f"--features {path}: has non-finite values (NaN or Inf)")
    return np.ascontiguousarray(array.reshape(1, mels, frames), dtype=entry.dtype)


def speech_feeds(encoder: Any, features: np.ndarray, prefix: list[int]) -> dict[str, Any]:
    """The prompt step's feeds: the decoder's ``prefix`` (unpadded, batch 1) and the encoder
    session's output on ``features``."""
    (states,) = encoder.run([ENCODER_STATES], {ENCODER_FEATURES: features})
    return prompt_feeds([prefix], 0) | {ENCODER_STATES: np.asarray(states)}
