"""Tiny random Mamba2 hybrids of two more layouts (issue 43 item 2): what ``tiny.TINY`` adds for
Nemotron-H and Falcon-H1. ``nemotronh``: Nemotron-H (4 blocks, each one mixer: Mamba2, MLP,
attention without rotary, mixture of experts; hidden 64, 8 Mamba heads of 16, state 16, chunk 8 so a
prompt spans several chunks), its layer list as the published ``hybrid_override_pattern`` gives it,
and weights wide enough that its SSM state is not float16 underflow.
``falconh1``: Falcon-H1 (2 layers, each attention with rotary and a Mamba2 mixer side by side, the
muP multipliers set away from 1 so a dropped one changes the logits)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["MAMBA_HYBRID_TINY"]

_IDS: dict[str, Any] = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0, vocab_size=128, hidden_size=64)

_NEMOTRON_H: dict[str, Any] = dict(
    **_IDS,
    layers_block_type=["linear_attention", "mlp", "full_attention", "moe"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    intermediate_size=64,
    ssm_state_size=16,
    mamba_num_heads=8,
    mamba_head_dim=16,
    n_groups=1,
    conv_kernel=4,
    chunk_size=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=32,
    n_group=1,
    topk_group=1,
    # transformers' defaults leave this model's SSM state near 1e-6, below float16's normal range (6e-5): wider
    # weights and time steps bring it near 1e-2, where --fp16 is judged on the model rather than on underflow
    initializer_range=0.1,
    time_step_min=0.01,
)

_FALCON_H1: dict[str, Any] = dict(
    **_IDS,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    mamba_d_ssm=128,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_n_groups=1,
    mamba_d_conv=4,
    mamba_chunk_size=8,
    mamba_rms_norm=True,
    embedding_multiplier=2.0,
    lm_head_multiplier=0.5,
    mlp_multipliers=[1.5, 0.5],
    key_multiplier=0.8,
    attention_in_multiplier=1.2,
    attention_out_multiplier=0.7,
    ssm_in_multiplier=1.3,
    ssm_out_multiplier=0.6,
    ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05],
)


def _nemotron_h(t: Any, **o: Any) -> Any:
    return t.NemotronHConfig(**{**_NEMOTRON_H, **o})


def _falcon_h1(t: Any, **o: Any) -> Any:
    return t.FalconH1Config(**{**_FALCON_H1, **o})


MAMBA_HYBRID_TINY: Mapping[str, tuple[str, Callable[..., Any]]] = {
    "nemotronh": ("NemotronHForCausalLM", _nemotron_h),
    "falconh1": ("FalconH1ForCausalLM", _falcon_h1),
}
