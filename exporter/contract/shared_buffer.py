"""Whether a decode graph can run on one cache buffer shared by past and present (``CacheUpdate``
``shared``: a buffer of fixed capacity, written in place, the tokens in it given by
``attention_mask``): only when no node reads a past's sequence length, which is then the buffer's
capacity, not the tokens (a family mask's Shape, a position counted from the cache's length).
GroupQueryAttention reads the pasts by ``attention_mask``'s total; a Shape of a past's batch or
head dims reads what the buffer holds too. Torch-free: the ONNX Runtime target's rewrite and
``kiln verify``'s facts both ask it, of onnx-ir and onnx nodes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["SEQ_AXIS", "reads_past_length"]

SEQ_AXIS = 2  # of a past [batch, heads, seq, width] (BNSH)
_RANK = 4


def reads_past_length(op_type: str, attributes: Mapping[str, Any]) -> bool:
    """Whether a node of ``op_type`` with ``attributes`` that takes a past as an input may read its
    sequence length: GroupQueryAttention does not, a Shape does where its [start, end) covers the
    sequence axis, any other node may."""
    if op_type == "GroupQueryAttention":
        return False
    if op_type != "Shape":
        return True
    start, end = int(attributes.get("start", 0)), int(attributes.get("end", _RANK))
    start, end = (start + _RANK if start < 0 else start), (end + _RANK if end < 0 else end)
    return start <= SEQ_AXIS < end
