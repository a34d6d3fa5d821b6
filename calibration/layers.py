"""A decoder's layers run one at a time on calibration data (layer-by-layer GPTQ: ``int4.hessians``).

``capture`` runs each batch of windows through the model once with every decoder layer's
``forward`` replaced by a recorder: what each layer is called with (the hidden state, and the
rest of its arguments: masks, positions, position embeddings, whatever the family's model hands
it) is kept, the hidden state passes through unchanged, and the forward stops at the last layer
(no logits are computed). The layers then run one at a time on those calls (``LayerCall.run``),
their outputs replacing the hidden states in place: the inputs of the next layer.

Family-neutral: a layer is called with its hidden state first (positionally or as
``hidden_states=``) and returns it, alone or first in a tuple (kiln's native layers, transformers'
decoder layers). The arguments it is given depend on the batch, never on the hidden state's values
(masks and rotary embeddings are computed before the layers), so a pass-through recorder sees
what the real layers would; each layer's own call is recorded (a sliding-window layer gets its
own mask). A transformers ``Cache`` is not kept: a layer run here computes without one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from kiln.errors import CalibrationError

__all__ = [
    "Batch",
    "Form",
    "LayerCall",
    "Stop",
    "capture",
    "decoder_layers",
    "hidden_of",
    "layer_feeds",
    "replaced_forwards",
]

_BATCH = 16  # windows per forward


class Stop(Exception):
    """Ends a forward once what was wanted of it is recorded (never reaches a user)."""


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """How the model called one decoder layer on one batch, without the hidden state."""

    args: tuple[object, ...]  # the positional arguments after the hidden state
    kwargs: dict[str, object]
    positional: bool  # the hidden state came first positionally (else as ``hidden_states=``)

    def run(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output hidden state for ``hidden``."""
        out = (
            layer(hidden, *self.args, **self.kwargs)
            if self.positional
            else layer(*self.args, hidden_states=hidden, **self.kwargs)
        )
        return hidden_of(out)


@dataclasses.dataclass(frozen=True)
class Batch:
    """A batch of equal-length windows: its feeds, the current layer's input hidden states
    (``[B, S, d]``, replaced in place as the layers run) and each layer's call."""

    feeds: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # input_ids, attention_mask, position_ids [B, S]
    hidden: torch.Tensor
    calls: tuple[LayerCall, ...]


def hidden_of(out: object) -> torch.Tensor:
    """A layer's output hidden state: the output itself, or the first of a tuple."""
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(first, torch.Tensor):
        raise CalibrationError(
            f"GPTQ: a decoder layer returned {type(out).__name__}; expected its hidden state, alone or first in a tuple"
        )
    return first


def _without_cache(value: object) -> object:
    transformers = sys.modules.get("transformers")
    cache = getattr(transformers, "Cache", None) if transformers is not None else None
    return None if isinstance(cache, type) and isinstance(value, cache) else value


def _split(args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[torch.Tensor, LayerCall]:
    """A layer's arguments -> (its hidden state, the rest of its call)."""
    positional = bool(args)
    hidden = args[0] if positional else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        raise CalibrationError(
            "GPTQ: a decoder layer was called without its hidden state first (positionally or as "
            "hidden_states=): it cannot be run on its own"
        )
    rest = tuple(_without_cache(a) for a in args[1:])
    named = {k: _without_cache(v) for k, v in kwargs.items() if k != "hidden_states"}
    return hidden, LayerCall(rest, named, positional)


def decoder_layers(module: nn.Module, prefix: str | None, n_layers: int) -> list[nn.Module]:
    """The decoder layers of ``module`` (``prefix``: a ``LayerPlan``'s, ``layers.{}``); none without one."""
    if prefix is None:
        return []
    try:
        return [module.get_submodule(prefix.format(i)) for i in range(n_layers)]
    except AttributeError:
        raise CalibrationError(
            f"GPTQ: the model has no decoder layers at {prefix.format('i')} for i < {n_layers}"
        ) from None


def layer_feeds(windows: Sequence[np.ndarray]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(input_ids, attention_mask, position_ids)`` of unpadded batches of equal-length windows
    (every row's positions are real tokens)."""
    by_length: dict[int, list[np.ndarray]] = {}
    for window in windows:
        by_length.setdefault(len(window), []).append(window)
    for same in by_length.values():
        for start in range(0, len(same), _BATCH):
            ids = torch.from_numpy(np.stack(same[start : start + _BATCH]).astype(np.int64))  # [B, S]
            yield ids, torch.ones_like(ids), torch.arange(ids.shape[1], dtype=torch.int64).expand_as(ids).contiguous()


@contextlib.contextmanager
def replaced_forwards(layers: Sequence[nn.Module], forward: Callable[..., object]) -> Iterator[None]:
    """Each layer's ``forward`` is ``forward(index, *args, **kwargs)`` inside (this instance only),
    restored after."""
    saved = [layer.__dict__.get("forward") for layer in layers]
    for index, layer in enumerate(layers):
        layer.forward = functools.partial(forward, index)
    try:
        yield
    finally:
        for layer, own in zip(layers, saved, strict=True):
            if own is None:
                del layer.forward
            else:
                layer.forward = own


def _check_order(index: int, hidden: torch.Tensor, calls: Sequence[LayerCall], handed: Sequence[torch.Tensor]) -> None:
    """Layer ``index`` is called next, on the very tensor the layer before handed on: run one at a
    time, the layers compute what the model computes."""
    if index != len(calls):
        raise CalibrationError(
            f"GPTQ: decoder layer {index} was called out of order (after {len(calls)} layers); it cannot be "
            "quantized layer by layer: use --int4-method rtn"
        )
    if index > 0 and not (handed and hidden is handed[0]):
        raise CalibrationError(
            f"GPTQ: the model changes the hidden state between decoder layers {index - 1} and {index}; it cannot "
            "be quantized layer by layer: use --int4-method rtn"
        )


@dataclasses.dataclass(frozen=True)
class Form:
    """The form a family's layer output takes: the hidden state alone (``rest`` None) or first in
    a tuple, then ``rest`` (what a recorder hands on in its place: a real layer 0's)."""

    rest: tuple[object, ...] | None

    @classmethod
    def of(cls, out: object) -> Form:
        return cls(tuple(out[1:])) if isinstance(out, (tuple, list)) else cls(None)

    def wrap(self, hidden: torch.Tensor) -> object:
        return hidden if self.rest is None else (hidden, *self.rest)


def capture(
    module: nn.Module, layers: Sequence[nn.Module], feeds: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
) -> tuple[list[Batch], Form]:
    """Each batch's layer-0 input and every layer's call (layers replaced by recorders), and the
    form of the layers' output (learnt from one real call of layer 0)."""
    batches: list[Batch] = []
    form: list[Form] = []

    def record(index: int, *args: Any, **kwargs: Any) -> object:
        hidden, call = _split(args, kwargs)
        _check_order(index, hidden, calls, handed)
        calls.append(call)
        if index == 0:
            first.append(hidden.detach().clone())
            if not form:  # the form a layer's output takes: run layer 0 for real, once
                real = layers[0].__dict__.pop("forward")
                try:
                    form.append(Form.of(layers[0](*args, **kwargs)))
                finally:
                    layers[0].forward = real
        if index == len(layers) - 1:
            raise Stop
        handed[:] = [hidden]
        return form[0].wrap(hidden)

    with replaced_forwards(layers, record):
        for ids, mask, pos in feeds:
            calls: list[LayerCall] = []
            first: list[torch.Tensor] = []
            handed: list[torch.Tensor] = []  # the hidden state the last recorder handed on
            try:
                module(ids, mask, pos)
            except Stop:
                pass
            if len(calls) != len(layers) or len(first) != 1:
                raise CalibrationError(
                    f"GPTQ: the model called {len(calls)} of its {len(layers)} decoder layers (in order, each "
                    "once expected)"
                )
            batches.append(Batch((ids, mask, pos), first[0], tuple(calls)))
    return batches, form[0]
