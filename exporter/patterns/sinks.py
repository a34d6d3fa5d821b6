"""Attention sinks as the attention core's pattern (``attention``) finds them: a learned logit per
query head that joins the softmax's denominator and attends to nothing. transformers 5.25 writes
them two ways, and both trace to a form the core's pattern takes optionally:

- concatenated (gpt-oss, Flint): ``Softmax(Concat(scores, Expand(sinks [1, N, 1, 1]), axis=-1)
  [- ReduceMax(that, -1)])[..., :-1]``, the sink's column sliced off before the value MatMul
  (the row max, gpt-oss's, changes nothing: a softmax is shift-invariant along its axis);
- as a gate (Granite-SWA, GraniteMoe-SWA): ``(Softmax(scores) @ V) * Unsqueeze(Sigmoid(
  ReduceLogSumExp(scores, -1) - sinks [1, N, 1]), -1)``, which is the same attention:
  ``sigmoid(lse - s) = sum(e^x) / (sum(e^x) + e^s)``.

``concat_sink`` and ``gate_sink`` check what the pattern bound and return the sinks as a value of
N elements (a 1-D initializer where the trace reshapes one, which ONNX Runtime's
GroupQueryAttention takes as its ``head_sink`` input), or why the match is not one.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from kiln.exporter.passes.ir_utils import producer
from kiln.exporter.patterns.rules import fail

__all__ = ["concat_sink", "gate_sink"]


def _ints(value: ir.Value | None) -> list[int] | None:
    """The values of a constant int tensor (initializer or ``Constant`` node), else None."""
    if value is None:
        return None
    tensor = value.const_value
    node = value.producer()
    if tensor is None and node is not None and node.op_type == "Constant" and "value" in node.attributes:
        tensor = node.attributes["value"].as_tensor()
    return [int(i) for i in tensor.numpy().reshape(-1)] if tensor is not None else None


def _last_axis(axes: list[int] | None, rank: int = 4) -> bool:
    return axes is not None and len(axes) == 1 and axes[0] in (-1, rank - 1)


def _per_head(
    sinks: ir.Value | None, dims: tuple[tuple[int, ...], ...], n_heads: int, dtype: ir.DataType | None
) -> ir.Value | MatchResult:
    """``sinks`` (shaped as one of ``dims``, N standing for n_heads) as N values: the 1-D value a
    Reshape made it from, when there is one, else itself."""
    shape = tuple(sinks.shape) if sinks is not None and sinks.shape is not None else None
    wanted = [tuple(n_heads if d == -1 else d for d in form) for form in dims]
    if sinks is None or shape not in wanted:
        return fail(
            f"the attention sinks are shaped {list(shape) if shape is not None else None}, not one logit per "
            f"query head ({n_heads})"
        )
    if sinks.dtype != dtype:
        return fail(f"the attention sinks are {sinks.dtype}, the queries {dtype}")
    reshape = producer(sinks, "Reshape")
    source = reshape.inputs[0] if reshape is not None else None
    flat = source is not None and source.shape is not None and tuple(source.shape) == (n_heads,)
    return source if flat and source is not None else sinks


def concat_sink(bound: dict[str, Any], n_heads: int, dtype: ir.DataType | None) -> ir.Value | MatchResult:
    """The concatenated form (module docstring): the sinks, or why not."""
    concat, probs = bound["joined"].producer(), bound.get("kept")
    if concat is None or concat.attributes.get_int("axis", 0) not in (-1, 3):
        return fail("the scores are concatenated with another tensor on an axis other than the keys'")
    if probs is None:
        return fail("the scores are concatenated with per-head logits, but no column is sliced off the probabilities")
    slice_node = probs.producer()
    starts, ends, axes, steps = [*slice_node.inputs[1:], None, None][:4] if slice_node is not None else [None] * 4
    if (_ints(starts), _ints(ends), _ints(steps) if steps is not None else [1]) != ([0], [-1], [1]) or not _last_axis(
        _ints(axes)
    ):
        return fail("the probabilities are sliced otherwise than [..., :-1] (dropping the sink's column)")
    if bound.get("sink_form") == "shifted":
        reduce = bound["row_max"].producer()
        if (
            reduce is None
            or reduce.attributes.get_int("keepdims", 1) != 1
            or not _last_axis(_ints(bound.get("max_axes")))
        ):
            return fail("the concatenated logits are shifted by something other than their row max")
    wide: ir.Value = bound["sink_wide"]
    expand = producer(wide, "Expand")
    if expand is None or wide.shape is None or len(wide.shape) != 4 or wide.shape[-1] != 1:
        return fail("the logits concatenated to the scores are not one column, an Expand of per-head sinks")
    return _per_head(expand.inputs[0], ((1, -1, 1, 1), (-1, 1, 1)), n_heads, dtype)


def gate_sink(bound: dict[str, Any], n_heads: int, dtype: ir.DataType | None) -> ir.Value | MatchResult:
    """The gate form (module docstring): the sinks, or why not."""
    lse, gate = bound["lse"].producer(), bound["gate"].producer()
    if lse is None or lse.attributes.get_int("keepdims", 1) != 0 or not _last_axis(_ints(bound.get("lse_axes"))):
        return fail("the attention output is gated by a log-sum-exp of the scores over other axes than the keys'")
    if gate is None or not _last_axis(_ints(bound.get("gate_axes"))):
        return fail("the attention output's gate is not unsqueezed on the last axis")
    return _per_head(bound["sink_lse"], ((1, -1, 1), (-1, 1)), n_heads, dtype)
