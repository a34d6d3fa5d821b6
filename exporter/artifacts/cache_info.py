"""The manifest's record of one cache tensor (``kv_cache.tensors``), for caches that are not keys
and values of ``n_kv_heads`` x ``head_dim`` (``plugins.cache_layout``): multi-head latent attention's
latent and rope key, a state-space model's recurrent state."""

from __future__ import annotations

import dataclasses

from kiln.exporter.artifacts.serde import OMIT_IF_NONE

__all__ = ["CacheTensorInfo", "SharedKvRead"]


@dataclasses.dataclass(frozen=True)
class CacheTensorInfo:
    """``past_key_values.{layer}.{name}`` in, ``present.{layer}.{name}`` out, ``[batch, heads, seq, width]``."""

    layer: int
    name: str
    heads: int
    width: int
    span: str  # "sequence": grows every step; "encoder": the cross cache, returned by prefill only; "state": fixed
    length: int | None = dataclasses.field(default=None, metadata=OMIT_IF_NONE)  # a "state" tensor's fixed length


@dataclasses.dataclass(frozen=True)
class SharedKvRead:
    """A layer that carries no cache tensor of its own (``kv_cache.reads``, a ``shared_kv`` cache):
    inside each step it attends over the keys and values of the earlier layer ``reads``."""

    layer: int
    reads: int
