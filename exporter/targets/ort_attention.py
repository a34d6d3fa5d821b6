"""Pass: each layer's attention core -> com.microsoft RotaryEmbedding x2 + GroupQueryAttention.

The traced attention of both families (the native decoder's hand-written one and Hugging Face's
eager one) has one shape between the q/k/v projections and o_proj::

    q/k/v = Transpose(Reshape(proj))              [B, N, S, hd]
    q, k  = q*cos + rotate_half(q)*sin            (rotary, optional)
    present.i.key/value = Concat(past, k / v)     (prefill: k / v themselves)
    scores = MatMul(q, Transpose(repeat_kv(present.key))) * scale
    scores = Where(allowed, scores, min) | scores + mask
    out = Reshape(Transpose(MatMul(Softmax(scores), repeat_kv(present.value))))   -> o_proj

The pass finds it from each Softmax, semantically (producers and consumers, not node names),
and replaces it by ONNX Runtime's fused CPU kernels, keeping the I/O contract:

- rotary: ``RotaryEmbedding`` on the packed projections with the graph's own ``position_ids``
  and cos/sin tables obtained by evaluating the graph's own cos/sin subgraph at every position
  (``rotary_tables``), so a family's theta or scaling needs no formula here;
- attention: ``GroupQueryAttention`` with ``past_present_share_buffer`` off (past
  [B, kv, P, hd] -> present [B, kv, P+S, hd], exactly the contract), ``seqlens_k = total - 1``
  for every row and ``total_sequence_length`` from ``attention_mask``, the graph's own mask as
  ``attention_bias``. Every row is thus "full length" to GQA, so its present is exactly
  concat(past, new), and which keys a query sees is decided by the family's own mask alone
  (causality, left padding, and what a fully masked padding query does: Hugging Face's mask
  gives such a row a uniform softmax over every key, which GQA's own causal rule would not
  reproduce). So prefill sets ``causal=0``. The decode graph keeps GQA's default ``causal=1``:
  its one query per row sits at position total-1, where the causal rule admits every key, so
  the result is the same, and ONNX Runtime 1.32's CPU kernel is much slower with ``causal=0``
  (GQA took 2.04 ms of a 4.7 ms decode step at past 2048 on the 33M anchor, 1.69 ms with
  ``causal=1``; see docs/benchmarks.md, run H). GQA's seqlens-based padding assumes right
  padding, which kiln's batches are not, so it is not used.

Not fused (left portable, still correct): a graph where GQA's CPU kernel refuses the shapes the
contract allows. ONNX Runtime 1.32's CPU GQA rejects ``sequence_length > 1`` with a non-empty
past when ``batch > 1`` ("batch_size must be 1 when sequence_length > 1 and past context is
given"), which is exactly what model.onnx must serve (chunked prefill of a batch), so the caller
does not fuse the unified graph. GQA's own rotary (``do_rotary``) is not used either: in ORT 1.32
it needs head_dim % 16 == 0 and its first-prompt ``present_key`` is not the rotated key.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from kiln.exporter.targets.graph_utils import MS_DOMAIN, constant, copy_type, producer, scalar_of, single_consumer, skip_casts, use_ms_domain
from kiln.exporter.targets.ort_pack import pack_matmuls, packable

__all__ = ["AttentionCore", "fuse_attention", "find_attention"]

_PRESENT = re.compile(r"^present\.(\d+)\.(key|value)$")

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
    bias: tuple[str, ir.Value, float | None]  # ("add", mask, None) | ("where", cond, fill) | ("where_inv", cond, fill)
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
                if first is None or second is None or first.inputs[0] is not x or second.inputs[0] is not x:
                    continue
                return _Rotary(packed, cos, sin)  # type: ignore[arg-type]
    return None


def _present_source(value: ir.Value, expect: str) -> tuple[int, ir.Value] | None:
    """Walk back from a repeated K/V ([B, H, T, hd]) through repeat_kv to ``present.i.<expect>``."""
    seen = 0
    while value is not None and seen < 8:
        match = _PRESENT.match(value.name or "")
        if match and match.group(2) == expect and value.is_graph_output():
            return int(match.group(1)), value
        node = producer(value, ("Reshape", "Expand", "Unsqueeze"))
        if node is None:
            return None
        value = node.inputs[0]  # type: ignore[assignment]
        seen += 1
    return None


def _split_present(present: ir.Value) -> tuple[ir.Value | None, ir.Value]:
    """present = Concat(past input, new, axis=2) -> (past, new); prefill: (None, present)."""
    concat = producer(present, "Concat")
    if concat is not None and len(concat.inputs) == 2 and concat.attributes.get_int("axis", 0) in (2, -2):
        past, new = concat.inputs
        if past is not None and past.is_graph_input():
            return past, new  # type: ignore[return-value]
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


def _core(softmax: ir.Node, head_dim: int) -> AttentionCore | None:
    masked = skip_casts(softmax.inputs[0])  # type: ignore[arg-type]
    mnode = masked.producer()
    if mnode is None or mnode.domain != "":
        return None
    found: tuple[tuple[ir.Node, float], tuple[str, ir.Value, float | None]] | None = None
    if mnode.op_type == "Where":
        cond, a, b = mnode.inputs
        for scores, fill, kind in ((a, b, "where"), (b, a, "where_inv")):
            fill_value = scalar_of(fill)
            got = _scores(scores) if scores is not None else None
            if got is not None and fill_value is not None and cond is not None:
                found = (got, (kind, cond, fill_value))
                break
    elif mnode.op_type == "Add":
        for scores, mask in (mnode.inputs, mnode.inputs[::-1]):
            got = _scores(scores) if scores is not None else None
            if got is not None and mask is not None:
                found = (got, ("add", mask, None))
                break
    if found is None:
        return None
    (qk, scale), bias = found
    kt = producer(qk.inputs[1], "Transpose")
    if kt is None or list(kt.attributes.get_ints("perm", [])) != [0, 1, 3, 2]:
        return None
    key = _present_source(kt.inputs[0], "key")  # type: ignore[arg-type]
    probs = softmax.outputs[0]
    uses = list(probs.uses())
    pv = uses[0].node if len(uses) == 1 else None
    while pv is not None and pv.op_type == "Cast":
        pv = single_consumer(pv.outputs[0], "MatMul") or single_consumer(pv.outputs[0], "Cast")
    if key is None or pv is None or pv.op_type != "MatMul" or pv.inputs[0] is None:
        return None
    value = _present_source(pv.inputs[1], "value")  # type: ignore[arg-type]
    transpose = single_consumer(pv.outputs[0], "Transpose")
    reshape = single_consumer(transpose.outputs[0], "Reshape") if transpose is not None else None
    if value is None or value[0] != key[0] or reshape is None or list(transpose.attributes.get_ints("perm", [])) != [0, 2, 1, 3]:  # type: ignore[union-attr]
        return None
    layer = key[0]
    past_key, new_key = _split_present(key[1])
    past_value, new_value = _split_present(value[1])
    if (past_key is None) != (past_value is None):
        return None
    q_rot, k_rot = _rotary(qk.inputs[0]), _rotary(new_key)  # type: ignore[arg-type]
    if (q_rot is None) != (k_rot is None):
        return None
    if q_rot is not None and k_rot is not None:
        if (q_rot.cos, q_rot.sin) != (k_rot.cos, k_rot.sin):
            return None
        q: ir.Value | None = q_rot.packed
        k: ir.Value | None = k_rot.packed
        rotary: tuple[ir.Value, ir.Value] | None = (q_rot.cos, q_rot.sin)
    else:
        q, k, rotary = _unpack(qk.inputs[0]), _unpack(new_key), None  # type: ignore[arg-type]
    v = _unpack(new_value)
    if q is None or k is None or v is None:
        return None
    hidden = q.shape[-1] if q.shape is not None and len(q.shape) == 3 else None
    if not isinstance(hidden, int) or hidden % head_dim:
        return None
    return AttentionCore(
        layer=layer,
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


class _Shared:
    """Per-graph values every layer's GQA reads: seqlens_k, total length, biases, cos/sin caches."""

    def __init__(self, graph: ir.Graph, tables: TableFn) -> None:
        self.graph = graph
        self._tables = tables
        self._nodes: list[ir.Node] = []
        self._bias: dict[tuple[str, int], ir.Value] = {}
        self._caches: dict[tuple[int, int], tuple[ir.Value, ir.Value] | None] = {}
        self._cache_ids: dict[bytes, tuple[ir.Value, ir.Value]] = {}
        inputs = {v.name: v for v in graph.inputs}
        self.position_ids = inputs["position_ids"]
        shape = self._node("Shape", [inputs["attention_mask"]])
        total = self._node("Gather", [shape, constant(graph, "ort/one_i64", np.array(1, dtype=np.int64))], {"axis": 0})
        self.total = self._node("Cast", [total], {"to": ir.DataType.INT32})
        batch = self._node("Slice", [shape, constant(graph, "ort/zero_1d", np.array([0], dtype=np.int64)), constant(graph, "ort/one_1d", np.array([1], dtype=np.int64))])
        last = self._node("Sub", [self.total, constant(graph, "ort/one_i32", np.array(1, dtype=np.int32))])
        self.seqlens_k = self._node("Expand", [last, batch])  # [B] int32: every row "full length"

    def _node(self, op: str, inputs: list[ir.Value | None], attributes: dict | None = None, domain: str = "", outputs: int = 1) -> ir.Value:
        node = ir.node(op, inputs, attributes, domain=domain, num_outputs=outputs, name=f"/ort/{op}_{len(self._nodes)}")
        self._nodes.append(node)
        return node.outputs[0]

    def node(self, op: str, inputs: list[ir.Value | None], attributes: dict, domain: str, outputs: int, name: str) -> ir.Node:
        node = ir.node(op, inputs, attributes, domain=domain, num_outputs=outputs, name=name)
        self._nodes.append(node)
        return node

    def bias(self, core: AttentionCore) -> ir.Value:
        kind, source, fill = core.bias
        key = (kind, id(source))
        if key not in self._bias:
            if kind == "add":
                self._bias[key] = source
            else:
                zero = constant(self.graph, "ort/zero_f32", np.array(0.0, dtype=np.float32))
                masked = constant(self.graph, f"ort/mask_fill_{len(self._bias)}", np.array(fill, dtype=np.float32))
                pair = [zero, masked] if kind == "where" else [masked, zero]
                self._bias[key] = self._node("Where", [source, *pair])
        return self._bias[key]

    def caches(self, cos: ir.Value, sin: ir.Value) -> tuple[ir.Value, ir.Value] | None:
        key = (id(cos), id(sin))
        if key not in self._caches:
            tables = self._tables(cos, sin)
            if tables is None:
                self._caches[key] = None
            else:
                digest = tables[0].tobytes() + tables[1].tobytes()
                if digest not in self._cache_ids:
                    k = len(self._cache_ids)
                    self._cache_ids[digest] = (
                        constant(self.graph, f"ort/rotary.{k}.cos_cache", tables[0]),
                        constant(self.graph, f"ort/rotary.{k}.sin_cache", tables[1]),
                    )
                self._caches[key] = self._cache_ids[digest]
        return self._caches[key]

    def commit(self) -> None:
        self.graph.extend(self._nodes)


def _packed_qkv(shared: _Shared, core: AttentionCore) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """q, k, v = MatMul(x, Wq|Wk|Wv) with constant weights and no bias -> one MatMul on the
    concatenated weight and a Split (``ort_pack``), in q, k, v order, which is the packed QKV
    layout GroupQueryAttention reads (what ONNX Runtime GenAI's builder writes too)."""
    matmuls = [producer(value, "MatMul") for value in (core.q, core.k, core.v)]
    if any(m is None for m in matmuls) or not packable(matmuls):  # type: ignore[arg-type]
        return None
    q, k, v = pack_matmuls(shared.graph, matmuls, f"layers.{core.layer}.attn.qkv_proj")  # type: ignore[arg-type]
    return q, k, v


def fuse_attention(model: ir.Model, *, n_kv_heads: int, head_dim: int, tables: TableFn, decode: bool = False) -> list[int]:
    """Replace every matched attention core; returns the fused layers. Unmatched layers (and
    layers whose rotary tables cannot be evaluated) stay as they were.

    ``decode`` (the decode graph: one query per row, seq 1): GQA keeps its default ``causal=1``
    (the same result for a last-position query, and the fast CPU path), and it is fed the packed
    QKV and rotates it itself (``do_rotary`` with ``position_ids``), saving the Split and two
    RotaryEmbedding kernels per layer. ONNX Runtime 1.32 returns an unrotated ``present_key``
    when it rotates a first prompt (past empty), and needs head_dim % 16 == 0, so prefill and
    other head sizes keep RotaryEmbedding."""
    graph = model.graph
    cores = find_attention(model, head_dim)
    if not cores:
        return []
    shared = _Shared(graph, tables)
    fused: list[int] = []
    outputs = list(graph.outputs)
    for core in cores:
        caches = shared.caches(*core.rotary) if core.rotary is not None else None
        if core.rotary is not None and caches is None:
            continue
        packed_qkv = _packed_qkv(shared, core)
        q: ir.Value | None
        k: ir.Value | None
        v: ir.Value | None
        q, k, v = packed_qkv or (core.q, core.k, core.v)
        cos_sin: list[ir.Value | None] = [None, None, None]
        attrs = {"num_heads": core.n_heads, "kv_num_heads": n_kv_heads, "scale": float(core.scale)}
        if not decode:
            attrs["causal"] = 0  # the family's mask alone decides (module docstring)
        if decode and packed_qkv is not None and caches is not None and head_dim % 16 == 0:
            # one packed QKV input, rotary inside GQA at the caller's position_ids (its Split
            # above is left dead and removed)
            q, k, v = q.producer().inputs[0], None, None  # type: ignore[union-attr]  # the packed MatMul output
            cos_sin = [caches[0], caches[1], shared.position_ids]
            attrs.update(do_rotary=1, rotary_interleaved=0)
        elif caches is not None:
            rotated = []
            for which, packed, heads in (("q", q, core.n_heads), ("k", k, n_kv_heads)):
                node = shared.node(
                    "RotaryEmbedding",
                    [packed, shared.position_ids, *caches],
                    {"num_heads": heads, "interleaved": 0},
                    MS_DOMAIN,
                    1,
                    f"/layers.{core.layer}.attn/ort/RotaryEmbedding_{which}",
                )
                rotated.append(node.outputs[0])
            q, k = rotated
        gqa = shared.node(
            "GroupQueryAttention",
            [q, k, v, core.past_key, core.past_value, shared.seqlens_k, shared.total, *cos_sin, shared.bias(core)],
            attrs,
            MS_DOMAIN,
            3,
            f"/layers.{core.layer}.attn/ort/GroupQueryAttention",
        )
        out, present_key, present_value = gqa.outputs
        if core.out.shape is None or len(core.out.shape) != 3:
            # GQA's [B, S, H*hd] has the element order of the Reshape's input, so the same
            # Reshape gives what o_proj reads (GPT-2's 2-D Gemm input)
            out = shared.node("Reshape", [out, core.out_shape], {}, "", 1, f"/layers.{core.layer}.attn/ort/Reshape").outputs[0]
        copy_type(out, core.out)
        core.out.replace_all_uses_with(out)
        for old, new in ((core.present_key, present_key), (core.present_value, present_value)):
            name = old.name
            old.name = f"{name}.unfused"
            new.name = name
            copy_type(new, old)
            outputs[outputs.index(old)] = new
        fused.append(core.layer)
    shared.commit()
    graph.outputs.clear()
    graph.outputs.extend(outputs)
    use_ms_domain(model)
    return fused
