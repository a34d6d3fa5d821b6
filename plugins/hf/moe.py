"""Mixture-of-experts layers as the ONNX exporter sees them.

transformers' default expert kernel (``experts_implementation="grouped_mm"``, the same values as
its own eager loop) sorts each (token, expert) pair by expert and multiplies each expert's rows
by its weight; under torch.export with float32 weights it calls its custom op
``transformers::grouped_mm_fallback(input [S, K], weight [E, K, N], offs [E]) -> [S, N]``, where
``offs`` holds each expert's cumulative end row. torch.onnx has no translation for it, so the
family gives one (``TRANSLATIONS``, passed to ``torch.onnx.export`` as its
``custom_translation_table``): per expert, its rows (a Slice with data-dependent bounds) times its
weight, concatenated in expert order. That is the active-expert compute only (top-k of E
experts per token), with no copy of any expert's weight.

The rows per expert come from ``torch.histc`` of the expert ids, which transformers casts to
float on a CPU and to int32 elsewhere; kiln traces a template on the meta device, so it meets the
int32 form, which torch.onnx's own histc refuses: ``_histc`` counts any dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["translations"]


def _grouped_mm(input: Any, weight: Any, offs: Any) -> Any:
    """Rows ``offs[e-1] .. offs[e]`` of ``input`` times ``weight[e]``, for every expert e."""
    from onnxscript.onnx_opset import opset18

    op: Any = opset18  # onnxscript's op stubs type every input by its ONNX type; these are traced values

    experts = weight.shape[0]
    if not isinstance(experts, int):
        raise TypeError("grouped_mm_fallback: the number of experts (weight.shape[0]) must be a static int")
    ends = op.Cast(offs, to=7)  # int64 [E]
    zero = op.Constant(value_ints=[0])
    axis = op.Constant(value_ints=[0])
    blocks, start = [], zero
    for e in range(experts):
        end = op.Slice(ends, op.Constant(value_ints=[e]), op.Constant(value_ints=[e + 1]))  # [1]
        rows = op.Slice(input, start, end, axis)  # [n_e, K]
        blocks.append(op.MatMul(rows, op.Gather(weight, op.Constant(value_int=e), axis=0)))  # [n_e, N]
        start = end
    return op.Concat(*blocks, axis=0)  # [S, N]


def _histc(input: Any, bins: int = 100, min: float = 0.0, max: float = 0.0) -> Any:
    """``torch.histc``: element x counts in bin ``floor((x - min) * bins / (max - min))`` (x == max:
    the last bin; outside [min, max]: none), the counts in the input's dtype."""
    from onnxscript.onnx_opset import opset18

    op: Any = opset18  # onnxscript's op stubs type every input by its ONNX type; these are traced values

    if max <= min:
        raise ValueError("histc: kiln translates only an explicit range (max > min)")
    x = op.Cast(op.Reshape(input, op.Constant(value_ints=[-1, 1])), to=1)  # float [n, 1]
    index = op.Floor(
        op.Mul(op.Sub(x, op.Constant(value_float=float(min))), op.Constant(value_float=bins / (max - min)))
    )
    index = op.Min(index, op.Constant(value_float=float(bins - 1)))
    inside = op.And(
        op.GreaterOrEqual(x, op.Constant(value_float=float(min))),
        op.LessOrEqual(x, op.Constant(value_float=float(max))),
    )
    edges = op.Cast(
        op.Range(op.Constant(value_int=0), op.Constant(value_int=bins), op.Constant(value_int=1)), to=1
    )  # [bins]
    hits = op.Cast(op.And(op.Equal(index, edges), inside), to=1)  # [n, bins]
    return op.CastLike(op.ReduceSum(hits, op.Constant(value_ints=[0]), keepdims=0), input)


def translations() -> Mapping[Callable[..., Any], Callable[..., Any]]:
    """The translations of transformers' custom ops that kiln's graphs may meet (empty when this
    transformers has none)."""
    import torch
    import transformers.integrations.moe  # noqa: F401  # registers torch.ops.transformers.*

    ops = getattr(torch.ops, "transformers", None)
    fallback = getattr(ops, "grouped_mm_fallback", None) if ops is not None else None
    table: dict[Callable[..., Any], Callable[..., Any]] = {torch.ops.aten.histc.default: _histc}
    if fallback is not None:
        table[fallback.default] = _grouped_mm
    return table
