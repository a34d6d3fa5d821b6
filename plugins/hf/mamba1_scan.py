"""Mamba v1's selective scan in a form torch.export traces at any length, patched in while a graph is traced.

transformers 5.25's ``MambaMixer`` (and ``FalconMambaMixer`` and Jamba's ``JambaMambaMixer``, copies with
RMS norms on dt, B and C) runs ``mamba_scan_forward``: one token with a cache takes the recurrence
(``mamba_selective_state_update``), longer inputs ``mamba_selective_scan``, whose slow path is a
Python loop over the sequence (unrolled to the traced length; a dynamic ``seq`` is refused) and
which ignores the cached state. While ``torch.compiler.is_exporting()`` every length takes one form:

- the state of every position, ``h[t] = exp(A dt[t]) h[t-1] + dt[t] B[t] x[t]``, as an inclusive
  associative scan of the pairs (log decay, input) by doubling (Hillis-Steele): ``SCAN_DEPTH`` steps,
  each combining position ``t`` with ``t - 2^k`` (the shift is a roll masked below ``2^k``, so no step
  depends on the length); the decays are summed in log space and applied as ``exp`` of a sum <= 0,
  never divided out, so no step overflows; the cached state enters as ``exp(cumsum(log decay)) h0``;
- the convolution as Mamba2's (plugins/hf/mamba2_scan.py ``conv_forward``: the cached window and the
  new columns, convolved), from the same ``causal_conv1d_forward`` signature; Jamba's padding mask as
  Mamba2's hybrids' (``padding_mask``: always the step's columns).

Each doubling step costs O(batch x intermediate x seq x state); ``SCAN_DEPTH`` steps cover 2^20
tokens in one step, beyond any Mamba checkpoint's context. The decode graph, traced on its own at a static
length of one (mamba2_scan.py ``one_token``), takes the recurrence instead (``step_state``: transformers'
``mamba_selective_state_update``), not the doubling scan on one position; the unified graph and prefill
keep the scan.
Eager runs (kiln's PyTorch reference) keep transformers' own code, but for a step of several tokens from
a non-empty state, which transformers' sequence form gets wrong (``token_by_token``; from an empty cache,
the unified graph's prompt call, the sequence form is exact and alone masks the padding:
``continues_a_state``); Mamba and FalconMamba hand every mixer the 2-D mask as it is, so kiln passes them
the step's columns (``step_mask``). tests/export/test_mamba1.py proves the traced form equal to
transformers' at one token and at several.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.plugins.hf.mamba2_scan import conv_forward, one_token, padding_mask
from kiln.plugins.hf.trace_rewrites import Rewrite, while_exporting

__all__ = [
    "MIXERS",
    "SCAN_DEPTH",
    "continues_a_state",
    "flat_states",
    "is_mamba1",
    "mamba1_rewrites_for",
    "selective_scan",
    "step_mask",
    "step_state",
    "token_by_token",
    "traced_mamba1",
]

# the Mamba v1 mixer classes, and the transformers module whose functions each one calls
MIXERS = {
    "MambaMixer": "transformers.models.mamba.modeling_mamba",
    "FalconMambaMixer": "transformers.models.falcon_mamba.modeling_falcon_mamba",
    "JambaMambaMixer": "transformers.models.jamba.modeling_jamba",
}
# the mixers of a model without attention, handed the 2-D mask as it is (``step_mask``)
PURE = ("MambaMixer", "FalconMambaMixer")
SCAN_DEPTH = 20  # doubling steps: one step of the graphs scans up to 2^20 tokens


def _shifted(x: Tensor, by: int, keep: Tensor) -> Tensor:
    """``x`` moved ``by`` positions later along dim 2, zeros where ``keep`` (``[T, 1]``) is false."""
    return torch.where(keep, torch.roll(x, by, dims=2), torch.zeros((), dtype=x.dtype))


def selective_scan(decay: Tensor, inputs: Tensor, state: Tensor, depth: int = SCAN_DEPTH) -> tuple[Tensor, Tensor]:
    """``decay`` (log, <= 0) and ``inputs`` ``[B, I, T, N]``, ``state`` ``[B, I, N]`` -> the state after
    every position ``[B, I, T, N]`` and the last one: ``h[t] = exp(decay[t]) h[t-1] + inputs[t]``."""
    positions = torch.arange(decay.shape[2], device=decay.device)[:, None]
    carried = torch.exp(torch.cumsum(decay, dim=2)) * state[:, :, None, :]
    for k in range(depth):
        keep = positions >= 2**k
        inputs = inputs + torch.exp(decay) * _shifted(inputs, 2**k, keep)
        decay = decay + _shifted(decay, 2**k, keep)
    states = inputs + carried
    return states, states[:, :, -1]


def step_state(decay: Tensor, inputs: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """``selective_scan`` at one position (``T`` = 1) as the recurrence: ``h = exp(decay) h0 + inputs``."""
    final = torch.exp(decay[:, :, 0]) * state + inputs[:, :, 0]
    return final[:, :, None], final


def scan_forward(
    module: Any, hidden_states: Tensor, time_step: Tensor, B: Tensor, C: Tensor, gate: Tensor, cache: Any, **_: Any
) -> Tensor:
    """``mamba_scan_forward`` at any length (the recurrence at a traced length of one), from and into the cache's
    state: x, time step and gate ``[B, I, T]``, B and C ``[B, T, N]`` -> the gated output ``[B, I, T]`` with the
    D skip (float32)."""
    state = cache.get_recurrent_state(module.layer_idx, state_idx=0)
    bias = module.dt_proj.bias.float()[None, :, None] if module.dt_proj.bias is not None else 0.0
    dt = F.softplus(time_step.float() + bias)  # [B, I, T]
    x = hidden_states.float()
    decay = -torch.exp(module.A_log.float())[None, :, None, :] * dt[..., None]  # [B, I, T, N]
    inputs = dt[..., None] * B.float()[:, None, :, :] * x[..., None]
    form = step_state if one_token(x.shape[2]) else selective_scan
    states, final = form(decay, inputs, state.float())
    out: Tensor = torch.einsum("bitn,btn->bit", states, C.float()) + x * module.D.float()[None, :, None]
    cache.update_recurrent_state(final.to(state.dtype), module.layer_idx)
    return out * F.silu(gate.float())


@contextlib.contextmanager
def traced_mamba1(module_name: str = MIXERS["MambaMixer"]) -> Iterator[None]:
    """Mamba v1's scan and convolution in the one-form code above while inside (the attributes of
    transformers' module ``module_name`` patched, restored on exit)."""
    module: Any = importlib.import_module(module_name)
    own = {"mamba_scan_forward": scan_forward, "causal_conv1d_forward": conv_forward}
    if hasattr(module, "create_recurrent_attention_mask"):  # a hybrid's (Jamba): Mamba2's one-form mask
        own["create_recurrent_attention_mask"] = padding_mask
    names = tuple(own)
    saved = [getattr(module, n) for n in names]
    for name, new in own.items():
        setattr(module, name, new)
    try:
        yield
    finally:
        for name, old in zip(names, saved, strict=True):
            setattr(module, name, old)


def _mixer(model: nn.Module) -> str | None:
    return next((name for name in MIXERS if any(type(m).__name__ == name for m in model.modules())), None)


def mamba1_rewrites_for(model: nn.Module) -> Rewrite:
    """What enters ``traced_mamba1`` while torch.export traces a model with a Mamba v1 mixer, and
    nothing otherwise (eager runs keep transformers' code)."""
    found = _mixer(model) or "MambaMixer"
    return while_exporting(model, found, functools.partial(traced_mamba1, MIXERS[found]))


def is_mamba1(model: nn.Module) -> bool:
    """Whether the model has Mamba v1 mixers (its SSM state ``[B, I, N]``: ``flat_states``, ``token_by_token``)."""
    return _mixer(model) is not None


def step_mask(model: nn.Module) -> bool:
    """Whether the model hands its 2-D mask to every mixer as it is (``MambaModel``, ``FalconMambaModel``:
    ``hidden * mask[:, :, None]``), so a step's call must pass the step's columns only (kiln's mask
    covers the past too; transformers' generate() passes none after the prompt). Jamba's mixers read
    ``create_recurrent_attention_mask``'s, which slices it itself."""
    return _mixer(model) in PURE


def flat_states(cache: Any) -> None:
    """A Mamba v1 cache as its mixers read it: each seeded SSM state ``[B, 1, I, N]`` (kiln's one head,
    ``recurrent_state.state_of``) back to transformers' ``[B, I, N]``."""
    for layer in cache.layers:
        states = getattr(layer, "recurrent_states", None)
        if states and states.get(0) is not None and states[0].ndim == 4:
            states[0] = states[0].squeeze(1)


def continues_a_state(input_ids: Tensor, attention_mask: Tensor, past: Any) -> bool:
    """Whether a step of several tokens continues a state (``token_by_token``'s case): a past position
    before it (kiln's mask covers the past), or a state not zero. From an empty cache (no past position,
    every state zero: ``contract.steps.empty_past``, the unified graph's prompt call) transformers'
    sequence form is exact, and only it zeroes the step's padding: Jamba's one-token recurrence reads no
    mask (``create_recurrent_attention_mask`` gives none for one token), so token by token a left-padded
    row's padding would enter its state, where the graphs and prefill's reference leave it out."""
    if attention_mask.shape[1] > input_ids.shape[1]:
        return True
    return any(bool(tensor.any()) for layer in past for tensor in layer)


Step = Callable[[Tensor, Tensor, Tensor, Any, bool], tuple[Tensor, Any]]


def token_by_token(
    step: Step, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, past: Any, last_only: bool
) -> tuple[Tensor, Any]:
    """A step of several tokens from a non-empty state as transformers' one-token recurrence, token after
    token (``step``: the decoder's own forward). kiln's eager reference takes this form there because
    transformers' sequence form (``mamba_selective_scan``) starts from zeros whatever the cache holds
    (its own TODO), which only generate()'s prompt, from an empty cache, never exposes."""
    logits, seq, total = [], input_ids.shape[1], attention_mask.shape[1]
    for t in range(seq):
        cut = slice(t, t + 1)
        out, past = step(
            input_ids[:, cut], attention_mask[:, : total - seq + t + 1], position_ids[:, cut], past, last_only
        )
        logits.append(out)
    return (logits[-1] if last_only else torch.cat(logits, dim=1)), past
