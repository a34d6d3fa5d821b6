"""The manifest's record of one cache tensor (``kv_cache.tensors``), for caches that are not keys
and values of ``n_kv_heads`` x ``head_dim`` (``plugins.cache_layout``)."""

from __future__ import annotations

import dataclasses

__all__ = ["CacheTensorInfo"]


@dataclasses.dataclass(frozen=True)
class CacheTensorInfo:
    """``past_key_values.{layer}.{name}`` in, ``present.{layer}.{name}`` out, ``[batch, heads, seq, width]``."""

    layer: int
    name: str
    heads: int
    width: int
    span: str  # "sequence": grows every step; "encoder": the cross cache, returned by prefill only
