"""Pattern: each layer's attention core as the tracer writes it, found from its Softmax.

The traced attention of both families (the native decoder's hand-written one and Hugging Face's
eager one) has one shape between the q/k/v projections and o_proj::

    q/k/v = Transpose(heads(Reshape(proj)))       [B, N, S, hd]; heads: per-head ops (q/k norm) or none
    q, k  = q*cos + rotate_half(q)*sin            (rotary, optional; partial: the first rotary_dim
                                                   channels rotated, Concat with the rest)
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
    constant,
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
    dim: int | None  # rotated channels per head when partial (None: the whole head)


@dataclasses.dataclass
class AttentionCore:
    """One layer's attention as found in the traced graph."""

    layer: int
    q: ir.Value  # packed [B, S, H*hd] projection (before rotary)
    k: ir.Value
    v: ir.Value
    n_heads: int
    rotary: tuple[ir.Value, ir.Value] | None  # the graph's (cos, sin) values
    rotary_dim: int | None  # partial rotary: the rotated channels per head (None: all)
    rotated: tuple[ir.Value, ir.Value] | None  # with rotary: q and k packed after it (rotary left in the graph)
    past_key: ir.Value | None
    past_value: ir.Value | None
    present_key: ir.Value
    present_value: ir.Value
    bias: _Bias
    scale: float
    softcap: float | None  # Gemma 2's cap * tanh(scores / cap) on the scaled scores, before the mask
    out: ir.Value  # what o_proj reads: Reshape(Transpose(attention)), usually [B, S, H*hd]
    out_shape: ir.Value | None  # that Reshape's shape input (GPT-2 reshapes to 2-D [B*S, H*hd])


def _unpack(value: ir.Value) -> ir.Value | None:
    """Heads ``x`` [B, N, S, hd] -> their packed [B, S, N*hd] form: the projection itself when
    x = Transpose(Reshape(projection), [0, 2, 1, 3]), else (per-head ops between the projection and
    x, such as a q/k norm, which then stay in the graph before the fused attention) a new
    ``Reshape(Transpose(x, [0, 2, 1, 3]), [0, 0, -1])``, exact for any such x."""
    transpose = producer(value, "Transpose")
    if transpose is not None and list(transpose.attributes.get_ints("perm", [])) == [0, 2, 1, 3]:
        reshape = producer(transpose.inputs[0], "Reshape")
        if reshape is not None:
            return reshape.inputs[0]
    node = value.producer()
    graph = node.graph if node is not None else None
    if graph is None:
        return None
    made: dict[int, ir.Value] = graph.meta.setdefault("kiln.ort.flattened_heads", {})  # one flattening per value
    if id(value) in made:
        return made[id(value)]
    # a match that is not fused leaves these nodes dead (the target's passes remove dead nodes)
    shape = constant(graph, "ort/flatten_heads", np.array([0, 0, -1], dtype=np.int64))
    name = f"/ort/heads/{value.name}"
    bsnh = ir.node("Transpose", [value], {"perm": [0, 2, 1, 3]}, name=f"{name}/Transpose")
    flat = ir.node("Reshape", [bsnh.outputs[0], shape], name=f"{name}/Reshape")
    graph.extend([bsnh, flat])
    out = flat.outputs[0]
    dims = list(value.shape) if value.shape is not None and len(value.shape) == 4 else None
    if dims is not None and isinstance(dims[1], int) and isinstance(dims[3], int):
        out.shape = ir.Shape([dims[0], dims[2], dims[1] * dims[3]])
    out.type = value.type
    made[id(value)] = out
    return out


def _attributes(node: ir.Node) -> dict[str, str]:
    return {k: repr(v.value) for k, v in node.attributes.items()}


def _same(a: ir.Value | None, b: ir.Value | None, depth: int = 4) -> bool:
    """The same value, or one computed by identical nodes from the same inputs (the tracer may
    write a transpose twice)."""
    if a is b:
        return True
    na, nb = (a.producer() if a is not None else None), (b.producer() if b is not None else None)
    if depth == 0 or na is None or nb is None or (na.op_type, na.domain, len(na.inputs)) != (nb.op_type, nb.domain, len(nb.inputs)):
        return False
    return _attributes(na) == _attributes(nb) and all(_same(x, y, depth - 1) for x, y in zip(na.inputs, nb.inputs, strict=True))


def _slice(value: ir.Value | None) -> tuple[ir.Value, int, int] | None:
    """``Slice(x, [start], [end], [-1])`` on the last of 4 axes -> (x, start, end)."""
    node = producer(value, "Slice")
    if node is None or len(node.inputs) < 4 or node.inputs[0] is None:
        return None
    start, end, axis = (scalar_of(node.inputs[i]) for i in (1, 2, 3))
    step = scalar_of(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else 1.0
    if start is None or end is None or axis not in (-1.0, 3.0) or step != 1.0:
        return None
    return node.inputs[0], int(start), int(min(end, 2**62))


def _rotate_half(value: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """``x*cos + rotate_half(x)*sin`` -> (x, cos, sin)."""
    add = producer(value, "Add")
    if add is None:
        return None
    for a, b in (add.inputs, add.inputs[::-1]):
        direct, rotated = producer(a, "Mul"), producer(b, "Mul")
        if direct is None or rotated is None:
            continue
        for x, cos in (direct.inputs, direct.inputs[::-1]):
            for half, sin in (rotated.inputs, rotated.inputs[::-1]):
                concat = producer(half, "Concat")
                if x is None or cos is None or sin is None or concat is None or len(concat.inputs) != 2:
                    continue
                neg = producer(concat.inputs[0], "Neg")
                first = concat.inputs[1].producer() if concat.inputs[1] is not None else None
                second = neg.inputs[0].producer() if neg is not None and neg.inputs[0] is not None else None
                if first is not None and second is not None and _same(first.inputs[0], x) and _same(second.inputs[0], x):
                    return x, cos, sin
    return None


def _rotary(value: ir.Value) -> _Rotary | None:
    """The rotated heads (``_rotate_half`` of x = Transpose(heads)), or partial rotary:
    ``Concat(_rotate_half(x[..., :d]), x[..., d:])`` -> their parts."""
    whole = _rotate_half(value)
    if whole is not None:
        packed = _unpack(whole[0])
        return _Rotary(packed, whole[1], whole[2], None) if packed is not None else None
    concat = producer(value, "Concat")
    if concat is None or len(concat.inputs) != 2 or concat.attributes.get_int("axis", 0) not in (-1, 3) or concat.inputs[0] is None:
        return None
    part = _rotate_half(concat.inputs[0])
    rotated, rest = (_slice(part[0]), _slice(concat.inputs[1])) if part is not None else (None, None)
    if part is None or rotated is None or rest is None or not _same(rotated[0], rest[0]) or rotated[1] != 0 or rest[1] != rotated[2]:
        return None
    packed = _unpack(rotated[0])
    return _Rotary(packed, part[1], part[2], rotated[2]) if packed is not None else None


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


def _capped(value: ir.Value) -> tuple[ir.Node, float, float | None] | None:
    """``_scores`` of value, or of x in Gemma 2's soft-capping ``tanh(x / cap) * cap`` ->
    (the MatMul, the scale, the cap or None)."""
    mul = producer(value, "Mul")
    for tanh_out, cap_value in (mul.inputs, mul.inputs[::-1]) if mul is not None else ():
        cap, tanh = scalar_of(cap_value), producer(tanh_out, "Tanh")
        inner = producer(tanh.inputs[0], ("Div", "Mul")) if tanh is not None else None
        if cap is None or cap <= 0.0 or inner is None or inner.inputs[0] is None:
            continue
        divisor = scalar_of(inner.inputs[1])
        if divisor is None or not np.isclose(divisor if inner.op_type == "Div" else 1.0 / divisor, cap, rtol=1e-6, atol=0.0):
            continue
        got = _scores(inner.inputs[0])
        if got is not None:
            return got[0], got[1], cap
    got = _scores(value)
    return (got[0], got[1], None) if got is not None else None


def _masked_scores(softmax: ir.Node) -> tuple[tuple[ir.Node, float, float | None], _Bias] | None:
    """Softmax(Where(allowed, scores, fill)) or Softmax(scores + mask) -> ((QK^T MatMul, scale,
    soft cap), bias)."""
    if softmax.inputs[0] is None:
        return None
    mnode = skip_casts(softmax.inputs[0]).producer()
    if mnode is None or mnode.domain != "":
        return None
    if mnode.op_type == "Where":
        cond, a, b = mnode.inputs
        for scores, fill, kind in ((a, b, "where"), (b, a, "where_inv")):
            fill_value = scalar_of(fill)
            got = _capped(scores) if scores is not None else None
            if got is not None and fill_value is not None and cond is not None:
                return got, (kind, cond, fill_value)
    elif mnode.op_type == "Add":
        for scores, mask in (mnode.inputs, mnode.inputs[::-1]):
            got = _capped(scores) if scores is not None else None
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


def _projections(q_in: ir.Value, new_key: ir.Value, new_value: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value, _Rotary | None] | None:
    """The packed q/k/v projections [B, S, N*hd] behind the (rotated) heads, and q's rotary
    (cos, sin and width: the same as k's)."""
    q_rot, k_rot = _rotary(q_in), _rotary(new_key)
    if (q_rot is None) != (k_rot is None):
        return None
    rotary: _Rotary | None = None
    q: ir.Value | None
    k: ir.Value | None
    if q_rot is not None and k_rot is not None:
        if (q_rot.cos, q_rot.sin, q_rot.dim) != (k_rot.cos, k_rot.sin, k_rot.dim):
            return None
        q, k, rotary = q_rot.packed, k_rot.packed, q_rot
    else:
        q, k = _unpack(q_in), _unpack(new_key)
    v = _unpack(new_value)
    if q is None or k is None or v is None:
        return None
    return q, k, v, rotary


def _rotated(q_in: ir.Value, new_key: ir.Value) -> tuple[ir.Value, ir.Value] | None:
    q, k = _unpack(q_in), _unpack(new_key)
    return (q, k) if q is not None and k is not None else None


def _core(softmax: ir.Node, head_dim: int) -> AttentionCore | None:
    scored = _masked_scores(softmax)
    if scored is None:
        return None
    (qk, scale, softcap), bias = scored
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
        rotary=(rotary.cos, rotary.sin) if rotary is not None else None,
        rotary_dim=rotary.dim if rotary is not None else None,
        rotated=_rotated(q_in, new_key) if rotary is not None and q_in is not None else None,
        past_key=past_key,
        past_value=past_value,
        present_key=key[1],
        present_value=value[1],
        bias=bias,
        scale=scale,
        softcap=softcap,
        out=reshape.outputs[0],
        out_shape=reshape.inputs[1],
    )


def find_attention(model: ir.Model, head_dim: int) -> list[AttentionCore]:
    """Every layer's attention core that the pass can replace, in layer order."""
    cores = [_core(node, head_dim) for node in model.graph if node.op_type == "Softmax" and node.domain == ""]
    return sorted((c for c in cores if c is not None), key=lambda c: c.layer)
