"""Pattern: each layer's attention core as the tracer writes it, found from its Softmax.

The traced attention of both families (the native decoder's hand-written one and Hugging Face's
eager one) has one shape between the q/k/v projections and o_proj::

    q/k/v = Transpose(Reshape(proj))              [B, N, S, hd]
    q, k  = q*cos + rotate_half(q)*sin            (rotary, optional)
    present.i.key/value = Concat(past, k / v)     (prefill: k / v themselves)
    scores = MatMul(q, Transpose(repeat_kv(present.key))) * scale
    scores = Where(allowed, scores, min) | scores + mask
    out = Reshape(Transpose(MatMul(Softmax(scores), repeat_kv(present.value))))   -> o_proj

``find_attention`` matches it semantically (producers and consumers, not node names) into an
``AttentionCore``; ``gqa`` replaces each core found by ONNX Runtime's fused kernels.
"""


from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np
import onnx_ir as ir
from kiln.exporter.passes.ir_utils import (
    producer,
    scalar_of,
    single_consumer,
    skip_casts,
)

__all__ = ["AttentionCore", "TableFn", "find_attention"]

_PRESENT = re.compile(r"^present\.(\d+)\.(key|value)$")

_Bias = tuple[str, ir.Value, float | None]  # ("add", mask, None) | ("where", cond, fill) | ("where_inv", cond, fill)
# (cos value, sin value) -> (cos_cache, sin_cache) [max_positions, hd/2], or None when the
# tables cannot be evaluated (the subgraph reads more than position_ids)
TableFn = Callable[[ir.Value, ir.Value], tuple[np.ndarray, np.ndarray] | None]


@dataclasses.dataclass
class _Rotary:
    packed: ir.Value  # [B, S, N*hd], before Reshape/Transpose
    cos: ir.Value
    sin: ir.Value


@dataclasses.dataclass
class AttentionCore:
    """One layer's attention as found in the traced graph."""

    layer: int
    q: ir.Value  # packed [B, S, H*hd] projection (before rotary)
    k: ir.Value
    v: ir.Value
    n_heads: int
    rotary: tuple[ir.Value, ir.Value] | None  # the graph's (cos, sin) values
    past_key: ir.Value | None
    past_value: ir.Value | None
    present_key: ir.Value
    present_value: ir.Value
    bias: _Bias
    scale: float
    out: ir.Value  # what o_proj reads: Reshape(Transpose(attention)), usually [B, S, H*hd]
    out_shape: ir.Value | None  # that Reshape's shape input (GPT-2 reshapes to 2-D [B*S, H*hd])


def _unpack(value: ir.Value) -> ir.Value | None:
    """``Transpose(Reshape(x), [0, 2, 1, 3])`` -> x (the packed [B, S, N*hd] projection)."""
    transpose = producer(value, "Transpose")
    if transpose is None or list(transpose.attributes.get_ints("perm", [])) != [0, 2, 1, 3]:
        return None
    reshape = producer(transpose.inputs[0], "Reshape")
    return reshape.inputs[0] if reshape is not None else None


def _rotary(value: ir.Value) -> _Rotary | None:
    """``x*cos + rotate_half(x)*sin`` with x = Transpose(Reshape(packed)) -> its parts."""
    add = producer(value, "Add")
    if add is None:
        return None
    for a, b in (add.inputs, add.inputs[::-1]):
        direct, rotated = producer(a, "Mul"), producer(b, "Mul")
        if direct is None or rotated is None:
            continue
        for x, cos in (direct.inputs, direct.inputs[::-1]):
            packed = _unpack(x) if x is not None else None
            if packed is None:
                continue
            for half, sin in (rotated.inputs, rotated.inputs[::-1]):
                concat = producer(half, "Concat")
                if concat is None or len(concat.inputs) != 2:
                    continue
                neg = producer(concat.inputs[0], "Neg")
                first = concat.inputs[1].producer() if concat.inputs[1] is not None else None
                second = neg.inputs[0].producer() if neg is not None and neg.inputs[0] is not None else None
                if first is None or second is None or first.inputs[0] is not x or second.inputs[0] is not x or cos is None or sin is None:
                    continue
                return _Rotary(packed, cos, sin)
    return None


def _present_source(start: ir.Value | None, expect: str) -> tuple[int, ir.Value] | None:
    """Walk back from a repeated K/V ([B, H, T, hd]) through repeat_kv to ``present.i.<expect>``."""
    seen, value = 0, start
    while value is not None and seen < 8:
        match = _PRESENT.match(value.name or "")
        if match and match.group(2) == expect and value.is_graph_output():
            return int(match.group(1)), value
        node = producer(value, ("Reshape", "Expand", "Unsqueeze"))
        if node is None:
            return None
        value = node.inputs[0]
        seen += 1
    return None


def _split_present(present: ir.Value) -> tuple[ir.Value | None, ir.Value]:
    """present = Concat(past input, new, axis=2) -> (past, new); prefill: (None, present)."""
    concat = producer(present, "Concat")
    if concat is not None and len(concat.inputs) == 2 and concat.attributes.get_int("axis", 0) in (2, -2):
        past, new = concat.inputs
        if past is not None and new is not None and past.is_graph_input():
            return past, new
    return None, present


def _scores(value: ir.Value) -> tuple[ir.Node, float] | None:
    """scores = MatMul(q, kT) [* c | / c] -> (the MatMul, the scale)."""
    node = value.producer()
    if node is not None and node.op_type in ("Mul", "Div") and node.domain == "":
        for i, (a, b) in enumerate((node.inputs, node.inputs[::-1])):
            if node.op_type == "Div" and i == 1:
                break
            c = scalar_of(b)
            matmul = producer(a, "MatMul")
            if c is not None and matmul is not None and c != 0.0:
                return matmul, (c if node.op_type == "Mul" else 1.0 / c)
        return None
    matmul = producer(value, "MatMul")
    return (matmul, 1.0) if matmul is not None else None


def _masked_scores(softmax: ir.Node) -> tuple[tuple[ir.Node, float], _Bias] | None:
    """Softmax(Where(allowed, scores, fill)) or Softmax(scores + mask) -> ((QK^T MatMul, scale), bias)."""
    if softmax.inputs[0] is None:
        return None
    mnode = skip_casts(softmax.inputs[0]).producer()
    if mnode is None or mnode.domain != "":
        return None
    if mnode.op_type == "Where":
        cond, a, b = mnode.inputs
        for scores, fill, kind in ((a, b, "where"), (b, a, "where_inv")):
            fill_value = scalar_of(fill)
            got = _scores(scores) if scores is not None else None
            if got is not None and fill_value is not None and cond is not None:
                return got, (kind, cond, fill_value)
    elif mnode.op_type == "Add":
        for scores, mask in (mnode.inputs, mnode.inputs[::-1]):
            got = _scores(scores) if scores is not None else None
            if got is not None and mask is not None:
                return got, ("add", mask, None)
    return None


def _caches(qk: ir.Node, softmax: ir.Node) -> tuple[tuple[int, ir.Value], tuple[int, ir.Value], ir.Node] | None:
    """The layer's ``present.i.key`` behind QK^T, its ``present.i.value`` behind PV, and the
    Reshape that turns PV back into [B, S, H*hd] for o_proj."""
    kt = producer(qk.inputs[1], "Transpose")
    if kt is None or list(kt.attributes.get_ints("perm", [])) != [0, 1, 3, 2]:
        return None
    key = _present_source(kt.inputs[0], "key")
    uses = list(softmax.outputs[0].uses())
    pv = uses[0].node if len(uses) == 1 else None
    while pv is not None and pv.op_type == "Cast":
        pv = single_consumer(pv.outputs[0], "MatMul") or single_consumer(pv.outputs[0], "Cast")
    if key is None or pv is None or pv.op_type != "MatMul" or pv.inputs[0] is None:
        return None
    value = _present_source(pv.inputs[1], "value")
    transpose = single_consumer(pv.outputs[0], "Transpose")
    reshape = single_consumer(transpose.outputs[0], "Reshape") if transpose is not None else None
    if value is None or value[0] != key[0] or transpose is None or reshape is None or list(transpose.attributes.get_ints("perm", [])) != [0, 2, 1, 3]:
        return None
    return key, value, reshape


def _projections(q_in: ir.Value, new_key: ir.Value, new_value: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value, tuple[ir.Value, ir.Value] | None] | None:
    """The packed q/k/v projections [B, S, N*hd] behind the (rotated) heads, and the rotary's cos/sin."""
    q_rot, k_rot = _rotary(q_in), _rotary(new_key)
    if (q_rot is None) != (k_rot is None):
        return None
    rotary: tuple[ir.Value, ir.Value] | None = None
    q: ir.Value | None
    k: ir.Value | None
    if q_rot is not None and k_rot is not None:
        if (q_rot.cos, q_rot.sin) != (k_rot.cos, k_rot.sin):
            return None
        q, k, rotary = q_rot.packed, k_rot.packed, (q_rot.cos, q_rot.sin)
    else:
        q, k = _unpack(q_in), _unpack(new_key)
    v = _unpack(new_value)
    if q is None or k is None or v is None:
        return None
    return q, k, v, rotary


def _core(softmax: ir.Node, head_dim: int) -> AttentionCore | None:
    scored = _masked_scores(softmax)
    if scored is None:
        return None
    (qk, scale), bias = scored
    caches = _caches(qk, softmax)
    if caches is None:
        return None
    key, value, reshape = caches
    past_key, new_key = _split_present(key[1])
    past_value, new_value = _split_present(value[1])
    q_in = qk.inputs[0]
    projections = _projections(q_in, new_key, new_value) if q_in is not None and (past_key is None) == (past_value is None) else None
    if projections is None:
        return None
    q, k, v, rotary = projections
    hidden = q.shape[-1] if q.shape is not None and len(q.shape) == 3 else None
    if not isinstance(hidden, int) or hidden % head_dim:
        return None
    return AttentionCore(
        layer=key[0],
        q=q,
        k=k,
        v=v,
        n_heads=hidden // head_dim,
        rotary=rotary,
        past_key=past_key,
        past_value=past_value,
        present_key=key[1],
        present_value=value[1],
        bias=bias,
        scale=scale,
        out=reshape.outputs[0],
        out_shape=reshape.inputs[1],
    )


def find_attention(model: ir.Model, head_dim: int) -> list[AttentionCore]:
    """Every layer's attention core that the pass can replace, in layer order."""
    cores = [_core(node, head_dim) for node in model.graph if node.op_type == "Softmax" and node.domain == ""]
    return sorted((c for c in cores if c is not None), key=lambda c: c.layer)
