"""A recurrent layer's fixed-size state (transformers' ``LinearAttentionLayer``) as kiln's two
cache tensors per layer, ``conv`` and ``ssm`` (issue 43; the ``STATE`` span of plugins/cache_layout.py).

transformers 5.25 keeps per Mamba2 layer a conv window ``conv_states[0]`` ``[batch, conv_dim,
conv_kernel]`` (the last ``conv_kernel`` inputs of the causal convolution) and an SSM state
``recurrent_states[0]`` ``[batch, num_heads, head_dim, state_size]``. kiln carries them as
``[batch, heads, length, width]`` like every cache tensor: ``conv`` ``[batch, 1, conv_kernel,
conv_dim]`` (the window's columns as its length) and ``ssm`` as it is. A prefill from zero states
equals transformers' prefill from an empty cache (its conv window is zero-padded, its scan starts
from zeros), so one graph that always reads the states serves every step. A Mamba v1 layer's SSM state
is ``[batch, intermediate, state_size]``: kiln carries it as one head (``[batch, 1, intermediate,
state_size]``) and plugins/hf/mamba1_scan.py ``flat_states`` gives it back its three dims when seeded.

LFM2's short-convolution layers (``layer_types`` ``conv``) are ``LinearAttentionLayer``s too, whose
``conv_states[0]`` is ``[batch, hidden, conv_L_cache]`` and whose ``recurrent_states[0]`` stays None:
kiln carries their ``conv`` alone (``layer_names`` with the layer's type).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["is_recurrent", "layer_names", "layer_tensors", "seed_layer", "seed_state", "state_of"]


def is_recurrent(layer: Any) -> bool:
    """Whether a transformers cache layer holds a recurrent state (conv window and SSM state)."""
    return hasattr(layer, "conv_states") and hasattr(layer, "recurrent_states")


def layer_names(layer: Any, layer_type: str | None = None) -> tuple[str, ...]:
    """kiln's names of a transformers cache layer's tensors, in the layout's order: ``key``/``value``
    (attention), ``conv``/``ssm`` (a recurrent state), all four (both side by side: Falcon-H1's
    ``LinearAttentionAndFullAttentionLayer``), none (a ``DummyLayer``: Nemotron-H's MLP blocks); ``conv``
    alone on a short-convolution layer (``layer_type`` ``conv``: LFM2's, which holds no SSM state)."""
    if layer_type == "conv" and is_recurrent(layer):
        return ("conv",)
    keys = ("key", "value") if hasattr(layer, "keys") and type(layer).__name__ != "DummyLayer" else ()
    return keys + (("conv", "ssm") if is_recurrent(layer) else ())


def seed_layer(layer: Any, tensors: Any, index: int, cache: Any) -> None:
    """Load one layer's kiln tensors (``layer_names`` order) into transformers' ``cache``."""
    names = layer_names(layer)
    if "key" in names:
        cache.update(*tensors[:2], index)
    if "conv" in names:
        seed_state(layer, *tensors[-2:])


def layer_tensors(layer: Any) -> tuple[Tensor, ...]:
    """A transformers cache layer's tensors after a step, in ``layer_names`` order."""
    names = layer_names(layer)
    keys = (layer.keys, layer.values) if "key" in names else ()
    return keys + (state_of(layer) if "conv" in names else ())


def seed_state(layer: Any, conv: Tensor, ssm: Tensor | None = None) -> None:
    """Load kiln's ``conv`` ``[B, 1, K, C]`` and ``ssm`` (none on a conv-only layer) into a fresh
    ``LinearAttentionLayer`` as the state a previous step left (copies: transformers updates its states
    in place)."""
    window = conv.squeeze(1).transpose(1, 2)
    layer.lazy_initialization(conv_states=window, recurrent_states=ssm, conv_kernel_size=window.shape[-1])
    layer.conv_states[0] = window.clone()
    if ssm is not None:
        layer.recurrent_states[0] = ssm.clone()
    layer.has_previous_state[0] = True


def state_of(layer: Any) -> tuple[Tensor, ...]:
    """A ``LinearAttentionLayer``'s state after a step, as kiln's ``conv`` and ``ssm`` (``conv`` alone
    where the layer holds no SSM state: LFM2's short convolution)."""
    conv: Tensor = layer.conv_states[0].transpose(1, 2).unsqueeze(1)
    ssm: Tensor | None = layer.recurrent_states[0]
    if ssm is not None and ssm.ndim == 3:  # Mamba v1's [B, intermediate, state_size]: one head (mamba1_scan)
        ssm = ssm.unsqueeze(1)
    return (conv,) if ssm is None else (conv, ssm)
