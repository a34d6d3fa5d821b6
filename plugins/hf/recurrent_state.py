"""A recurrent layer's fixed-size state (transformers' ``LinearAttentionLayer``) as kiln's two
cache tensors per layer, ``conv`` and ``ssm`` (issue 43; the ``STATE`` span of plugins/cache_layout.py).

transformers 5.25 keeps per Mamba2 layer a conv window ``conv_states[0]`` ``[batch, conv_dim,
conv_kernel]`` (the last ``conv_kernel`` inputs of the causal convolution) and an SSM state
``recurrent_states[0]`` ``[batch, num_heads, head_dim, state_size]``. kiln carries them as
``[batch, heads, length, width]`` like every cache tensor: ``conv`` ``[batch, 1, conv_kernel,
conv_dim]`` (the window's columns as its length) and ``ssm`` as it is. A prefill from zero states
equals transformers' prefill from an empty cache (its conv window is zero-padded, its scan starts
from zeros), so one graph that always reads the states serves every step.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["is_recurrent", "seed_state", "state_of"]


def is_recurrent(layer: Any) -> bool:
    """Whether a transformers cache layer holds a recurrent state (conv window and SSM state)."""
    return hasattr(layer, "conv_states") and hasattr(layer, "recurrent_states")


def seed_state(layer: Any, conv: Tensor, ssm: Tensor) -> None:
    """Load kiln's ``conv`` ``[B, 1, K, C]`` and ``ssm`` into a fresh ``LinearAttentionLayer`` as the
    state a previous step left (copies: transformers updates its states in place)."""
    window = conv.squeeze(1).transpose(1, 2)
    layer.lazy_initialization(conv_states=window, recurrent_states=ssm, conv_kernel_size=window.shape[-1])
    layer.conv_states[0], layer.recurrent_states[0] = window.clone(), ssm.clone()
    layer.has_previous_state[0] = True


def state_of(layer: Any) -> tuple[Tensor, Tensor]:
    """A ``LinearAttentionLayer``'s state after a step, as kiln's ``conv`` and ``ssm``."""
    conv: Tensor = layer.conv_states[0].transpose(1, 2).unsqueeze(1)
    ssm: Tensor = layer.recurrent_states[0]
    return conv, ssm
