"""Tiny random Gated DeltaNet decoders (issue 43): what ``tiny.TINY`` adds for the architectures whose
linear-attention layers carry a Gated DeltaNet state (a conv window over q, k and v and a recurrent
state ``[value heads, key dim, value dim]``) beside gated full-attention layers. ``qwen3_5``: Qwen3.5's
text decoder (DeltaNet, attention, DeltaNet layers; 2 key heads serving 4 value heads, partial rotary
attention with an output gate, a dense MLP). ``qwen3_next``: Qwen3-Next (the same layers, mixture of
experts with a gated shared expert). ``qwen3_5_moe``: Qwen3.5-MoE's text decoder (the same, its own
classes)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["QWEN3_5_TINY"]

_QWEN3_5: dict[str, Any] = dict(
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
_MOE: dict[str, Any] = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
)


def _case(arch: str, config: str, **extra: Any) -> tuple[str, Callable[..., Any]]:
    return arch, lambda t, **o: getattr(t, config)(**{**_QWEN3_5, **extra, **o})


QWEN3_5_TINY: Mapping[str, tuple[str, Callable[..., Any]]] = {
    "qwen3_5": _case("Qwen3_5ForCausalLM", "Qwen3_5TextConfig"),
    "qwen3_next": _case("Qwen3NextForCausalLM", "Qwen3NextConfig", **_MOE),
    "qwen3_5_moe": _case("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", **_MOE),
}
