"""What a decoder carries from one step to the next, per layer: the cache layout of the I/O contract.

Each layer carries a tuple of cache tensors ``[batch, heads, length, width]`` (BNSH), each with
its own heads and width and a ``Span`` that says what its length is and whether a step returns
it. The graph I/O (``exporter.contract.io``), the runners that make empty pasts, parity,
``kiln generate``/``bench`` (through the graphs' own shapes), the manifest (``kv_cache.tensors``)
and ``kiln verify`` read the shapes from here, never from one head count and one width.

Kinds written today:

- ``kv`` (every family until MLA): per layer ``key`` and ``value``, ``n_kv_heads`` x ``head_dim``
  each, growing along the sequence; a cross-attention decoder adds ``cross_key``/``cross_value``
  of the encoder's length (``Span.ENCODER``: prefill returns them once, later steps only read
  them). ``DecoderSpec.cache_layout`` derives it from ``n_kv_heads``/``head_dim``, so a family
  that gives no layout exports exactly as before.
- ``latent`` (multi-head latent attention: DeepSeek-V2, DeepSeek-V3): per layer one head of the
  compressed latent, ``kv_lora_rank`` wide, under the name ``key``, and one head of the rotated
  key shared by every head, ``qk_rope_head_dim`` wide, under ``value`` (the slots transformers
  caches them in); both grow along the sequence. The attention expands them to per-head keys
  and values inside each step, so only ``kv_lora_rank + qk_rope_head_dim`` numbers per token and
  layer are carried.

Kinds the layout is shaped for, not written yet (issue 43): a fixed-size recurrent state (Mamba2's
conv window and SSM state, DeltaNet's) is a tensor of a third span, ``STATE``: its length is a
fixed integer, every step (prefill included) reads it and returns its replacement, and an empty
past is its zero state rather than a length-0 tensor; per-layer head dims (Gemma 4) are layers
whose tensors differ, which ``layers`` already holds (one tuple per layer), as does a hybrid whose
attention layers carry ``key``/``value`` and whose recurrent layers carry ``conv``/``ssm``. The Hugging
Face decoder already carries Mamba2's state that way (plugins/hf/recurrent_state.py: ``conv`` ``[batch, 1,
conv_kernel, conv_dim]``, ``ssm`` ``[batch, heads, head_dim, state_size]``; one graph of any step length,
tests/export/test_recurrent_state.py); the graph I/O and the pipeline do not know the span yet.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator

__all__ = ["CacheLayout", "CacheTensor", "Span"]


class Span(str, enum.Enum):
    """What a cache tensor's length dim is, and which graphs return it."""

    SEQUENCE = "sequence"  # past_seq in, total_seq out (prefill: seq): grows by every step's tokens
    ENCODER = "encoder"  # encoder_seq: prefill returns it once, later steps read it and never return it


@dataclasses.dataclass(frozen=True)
class CacheTensor:
    """One cache tensor of a layer: ``past_key_values.{i}.{suffix}`` in, ``present.{i}.{suffix}``
    out, ``[batch, heads, length, width]``."""

    suffix: str
    heads: int
    width: int
    span: Span = Span.SEQUENCE


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Every layer's cache tensors, in the graphs' input order."""

    kind: str  # "kv" or "latent" (the module docstring)
    layers: tuple[tuple[CacheTensor, ...], ...]

    @classmethod
    def kv(cls, n_layers: int, heads: int, width: int, *, cross: bool = False) -> CacheLayout:
        """Keys and values per head (and a cross-attention decoder's cross cache)."""
        own = (CacheTensor("key", heads, width), CacheTensor("value", heads, width))
        extra = (
            (
                CacheTensor("cross_key", heads, width, Span.ENCODER),
                CacheTensor("cross_value", heads, width, Span.ENCODER),
            )
            if cross
            else ()
        )
        return cls("kv", ((*own, *extra),) * n_layers)

    @classmethod
    def latent(cls, n_layers: int, rank: int, rope: int) -> CacheLayout:
        """Multi-head latent attention: the compressed latent (``key``) and the shared rope key (``value``)."""
        return cls("latent", ((CacheTensor("key", 1, rank), CacheTensor("value", 1, rope)),) * n_layers)

    def tensors(self) -> Iterator[tuple[int, CacheTensor]]:
        """``(layer, tensor)`` for every cache tensor, layer by layer."""
        for layer, tensors in enumerate(self.layers):
            for tensor in tensors:
                yield layer, tensor

    def per_token(self) -> int:
        """The numbers every token adds to the cache (all layers, the growing tensors)."""
        return sum(t.heads * t.width for _, t in self.tensors() if t.span is Span.SEQUENCE)
