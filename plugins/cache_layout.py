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

- ``state`` (a pure state-space model: Mamba2, Mamba, FalconMamba): per layer a fixed-size recurrent state
  of the third span, ``STATE``: ``conv`` ``[batch, 1, conv_kernel, conv_dim]`` (the causal convolution's
  window) and ``ssm`` ``[batch, heads, head_dim, state_size]`` (plugins/hf/recurrent_state.py; Mamba v1's
  is one head of ``intermediate_size`` x ``state_size``). Its
  length is a fixed integer (``CacheTensor.length``); decode and the unified graph read it and
  return its replacement, prefill starts from zeros and returns it, and an empty past is its zero
  state rather than a length-0 tensor. Nothing grows, so ``per_token`` is 0.

- ``shared_kv`` (Gemma 3n): keys and values per head, but the last layers carry none: each reads,
  inside the step, the keys and values (past and new) of the last earlier layer of its attention
  kind (``reads``: layer -> that layer), so the graphs neither take nor return a cache for them.
  The carrying layers are the first ones; the manifest lists their tensors and ``kv_cache.reads``.

- ``hybrid`` (attention and state-space layers mixed: GraniteMoeHybrid, Jamba): an attention layer carries
  ``key``/``value`` as ``kv`` (growing), a state-space layer ``conv``/``ssm`` as ``state`` (fixed);
  a short-convolution layer (LFM2) its conv window ``conv`` alone (fixed), no SSM state.
  ``CacheLayout.hybrid`` also makes the two other layers a hybrid has: one with attention and a Mamba2 mixer
  side by side (Falcon-H1) carries ``key``, ``value``, ``conv`` and ``ssm``; one with neither (an MLP or
  mixture-of-experts block of Nemotron-H) carries nothing, anywhere in the stack.
  A Gated DeltaNet layer (Qwen3.5, Qwen3-Next) carries ``conv``/``ssm`` too: its conv window over q, k
  and v and its recurrent state ``[value heads, key dim, value dim]``.

- ``per_layer`` (Gemma 4): keys and values per head, of each layer's own heads and width (a sliding
  layer's and a global layer's differ: transformers' ``per_layer_config``), growing as ``kv``. With
  layers that read another's cache (its ``num_kv_shared_layers``) the kind is ``shared_kv``, whose
  carrying layers then differ in the same way.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Sequence

__all__ = ["CacheLayout", "CacheTensor", "Span"]


class Span(str, enum.Enum):
    """What a cache tensor's length dim is, and which graphs return it."""

    SEQUENCE = "sequence"  # past_seq in, total_seq out (prefill: seq): grows by every step's tokens
    ENCODER = "encoder"  # encoder_seq: prefill returns it once, later steps read it and never return it
    STATE = "state"  # a fixed length (``CacheTensor.length``): every step returns its replacement; empty: zeros


@dataclasses.dataclass(frozen=True)
class CacheTensor:
    """One cache tensor of a layer: ``past_key_values.{i}.{suffix}`` in, ``present.{i}.{suffix}``
    out, ``[batch, heads, length, width]``."""

    suffix: str
    heads: int
    width: int
    span: Span = Span.SEQUENCE
    length: int = 0  # a STATE tensor's fixed length (the others' length is a dim of the graphs)

    def __post_init__(self) -> None:
        if (self.span is Span.STATE) != (self.length > 0):
            raise ValueError(f"{self.suffix}: a fixed length is for a {Span.STATE.value} span only ({self})")


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Every layer's cache tensors, in the graphs' input order."""

    kind: str  # "kv", "latent", "state", "hybrid", "shared_kv" or "per_layer" (the module docstring)
    layers: tuple[tuple[CacheTensor, ...], ...]
    # ``shared_kv``: (layer, the earlier layer whose keys and values it reads) for each layer that carries none
    reads: tuple[tuple[int, int], ...] = ()

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

    @classmethod
    def state(cls, n_layers: int, conv: tuple[int, int], ssm: tuple[int, int, int]) -> CacheLayout:
        """A recurrent state per layer (Mamba2): the conv window ``[1, conv_kernel, conv_dim]`` and
        the SSM state ``[heads, head_dim, state_size]``, of fixed sizes."""
        kernel, width = conv
        heads, head_dim, size = ssm
        window = CacheTensor("conv", 1, width, Span.STATE, kernel)
        return cls("state", ((window, CacheTensor("ssm", heads, size, Span.STATE, head_dim)),) * n_layers)

    @classmethod
    def hybrid(
        cls,
        kinds: Sequence[str],
        kv: tuple[int, int],
        conv: tuple[int, int],
        ssm: tuple[int, int, int] | None = None,
    ) -> CacheLayout:
        """A hybrid's layers, each of one kind: ``kv`` (attention: ``key``/``value`` of
        ``kv`` (heads, width), growing), ``state`` (a state-space or Gated DeltaNet layer: ``conv``/``ssm``
        of fixed sizes, as ``state``), ``conv`` (a short convolution, LFM2: the conv window alone),
        ``kv+state`` (attention and a Mamba2 mixer side by side, Falcon-H1: all four) or ``none`` (a block
        without attention or state, Nemotron-H's MLP: nothing). ``ssm`` None: no layer may hold an SSM state."""
        kernel, width = conv
        keys, window = cls.kv(1, *kv).layers[0], (CacheTensor("conv", 1, width, Span.STATE, kernel),)
        own: dict[str, tuple[CacheTensor, ...]] = {"kv": keys, "conv": window, "none": ()}
        if ssm is not None:
            state = cls.state(1, conv, ssm).layers[0]
            own |= {"state": state, "kv+state": keys + state}
        if unknown := sorted(set(kinds) - set(own)):
            raise ValueError(f"layer kinds {unknown} are not one of {sorted(own)}")
        return cls("hybrid", tuple(own[k] for k in kinds))

    @classmethod
    def shared_kv(cls, n_layers: int, heads: int, width: int, reads: dict[int, int]) -> CacheLayout:
        """Keys and values per head, but each layer of ``reads`` (the last ones) carries none: it
        attends over the keys and values of the earlier layer ``reads`` names, within the step."""
        own = (CacheTensor("key", heads, width), CacheTensor("value", heads, width))
        if sorted(reads) != list(range(n_layers - len(reads), n_layers)) or any(
            p >= min(reads) for p in reads.values()
        ):
            raise ValueError(f"only the last layers can read an earlier layer's cache ({reads})")
        layers = tuple(() if i in reads else own for i in range(n_layers))
        return cls("shared_kv", layers, tuple(sorted(reads.items())))

    @classmethod
    def per_layer(cls, shapes: Sequence[tuple[int, int]], reads: dict[int, int]) -> CacheLayout:
        """Keys and values of each layer's own ``(heads, width)`` (Gemma 4's ``per_layer_config``); the
        layers of ``reads`` carry none, as in ``shared_kv`` (the kind then), else the kind is ``per_layer``."""
        n = len(shapes)
        if reads:
            shared = cls.shared_kv(n, 1, 1, reads)  # checks that only the last layers read an earlier one
            return dataclasses.replace(shared, layers=cls._own(shapes, set(reads)))
        return cls("per_layer", cls._own(shapes, set()))

    @staticmethod
    def _own(shapes: Sequence[tuple[int, int]], skip: set[int]) -> tuple[tuple[CacheTensor, ...], ...]:
        return tuple(
            () if i in skip else (CacheTensor("key", heads, width), CacheTensor("value", heads, width))
            for i, (heads, width) in enumerate(shapes)
        )

    def carrying(self) -> int:
        """The layers that carry cache tensors (the first ones: a ``shared_kv`` layout's last layers carry none)."""
        return sum(1 for tensors in self.layers if tensors)

    def tensors(self) -> Iterator[tuple[int, CacheTensor]]:
        """``(layer, tensor)`` for every cache tensor, layer by layer."""
        for layer, tensors in enumerate(self.layers):
            for tensor in tensors:
                yield layer, tensor

    def per_token(self) -> int:
        """The numbers every token adds to the cache (all layers, the growing tensors)."""
        return sum(t.heads * t.width for _, t in self.tensors() if t.span is Span.SEQUENCE)
