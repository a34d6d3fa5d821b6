"""Mamba2's mixer in forms torch.export traces at any length, patched in while a graph is traced.

transformers 5.25's ``Mamba2Mixer`` picks its form from the step's length: one token with a cache
runs the recurrence (``causal_conv1d_update``, ``mamba2_selective_state_update``), longer inputs the
chunked scan (``mamba2_chunk_scan``: the sequence padded to a multiple of ``chunk_size`` and cut
into chunks), and ``create_recurrent_attention_mask`` drops the padding mask at one token. Traced
with a dynamic ``seq``, each of these is a guard torch.export refuses ("Not all values of seq ...
satisfy the generated guard"): ``seq == 1``, and the chunk count ``(seq + pad) // chunk_size``
with ``pad = (chunk_size - seq % chunk_size) % chunk_size``, which it cannot prove whole. So
while ``torch.compiler.is_exporting()`` every length takes one form:

- the convolution concatenates the cached window and the new inputs (the cache's own
  ``update_conv_state``, which keeps the last ``conv_kernel`` columns) and convolves them;
- the scan is the chunked scan with one chunk as long as the step (the state space dual form,
  quadratic in the step's length like attention; exact for any chunk size), from the cached state;
- the 2-D padding mask is always applied (a decode step's token is never padding).

The decode graph is traced on its own at a static length of one (``one_token``; families with these
mixers set ``LoadedModel.decode_traced``): there the step is the recurrence itself, as transformers'
one-token path computes it (``state * exp(dt A) + dt x B``, ``y = C state + D x``; the convolution over the
window shifted by one), not the scan on one position. The unified graph (a dynamic length) and prefill
keep the one form above.

Eager runs (kiln's PyTorch reference) keep transformers' own code; tests/export/test_recurrent_state.py
proves the two equal at one token and at several, from a zero and a random state.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.plugins.hf.trace_rewrites import Rewrite, while_exporting

__all__ = ["traced_mamba2", "mamba2_rewrites_for", "one_token"]

# the mixer classes of this form, and the transformers module whose functions each one calls
MIXERS = {
    "Mamba2Mixer": "transformers.models.mamba2.modeling_mamba2",
    "GraniteMoeHybridMambaLayer": "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
    "BambaMixer": "transformers.models.bamba.modeling_bamba",
    "NemotronHMamba2Mixer": "transformers.models.nemotron_h.modeling_nemotron_h",
    "FalconH1Mixer": "transformers.models.falcon_h1.modeling_falcon_h1",
}


def one_token(length: Any) -> bool:
    """Whether a step's traced length is the Python int 1 (the decode graph's trace; the unified graph's
    length is symbolic, and comparing it would add a guard)."""
    return type(length) is int and length == 1


def _segment_sum(x: Tensor) -> Tensor:
    """``[..., T]`` -> ``[..., T, T]``: entry (i, j) is ``x[j+1] + ... + x[i]`` for j <= i, -inf above."""
    length = x.size(-1)
    x = x[..., None].expand(*x.size(), length)
    below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=0)
    return sums.masked_fill(~keep, -torch.inf)


def _scan(module: Any, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One step of any length: x ``[B, S, H, P]``, dt ``[B, S, H]``, b and c ``[B, S, G, N]``, state
    ``[B, H, P, N]`` -> (output ``[B, S, H, P]`` with the D skip, the state after the step), in float32."""
    heads = x.shape[2]
    low, high = module.time_step_limit
    dt = torch.clamp(F.softplus(dt + module.dt_bias.to(dt.dtype)), min=low, max=high).float()
    x = x.float()
    b = b.float().repeat_interleave(heads // b.shape[2], dim=2, output_size=heads)
    c = c.float().repeat_interleave(heads // c.shape[2], dim=2, output_size=heads)
    skip = module.D[..., None] * x
    x = x * dt[..., None]
    a = (-torch.exp(module.A_log.float()) * dt).permute(0, 2, 1)  # [B, H, S]
    a_sum = torch.cumsum(a, dim=-1)
    decay = torch.exp(_segment_sum(a))  # [B, H, S, S]: from position s to position l
    within = torch.einsum("bhls,bshp->blhp", torch.einsum("blhn,bshn->bhls", c, b) * decay, x)
    to_end = torch.exp(a_sum[:, :, -1:] - a_sum).permute(0, 2, 1)[..., None]  # [B, S, H, 1]
    final = torch.einsum("bshn,bshp->bhpn", b * to_end, x) + torch.exp(a_sum[:, :, -1])[..., None, None] * state
    carried = torch.einsum("blhn,bhpn->blhp", c, state.float()) * torch.exp(a_sum).permute(0, 2, 1)[..., None]
    return within + carried + skip, final


def _step(module: Any, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """``_scan`` at one token (``S`` = 1) as the recurrence (transformers' ``mamba2_selective_state_update``):
    ``state * exp(dt A) + dt x B``, then ``C state + D x``, in float32."""
    heads = x.shape[2]
    low, high = module.time_step_limit
    dt = torch.clamp(F.softplus(dt[:, 0] + module.dt_bias.to(dt.dtype)), min=low, max=high).float()  # [B, H]
    x = x[:, 0].float()  # [B, H, P]
    b = b[:, 0].float().repeat_interleave(heads // b.shape[2], dim=1, output_size=heads)  # [B, H, N]
    c = c[:, 0].float().repeat_interleave(heads // c.shape[2], dim=1, output_size=heads)
    decay = torch.exp(-torch.exp(module.A_log.float()) * dt)[..., None, None]  # [B, H, 1, 1]
    final = state.float() * decay + (dt[..., None] * x)[..., None] * b[:, :, None, :]  # [B, H, P, N]
    out = (final @ c[..., None]).squeeze(-1) + module.D[..., None] * x
    return out[:, None], final


def scan_forward(module: Any, hidden_states: Tensor, B: Tensor, C: Tensor, dt: Tensor, cache: Any, **_: Any) -> Tensor:
    """``mamba2_scan_forward`` at any length (the recurrence at a traced length of one), reading and
    replacing the cache's state."""
    batch, seq, _width = hidden_states.shape
    state = cache.get_recurrent_state(module.layer_idx, state_idx=0)
    x = hidden_states.view(batch, seq, module.num_heads, module.head_dim)
    groups = (batch, seq, module.n_groups, module.ssm_state_size)
    form = _step if one_token(seq) else _scan
    out, final = form(module, x, dt, B.view(groups), C.view(groups), state)
    cache.update_recurrent_state(final.to(state.dtype), module.layer_idx)
    return out.reshape(batch, seq, module.intermediate_size)


def conv_forward(
    conv1d: nn.Conv1d,
    hidden_states: Tensor,
    cache: Any,
    layer_idx: int,
    activation: str | None = None,
    state_idx: int = 0,
    **_: Any,
) -> Tensor:
    """``causal_conv1d_forward`` at any length: the cached window and the new columns, convolved (at a traced
    length of one, the window shifted by one and convolved without padding: one output column)."""
    import importlib

    module: Any = importlib.import_module(MIXERS["Mamba2Mixer"])  # (the hybrids' causal_conv1d_fn are copies)
    seq, kernel = hidden_states.shape[-1], conv1d.kernel_size[0]
    full = cache.update_conv_state(hidden_states, layer_idx, state_idx=state_idx, conv_kernel_size=kernel)
    if one_token(seq):
        window = full[:, :, -kernel:].to(conv1d.weight.dtype)
        step = F.conv1d(window, conv1d.weight, conv1d.bias, groups=window.shape[1])
        return (step if activation is None else module.ACT2FN[activation](step)).to(hidden_states.dtype)
    out: Tensor = module.causal_conv1d_fn(full, conv1d.weight.squeeze(1), conv1d.bias, activation=activation)
    return out[:, :, -seq:]


def padding_mask(config: Any, inputs_embeds: Tensor, attention_mask: Tensor | None, **_: Any) -> Tensor | None:
    """``create_recurrent_attention_mask`` without its one-token branch: the step's columns of the 2-D mask."""
    if attention_mask is None or attention_mask.ndim != 2:
        return None
    return attention_mask[:, -inputs_embeds.shape[1] :]


@contextlib.contextmanager
def traced_mamba2(module_name: str = MIXERS["Mamba2Mixer"]) -> Iterator[None]:
    """Mamba2's mixer in the one-form code above while inside (the attributes of transformers'
    module ``module_name`` patched, restored on exit)."""
    import importlib

    module: Any = importlib.import_module(module_name)
    names = ("mamba2_scan_forward", "causal_conv1d_forward", "create_recurrent_attention_mask")
    saved = [getattr(module, n) for n in names]
    for name, new in zip(names, (scan_forward, conv_forward, padding_mask), strict=True):
        setattr(module, name, new)
    try:
        yield
    finally:
        for name, old in zip(names, saved, strict=True):
            setattr(module, name, old)


def mamba2_rewrites_for(model: nn.Module) -> Rewrite:
    """What enters ``traced_mamba2`` while torch.export traces a model with a Mamba2 mixer (``MIXERS``:
    Mamba2's, GraniteMoeHybrid's, Bamba's, Nemotron-H's, Falcon-H1's), and nothing otherwise (eager runs keep
    transformers' code)."""
    found = next((name for name in MIXERS if any(type(m).__name__ == name for m in model.modules())), "Mamba2Mixer")
    return while_exporting(model, found, functools.partial(traced_mamba2, MIXERS[found]))
