"""Which layers attend through a sliding window, and how wide: read from the family's config, for
the architectures whose window a test proves (a tiny model with a window of 4 tokens, shorter
than its parity run: tests/export/test_onnx_target.py), as transformers applies it: a query at
slot ``i`` sees slot ``j`` only when ``j > i - window``.

- ``config.layer_types`` names each layer's kind (``sliding_attention``, ``full_attention``):
  Qwen2 (``use_sliding_window``, ``max_window_layers``) and Gemma 2/3 have it;
- otherwise a ``sliding_window`` applies to every layer (Mistral, Mixtral, Starcoder2).

Any other architecture with a ``sliding_window`` in its config is refused by name, never
guessed: a window applied wrongly passes a parity run shorter than the window and is wrong
beyond it. So is chunked attention (Llama 4's ``attention_chunk_size`` on its
``chunked_attention`` layers: a query sees only the keys of its own chunk), which the target's
static masks do not express: exported, those layers would silently attend to every earlier key.
"""

from __future__ import annotations

from kiln.errors import ConfigError
from kiln.plugins.base import DecoderSpec

__all__ = ["PROVED", "layer_windows"]

PROVED = (
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Starcoder2ForCausalLM",
    "Qwen2ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
)  # Gemma 3's multimodal wrapper: its text decoder, windowed (tests/export/test_hf_multimodal.py)


def layer_windows(spec: DecoderSpec) -> dict[int, int]:
    """``{layer: window}`` of the layers with a sliding window (empty: none has one); a window
    the target cannot prove is one ``ConfigError``."""
    config = spec.config
    _refuse_chunks(spec)
    window = config.get("sliding_window")
    if not isinstance(window, int) or config.get("use_sliding_window") is False:
        return {}
    arch = config.get("architecture")
    if arch not in PROVED:
        raise ConfigError(
            f"--target onnx applies sliding windows only for {', '.join(PROVED)}, each proved by a test; "
            f"this {arch or spec.family} model has a {window}-token window: export it without --target onnx"
        )
    kinds = config.get("layer_types")
    if kinds is None:
        return dict.fromkeys(range(spec.n_layers), window)
    if len(kinds) != spec.n_layers or set(kinds) - {"sliding_attention", "full_attention"}:
        raise ConfigError(
            f"--target onnx: config.layer_types {kinds} is not one of sliding_attention/full_attention per layer"
        )
    return {layer: window for layer, kind in enumerate(kinds) if kind == "sliding_attention"}


def _refuse_chunks(spec: DecoderSpec) -> None:
    """Chunked attention is one ``ConfigError``: a config with an ``attention_chunk_size`` whose
    layer_types (absent: every layer) have a chunked_attention layer."""
    chunk, kinds = spec.config.get("attention_chunk_size"), spec.config.get("layer_types")
    if isinstance(chunk, int) and (kinds is None or "chunked_attention" in kinds):
        raise ConfigError(
            "--target onnx does not apply chunked attention (this "
            f"{spec.config.get('architecture') or spec.family} model attends within"
            f" chunks of {chunk} tokens: attention_chunk_size); export it without --target onnx"
        )
