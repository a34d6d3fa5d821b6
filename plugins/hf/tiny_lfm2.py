"""Tiny random LFM2 decoders (issue 43): what ``tiny.TINY`` adds for the architectures whose
short-convolution layers carry a conv window and no SSM state (``layer_types`` ``conv``). ``lfm2``:
Lfm2 (conv, attention, conv layers; hidden 64, 4 heads of 16, 2 KV heads, q/k norm; conv window 3
as the published checkpoints, no conv bias as theirs: with ``conv_bias`` transformers itself lets left
padding into the window; the feed-forward width auto-adjusted, ``2/3 * 192`` rounded to a multiple
of 16). ``lfm2-moe``: Lfm2Moe (the same layers, layer 0 dense, the others sigmoid-routed experts with
an expert bias on the choice)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["LFM2_TINY"]

_LFM2: dict[str, Any] = dict(
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    vocab_size=128,
    hidden_size=64,
    intermediate_size=192,
    block_multiple_of=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    layer_types=["conv", "full_attention", "conv"],
    conv_L_cache=3,
    conv_bias=False,
    initializer_range=0.1,  # (0.02: the tied head's logits follow the input embedding, every token repeats the last)
)


def _lfm2(t: Any, **o: Any) -> Any:
    return t.Lfm2Config(**{**_LFM2, **o})


def _lfm2_moe(t: Any, **o: Any) -> Any:
    """Lfm2Moe: LFM2's sizes, layer 0 a dense MLP, the others 4 experts (top 2, width 32)."""
    sizes = {k: v for k, v in _LFM2.items() if not k.startswith("block_")}
    moe = dict(
        intermediate_size=128, moe_intermediate_size=32, num_dense_layers=1, num_experts=4, num_experts_per_tok=2
    )
    return t.Lfm2MoeConfig(**{**sizes, **moe, **o})


LFM2_TINY: Mapping[str, tuple[str, Callable[..., Any]]] = {
    "lfm2": ("Lfm2ForCausalLM", _lfm2),
    "lfm2-moe": ("Lfm2MoeForCausalLM", _lfm2_moe),
}
