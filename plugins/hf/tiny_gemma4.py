"""Tiny random Gemma 4 text decoders (issue 43): what ``tiny.TINY`` adds for ``Gemma4ForCausalLM``.
The dense decoder with every per-layer trait on: sliding layers of 2 KV heads of 16 and global
layers of 1 KV head of 32 (``global_head_dim``, ``num_global_key_value_heads``: transformers'
``per_layer_config``), values equal to the keys' projection on the global layers
(``attention_k_eq_v``), proportional rope on a quarter of the global heads, per-layer inputs (a
second embedding table, 8 numbers per layer and token), soft-capped logits, and (``gemma4-shared``)
the last layers reading the keys and values of the last earlier layer of their kind
(``num_kv_shared_layers``) with a double-wide MLP (``use_double_wide_mlp``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["GEMMA4_TINY"]

_TEXT: dict[str, Any] = dict(
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    vocab_size=128,
    vocab_size_per_layer_input=128,  # Gemma 4 indexes it by every id (no clamp, unlike Gemma 3n)
    hidden_size=64,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    max_position_embeddings=64,
    hidden_size_per_layer_input=8,
    sliding_window=4,
    final_logit_softcapping=30.0,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    },
)


def _text(layers: int, shared: int) -> Callable[..., Any]:
    """``(transformers, **overrides) -> Gemma4TextConfig``: ``layers`` alternating sliding and global
    layers (the last one global, as transformers forces), the last ``shared`` of them reading an
    earlier layer's cache with a double-wide MLP."""

    def make(t: Any, **o: Any) -> Any:
        n = int(o.pop("num_hidden_layers", layers))
        kinds = (["sliding_attention", "full_attention"] * n)[-n:]
        kw = dict(layer_types=kinds, num_kv_shared_layers=shared, use_double_wide_mlp=bool(shared))
        return t.Gemma4TextConfig(**{**_TEXT, **kw, "num_hidden_layers": n, **o})

    return make


GEMMA4_TINY: Mapping[str, tuple[str, Callable[..., Any]]] = {
    "gemma4-window": ("Gemma4ForCausalLM", _text(2, 0)),
    "gemma4-shared-window": ("Gemma4ForCausalLM", _text(6, 2)),
}
