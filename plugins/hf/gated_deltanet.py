"""Gated DeltaNet (Qwen3.5, Qwen3-Next, Qwen3.5-MoE) in a form torch.export traces at any length,
patched in while a graph is traced.

transformers 5.25's ``torch_chunk_gated_delta_rule`` pads the step to a multiple of its chunk size
and loops over the chunks (a count torch.export cannot prove whole at a dynamic ``seq``), and its
export path inverts each chunk's unit lower-triangular system row by row. While
``torch.compiler.is_exporting()`` every length takes one form instead:

- the delta rule is one chunk as long as the step (quadratic in the step's length like attention;
  the same algebra as transformers' chunked form, exact for any chunk size) from the cached state,
  and the triangular system ``(I - L) X = B`` (``L`` strictly lower, so nilpotent) is solved by
  ``X = (I + L^(2^(k-1))) ... (I + L^2)(I + L) B`` with ``2^k`` at least the model's context, a
  fixed number of matmuls at any length (the step never exceeds the context);
- the recurrent form (one cached token) is that same function, exact at one token; the decode graph,
  traced on its own at a static length of one (mamba2_scan.py ``one_token``), takes the one-token delta
  rule for both instead (``recurrent_step``: transformers' ``torch_recurrent_gated_delta_rule`` at one
  token, ``S = g S + beta (v - (g S) k) k^T``), not the chunk and its triangular solve;
- the convolution and the padding mask are Mamba2's one-form versions (plugins/hf/mamba2_scan.py:
  transformers' causal convolution and recurrent mask are the same code in these modules).

Eager runs (kiln's PyTorch reference) keep transformers' own code.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from kiln.plugins.hf.mamba2_scan import conv_forward, one_token, padding_mask
from kiln.plugins.hf.trace_rewrites import Rewrite, while_exporting

__all__ = [
    "DELTANETS",
    "deltanet_rewrites_for",
    "gated_delta_rule",
    "recurrent_step",
    "solve_unit_lower",
    "traced_deltanet",
    "traced_rule",
]

# the Gated DeltaNet classes, and the transformers module whose functions each one calls
DELTANETS = {
    "Qwen3_5GatedDeltaNet": "transformers.models.qwen3_5.modeling_qwen3_5",
    "Qwen3NextGatedDeltaNet": "transformers.models.qwen3_next.modeling_qwen3_next",
    "Qwen3_5MoeGatedDeltaNet": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
}


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def solve_unit_lower(lower: Tensor, rhs: Tensor, steps: int) -> Tensor:
    """``(I - lower)^-1 rhs`` for a strictly lower-triangular ``lower`` ``[..., S, S]``, exact when ``2^steps >= S``."""
    power, out = lower, rhs
    for _ in range(steps):
        out = out + power @ out
        power = power @ power
    return out


def _prepared(
    tensors: tuple[Tensor, Tensor, Tensor, Tensor, Tensor], l2norm: bool, layout: Callable[[Tensor], Tensor]
) -> tuple[Tensor, ...]:
    """Both rules' common start: query and key repeated to the value's heads, every tensor laid out by
    ``layout`` (from ``[B, S, H, ...]``) in float32, query and key L2-normed where asked, the query scaled."""
    query, key, value, beta, g = tensors
    heads = value.shape[2]
    if key.shape[2] != heads:
        query = query.repeat_interleave(heads // key.shape[2], dim=2)
        key = key.repeat_interleave(heads // key.shape[2], dim=2)
    query, key, value, beta, g = (layout(x).float() for x in (query, key, value, beta, g))
    if l2norm:
        query, key = _l2norm(query), _l2norm(key)
    return query * query.shape[-1] ** -0.5, key, value, beta, g


def gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    steps: int = 16,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """The gated delta rule over a step of any length as one chunk: query and key ``[B, S, Hk, Dk]``,
    value ``[B, S, Hv, Dv]``, g and beta ``[B, S, Hv]``, state ``[B, Hv, Dk, Dv]`` -> (output
    ``[B, S, Hv, Dv]`` in the query's dtype, the state after the step in float32)."""
    dtype, heads = query.dtype, value.shape[2]
    query, key, value, beta, g = _prepared(
        (query, key, value, beta, g), use_qk_l2norm_in_kernel, lambda x: x.transpose(1, 2)
    )  # [B, H, S, D] / [B, H, S]
    length = query.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    below = causal.tril(-1)
    cum = g.cumsum(dim=-1)  # [B, H, S]
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, -torch.inf).exp()  # [B, H, S, S]
    k_beta = key * beta.unsqueeze(-1)
    strict = (k_beta @ key.transpose(-1, -2) * decay).masked_fill(~below, 0.0)
    rhs = torch.cat([value * beta.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    solved = solve_unit_lower(-strict, rhs, steps)
    width = value.shape[-1]
    new_values, k_cumdecay = solved[..., :width], solved[..., width:]
    zeros = query.new_zeros(value.shape[0], heads, key.shape[-1], width)
    state = zeros if initial_state is None else initial_state.float()
    v_new = new_values - k_cumdecay @ state
    out = (query * cum.exp().unsqueeze(-1)) @ state + (query @ key.transpose(-1, -2) * decay) @ v_new
    to_end = (cum[..., -1:] - cum).exp().unsqueeze(-1)
    final = state * cum[..., -1].exp()[..., None, None] + (key * to_end).transpose(-1, -2) @ v_new
    return out.transpose(1, 2).contiguous().to(dtype), final


def recurrent_step(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """``gated_delta_rule`` at one token (``S`` = 1) as the recurrence: the state decayed by ``exp(g)``, then
    ``S += k (beta (v - S^T k))^T`` and the output ``S^T q`` (transformers' ``torch_recurrent_gated_delta_rule``)."""
    dtype, heads = query.dtype, value.shape[2]
    query, key, value, beta, g = _prepared(
        (query, key, value, beta, g), use_qk_l2norm_in_kernel, lambda x: x[:, 0]
    )  # [B, H, D] / [B, H]
    zeros = query.new_zeros(value.shape[0], heads, key.shape[-1], value.shape[-1])
    state = (zeros if initial_state is None else initial_state.float()) * g.exp()[..., None, None]
    delta = (value - (state * key[..., None]).sum(dim=-2)) * beta[..., None]  # [B, H, Dv]
    state = state + key[..., None] * delta[..., None, :]
    out = (state * query[..., None]).sum(dim=-2)
    return out[:, None].contiguous().to(dtype), state


def traced_rule(query: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """What the trace calls for both of transformers' rules: ``recurrent_step`` at a traced length of one
    (the decode graph), ``gated_delta_rule`` at any other."""
    if one_token(query.shape[1]):
        return recurrent_step(query, *args, **kwargs)
    return gated_delta_rule(query, *args, **kwargs)


@contextlib.contextmanager
def traced_deltanet(module_name: str, steps: int) -> Iterator[None]:
    """The DeltaNet functions of transformers' module ``module_name`` replaced by the one-form code
    above while inside (``steps``: the doublings the triangular solve needs at the model's context)."""
    module: Any = importlib.import_module(module_name)
    rule = functools.partial(traced_rule, steps=steps)
    new = {
        "torch_chunk_gated_delta_rule": rule,
        "torch_recurrent_gated_delta_rule": rule,
        "causal_conv1d_forward": conv_forward,
        "create_recurrent_attention_mask": padding_mask,
    }
    saved = {name: getattr(module, name) for name in new}
    for name, fn in new.items():
        setattr(module, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def deltanet_rewrites_for(model: nn.Module) -> Rewrite:
    """What enters ``traced_deltanet`` while torch.export traces a model with a Gated DeltaNet
    (``DELTANETS``), and nothing otherwise (eager runs keep transformers' code)."""
    found = next((name for name in DELTANETS if any(type(m).__name__ == name for m in model.modules())), None)
    if found is None:
        return while_exporting(model, "Qwen3_5GatedDeltaNet", contextlib.nullcontext)
    config: Any = model.config
    context = int(getattr(config, "max_position_embeddings", None) or 2)
    steps = max(1, math.ceil(math.log2(max(context, 2))))
    return while_exporting(model, found, functools.partial(traced_deltanet, DELTANETS[found], steps))
