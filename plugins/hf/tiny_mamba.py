"""Tiny random Mamba v1 decoders (issue 43): what ``tiny.TINY`` adds for the state-space families whose
mixer is Mamba's first form (an SSM state per channel: plugins/hf/mamba1_scan.py). ``mamba``: Mamba (2
layers, hidden 64, intermediate 128, state 16, conv kernel 4, time-step rank 4, no bias in its
projections as the published checkpoints: with ``use_bias`` transformers itself lets left padding into
the state); ``falcon-mamba``: FalconMamba (the same sizes, RMS norms on dt, B and C); ``jamba``: Jamba (Mamba,
attention, Mamba layers, the attention without rotary as Jamba's; experts on layer 1, a dense MLP on the
others; RMS norms with weights on dt, B and C)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["MAMBA_TINY"]

_MAMBA: dict[str, Any] = dict(
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    state_size=16,
    expand=2,
    conv_kernel=4,
    time_step_rank=4,
    use_bias=False,
    seq_length=64,  # a context for the export (Mamba's config has none; a checkpoint's export passes --max-context)
)


def _mamba(t: Any, **o: Any) -> Any:
    return t.MambaConfig(**{**_MAMBA, **o})


def _falcon_mamba(t: Any, **o: Any) -> Any:
    return t.FalconMambaConfig(**{**_MAMBA, **o})


_JAMBA: dict[str, Any] = dict(
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attn_layer_period=3,  # layer 1 attention, layers 0 and 2 Mamba
    attn_layer_offset=1,
    expert_layer_period=2,  # layer 1 experts, the others a dense MLP
    expert_layer_offset=1,
    num_experts=4,
    num_experts_per_tok=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_dt_rank=4,
)


def _jamba(t: Any, **o: Any) -> Any:
    return t.JambaConfig(**{**_JAMBA, **o})


MAMBA_TINY: Mapping[str, tuple[str, Callable[..., Any]]] = {
    "mamba": ("MambaForCausalLM", _mamba),
    "falcon-mamba": ("FalconMambaForCausalLM", _falcon_mamba),
    "jamba": ("JambaForCausalLM", _jamba),
}
