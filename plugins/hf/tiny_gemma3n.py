"""Tiny random Gemma 3n text decoders (issue 43): what ``tiny.TINY`` adds for
``Gemma3nForCausalLM``. Every mechanism of the family is on: per-layer inputs (a second embedding
table, 8 numbers per layer and token, mixed into each layer's output), AltUp (2 predictions),
Laurel (rank 8), the activation-sparsity threshold on the first layers (``Normal.icdf`` of 0.95,
a constant of the trace), sliding and global layers with their own rope, soft-capped logits, and
(``gemma3n-shared``) the last layers reading the keys and values of the last earlier layer of
their kind (``num_kv_shared_layers``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["GEMMA3N_TINY"]

_TEXT: dict[str, Any] = dict(
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    vocab_size=128,
    vocab_size_per_layer_input=96,  # ids past it read row 0 of the second table, as in a published Gemma 3n
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    hidden_size_per_layer_input=8,
    altup_num_inputs=2,
    laurel_rank=8,
    sliding_window=4,
    final_logit_softcapping=30.0,
)


def _text(layers: int, shared: int) -> Callable[..., Any]:
    """``(transformers, **overrides) -> Gemma3nTextConfig``: ``layers`` alternating sliding and
    global layers, the last ``shared`` of them reading an earlier layer's cache, the threshold on
    the first half."""

    def make(t: Any, **o: Any) -> Any:
        n = int(o.pop("num_hidden_layers", layers))
        kinds = ["sliding_attention", "full_attention"] * (n // 2) + ["sliding_attention"] * (n % 2)
        sparsity = [0.95] * (n // 2) + [0.0] * (n - n // 2)
        kw = dict(layer_types=kinds, activation_sparsity_pattern=sparsity, num_kv_shared_layers=shared)
        return t.Gemma3nTextConfig(**{**_TEXT, **kw, "num_hidden_layers": n, **o})

    return make


GEMMA3N_TINY: Mapping[str, tuple[str, Callable[..., Any]]] = {
    "gemma3n-window": ("Gemma3nForCausalLM", _text(2, 0)),
    "gemma3n-shared-window": ("Gemma3nForCausalLM", _text(5, 2)),
}
