"""The tiny random Whisper (``seq2seq.SEQ2SEQ``'s speech encoder-decoder) the tests export: 2
encoder and 2 decoder layers, hidden 64, 16 mel bins over 32 frames (``max_source_positions`` 16).

Its config bans nothing and forces nothing (``suppress_tokens`` and ``begin_suppress_tokens``
None, no ``forced_decoder_ids``, no language or task tokens): transformers' ``generate()`` is then
the model's own argmax from ``decoder_start_token_id``, the decoding rule kiln runs. This module
stays free of torch (``kiln plugins`` lists it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["SPEECH_TINY", "MELS", "FRAMES"]

MELS, FRAMES = 16, 32  # the tiny encoder's input_features [batch, 16, 32]


def _whisper(t: Any, **overrides: Any) -> Any:
    return t.WhisperConfig(
        **{
            "vocab_size": 128,
            "num_mel_bins": MELS,
            "d_model": 64,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128,
            "max_source_positions": FRAMES // 2,
            "max_target_positions": 64,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "decoder_start_token_id": 3,
            "suppress_tokens": None,
            "begin_suppress_tokens": None,
            "init_std": 0.3,  # transformers' 0.02 gives a tiny random model constant outputs
            **overrides,
        }
    )


# (architecture, (transformers, **overrides) -> config), as ``seq2seq.SEQ2SEQ_TINY``
SPEECH_TINY: Mapping[str, tuple[str, Callable[..., Any]]] = {
    "whisper": ("WhisperForConditionalGeneration", _whisper),
}
