"""The static cache's attention mask, built once per graph from the contract's inputs and read by
every layer's ``Attention`` (``contract.static_cache`` says what it admits)::

    key_ok  = Cast(Pad(attention_mask, to max_context), bool)       [B, MAX]: a real token's slot
    qslot   = write_indices[:, None] + Range(seq)                   [B, S]: each query's own slot (prefill: Range(seq))
    allowed = (j <= qslot AND key_ok) OR j == qslot                 [B, S, MAX], j = Range(MAX)
              (a sliding-window layer's: AND j > qslot - window in the first term, as transformers)
    mask    = Unsqueeze(allowed, 1)                                 [B, 1, S, MAX] bool

Why this form (measured on ONNX Runtime 1.32, read from TensorRT's ONNX parser; ../shared and
research23): ``is_causal=1`` without past aligns top-left (a decode query would see slot 0 only)
and TensorRT forbids it together with a mask; ``nonpad_kv_seqlen`` is ignored by TensorRT's
importer; TensorRT takes a bool mask or one of the scores' dtype, with full ``s_q`` and
``s_kv``. The diagonal term keeps a padding query's row non-empty, so it is finite on any
backend (its value is undefined and never compared or read: its slot is masked for the others).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.exporter.contract.static_cache import WRITE_INDICES
from kiln.exporter.passes.ir_utils import constant

__all__ = ["static_masks"]


def _op(graph: ir.Graph, op_type: str, *inputs: ir.Value, **attributes: Any) -> ir.Value:
    node = ir.node(op_type, list(inputs), attributes or None, name=f"/static/mask/{op_type}_{len(graph)}")
    graph.append(node)
    return node.outputs[0]


def static_masks(
    graph: ir.Graph, *, max_context: int, prefill: bool, windows: set[int | None]
) -> dict[int | None, ir.Value]:
    """The bool ``[B, 1, S, max_context]`` mask (module docstring) of each window (None: none),
    their nodes appended to ``graph``; ``prefill``: ``[B, 1, S, S]``, over the prompt's own keys
    (slot j = key j: prefill writes at slot 0), what its Attention reads instead of the buffer."""
    inputs = {v.name: v for v in graph.inputs}
    ids, attention = inputs["input_ids"], inputs["attention_mask"]

    def const(name: str, array: np.ndarray) -> ir.Value:
        return constant(graph, f"static/{name}", array)

    zero, one = const("zero", np.array(0, np.int64)), const("one", np.array(1, np.int64))
    seq = _op(graph, "Squeeze", _op(graph, "Shape", ids, start=1, end=2), const("axis0", np.array([0], np.int64)))
    queries = _op(graph, "Range", zero, seq, one)  # [S]
    if (
        prefill
    ):  # every row writes at slot 0, and its queries see its own S keys only: attention reads those, not the buffer
        key_ok = _op(graph, "Cast", attention, to=ir.DataType.BOOL)  # [B, S]
        qslot = _op(graph, "Unsqueeze", queries, const("axis0", np.array([0], np.int64)))  # [1, S]
        slots = queries  # [S]
    else:
        total = _op(graph, "Shape", attention, start=1, end=2)  # [1]: total_seq
        pads = _op(
            graph,
            "Concat",
            const("pad_begin", np.zeros(3, np.int64)),
            _op(graph, "Sub", const("max", np.array([max_context], np.int64)), total),
            axis=0,
        )
        key_ok = _op(graph, "Cast", _op(graph, "Pad", attention, pads), to=ir.DataType.BOOL)  # [B, MAX]
        qslot = _op(
            graph,
            "Add",
            _op(graph, "Unsqueeze", inputs[WRITE_INDICES], const("axis1", np.array([1], np.int64))),
            queries,
        )  # [B, S]
        slots = const("slots", np.arange(max_context, dtype=np.int64))  # [MAX]
    qslot3 = _op(graph, "Unsqueeze", qslot, const("axis2", np.array([2], np.int64)))  # [B, S, 1]
    causal = _op(graph, "LessOrEqual", slots, qslot3)  # [B, S, MAX]
    real = _op(graph, "Unsqueeze", key_ok, const("axis1", np.array([1], np.int64)))  # [B, 1, MAX]
    own = _op(graph, "Equal", slots, qslot3)
    seen = _op(graph, "And", causal, real)
    masks = {}
    for window in sorted(windows, key=lambda w: -1 if w is None else w):
        visible = seen
        if window is not None:  # slots j > qslot - window
            recent = _op(
                graph,
                "Greater",
                slots,
                _op(graph, "Sub", qslot3, const(f"window_{window}", np.array(window, np.int64))),
            )
            visible = _op(graph, "And", seen, recent)
        masks[window] = _op(
            graph, "Unsqueeze", _op(graph, "Or", visible, own), const("axis1", np.array([1], np.int64))
        )  # [B, 1, S, MAX]
    return masks
