"""Which layers attend through a sliding window, and how wide, read from the config of a family
that declares its window proved (``DecoderSpec.sliding_window_proved``: a test exports a tiny
model whose window, 4 tokens, is shorter than its parity run), applied as transformers does: a
query at slot ``i`` sees slot ``j`` only when ``j > i - window``.

- a config whose ``use_sliding_window`` is false has none;
- ``config.layer_types`` names each layer's kind (``sliding_attention``, ``full_attention``): the
  window is on the first;
- otherwise a ``sliding_window`` applies to every layer.

A window the family does not declare proved is refused by name, never guessed: a window applied
wrongly passes a parity run shorter than the window and is wrong beyond it. Which families are
proved is theirs to say, and this folder names none: the refusal lists those the registered
families declare (``proved_windows``). Chunked attention is refused too (an ``attention_chunk_size``
on ``chunked_attention`` layers: a query sees only the keys of its own chunk): the target's static
masks do not express it, and exported, those layers would silently attend to every earlier key.
"""

from __future__ import annotations

from kiln.errors import ConfigError
from kiln.plugins.base import DecoderSpec

__all__ = ["layer_windows", "proved_windows"]


def proved_windows() -> list[str]:
    """The architectures whose family declares their sliding window proved
    (``DecoderSpec.sliding_window_proved``), asked of every registered family's rows
    (``plugins.family_rows``), in their order."""
    from kiln.plugins import family_rows

    return [str(spec.config.get("architecture") or spec.family) for spec in family_rows() if spec.sliding_window_proved]


def layer_windows(spec: DecoderSpec) -> dict[int, int]:
    """``{layer: window}`` of the layers with a sliding window (empty: none has one); a window
    the target cannot prove is one ``ConfigError``."""
    config = spec.config
    _refuse_chunks(spec)
    window = config.get("sliding_window")
    if not isinstance(window, int) or config.get("use_sliding_window") is False:
        return {}
    if not spec.sliding_window_proved:
        raise ConfigError(
            f"--target onnx applies sliding windows only for {', '.join(proved_windows())}, each proved by a test; "
            f"this {config.get('architecture') or spec.family} model has a {window}-token window: export it "
            "without --target onnx"
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
