"""Tiny random state-space decoders (issue 43): what ``tiny.TINY`` adds for the architectures
whose layers carry a recurrent state instead of a KV cache. ``mamba2``: Mamba2 (2 layers, hidden
64, 8 heads of 16, state 16, one group, conv kernel 4, chunk 8 so a prompt spans several chunks),
no bias in its projections as the published checkpoints (with ``use_bias`` transformers itself
lets left padding into the state). ``granitemoehybrid``: GraniteMoeHybrid (Granite 4.0-H: Mamba2,
attention, Mamba2 layers; the attention NoPE as the published checkpoints, mixture of experts), and
``-rope-dense`` with rotary attention and no experts (``num_local_experts`` 0). ``bamba``: Bamba
(the same layers, partial rotary attention, a dense MLP)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["RECURRENT_TINY"]

_MAMBA2: dict[str, Any] = dict(
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_heads=8,
    head_dim=16,
    expand=2,
    state_size=16,
    n_groups=1,
    conv_kernel=4,
    chunk_size=8,
    tie_word_embeddings=False,
    seq_length=64,  # a context for the export (Mamba2's config has none; a checkpoint's export passes --max-context)
)


def _mamba2(t: Any, **o: Any) -> Any:
    return t.Mamba2Config(**{**_MAMBA2, **o})


_GRANITE_HYBRID: dict[str, Any] = dict(
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    vocab_size=128,
    hidden_size=64,
    intermediate_size=32,
    shared_intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    num_local_experts=4,
    num_experts_per_tok=2,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_n_groups=1,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=8,
    position_embedding_type="nope",  # Granite 4.0-H's attention has no rotary (its state carries the positions)
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    attention_multiplier=0.2,
    logits_scaling=2.0,
)


def _granite_hybrid(t: Any, **o: Any) -> Any:
    return t.GraniteMoeHybridConfig(**{**_GRANITE_HYBRID, **o})


_BAMBA_KEYS = (
    *("bos_token_id", "eos_token_id", "pad_token_id", "vocab_size", "hidden_size", "num_hidden_layers"),
    *("num_attention_heads", "num_key_value_heads", "max_position_embeddings"),
)


def _bamba(t: Any, **o: Any) -> Any:
    """Bamba: GraniteMoeHybrid's sizes, a dense MLP, layer 1 attention (partial rotary, as Bamba's)."""
    sizes = {k: v for k, v in _GRANITE_HYBRID.items() if k in _BAMBA_KEYS or k.startswith("mamba_")}
    return t.BambaConfig(**{**sizes, "intermediate_size": 64, "attn_layer_indices": [1], **o})


RECURRENT_TINY: Mapping[str, tuple[str, Callable[..., Any]]] = {
    "mamba2": ("Mamba2ForCausalLM", _mamba2),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", _granite_hybrid),
    "bamba": ("BambaForCausalLM", _bamba),
    "granitemoehybrid-rope-dense": (
        "GraniteMoeHybridForCausalLM",
        lambda t, **o: _granite_hybrid(t, **{"position_embedding_type": "rope", "num_local_experts": 0, **o}),
    ),
}
