"""Pass: each layer's attention core (``attention.find_attention``) -> com.microsoft
RotaryEmbedding x2 + GroupQueryAttention, keeping the I/O contract:

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
does not fuse the unified graph. GQA's own rotary (``do_rotary``) is used at decode only (see
``fuse_attention``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir
from kiln.exporter.passes.ir_utils import (
    MS_DOMAIN,
    constant,
    copy_type,
    producer,
    use_ms_domain,
)
from kiln.exporter.targets.ort.attention import AttentionCore, TableFn, find_attention
from kiln.exporter.targets.ort.pack import pack_matmuls, packable

__all__ = ["fuse_attention"]


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

    def _node(self, op: str, inputs: list[ir.Value | None], attributes: Mapping[str, Any] | None = None, domain: str = "", outputs: int = 1) -> ir.Value:
        node = ir.node(op, inputs, attributes, domain=domain, num_outputs=outputs, name=f"/ort/{op}_{len(self._nodes)}")
        self._nodes.append(node)
        return node.outputs[0]

    def node(self, op: str, inputs: list[ir.Value | None], attributes: Mapping[str, Any], domain: str, outputs: int, name: str) -> ir.Node:
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
    matmuls = [m for m in (producer(value, "MatMul") for value in (core.q, core.k, core.v)) if m is not None]
    if len(matmuls) != 3 or not packable(matmuls):
        return None
    q, k, v = pack_matmuls(shared.graph, matmuls, f"layers.{core.layer}.attn.qkv_proj")
    return q, k, v


def fuse_attention(model: ir.Model, *, n_kv_heads: int, head_dim: int, tables: TableFn, decode: bool = False) -> list[int]:
    """Replace every matched attention core; returns the fused layers. Unmatched layers stay as
    they were; a rotary whose tables cannot be evaluated per position stays in the graph, GQA
    reading q and k rotated (so does one the matcher does not know, interleaved rotary).

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
            if core.rotated is None:
                continue
            # tables that cannot be evaluated per position (longrope past its switch): the
            # graph's own rotary stays, GQA reads q and k rotated
            core = dataclasses.replace(core, q=core.rotated[0], k=core.rotated[1], rotary=None, rotary_dim=None)
        _fuse(shared, core, caches, outputs, n_kv_heads=n_kv_heads, head_dim=head_dim, decode=decode)
        fused.append(core.layer)
    shared.commit()
    graph.outputs.clear()
    graph.outputs.extend(outputs)
    use_ms_domain(model)
    return fused


def _gqa_inputs(
    shared: _Shared, core: AttentionCore, caches: tuple[ir.Value, ir.Value] | None, attrs: dict[str, object], *, n_kv_heads: int, head_dim: int, decode: bool
) -> tuple[ir.Value | None, ir.Value | None, ir.Value | None, list[ir.Value | None]]:
    """GQA's q, k, v and (cos, sin, positions) inputs: the packed QKV rotated inside GQA at
    decode, or q/k each rotated by a ``RotaryEmbedding`` first."""
    packed_qkv = _packed_qkv(shared, core)
    q: ir.Value | None
    k: ir.Value | None
    v: ir.Value | None
    q, k, v = packed_qkv or (core.q, core.k, core.v)
    if decode and packed_qkv is not None and caches is not None and head_dim % 16 == 0 and core.rotary_dim is None:
        # one packed QKV input, rotary inside GQA at the caller's position_ids (its Split
        # above is left dead and removed)
        attrs.update(do_rotary=1, rotary_interleaved=0)
        return q.producer().inputs[0], None, None, [caches[0], caches[1], shared.position_ids]  # type: ignore[union-attr]  # the packed MatMul output
    if caches is not None:
        rotated = []
        for which, packed, heads in (("q", q, core.n_heads), ("k", k, n_kv_heads)):
            node = shared.node(
                "RotaryEmbedding",
                [packed, shared.position_ids, *caches],
                {"num_heads": heads, "interleaved": 0, **({"rotary_embedding_dim": core.rotary_dim} if core.rotary_dim is not None else {})},
                MS_DOMAIN,
                1,
                f"/layers.{core.layer}.attn/ort/RotaryEmbedding_{which}",
            )
            rotated.append(node.outputs[0])
        q, k = rotated
    return q, k, v, [None, None, None]


def _fuse(
    shared: _Shared, core: AttentionCore, caches: tuple[ir.Value, ir.Value] | None, outputs: list[ir.Value], *, n_kv_heads: int, head_dim: int, decode: bool
) -> None:
    """One layer's attention core -> GroupQueryAttention, its outputs rewired (``outputs``: the
    graph outputs, where the presents are replaced)."""
    attrs: dict[str, object] = {"num_heads": core.n_heads, "kv_num_heads": n_kv_heads, "scale": float(core.scale)}
    if core.softcap is not None:
        attrs["softcap"] = float(core.softcap)
    if not decode:
        attrs["causal"] = 0  # the family's mask alone decides (module docstring)
    q, k, v, cos_sin = _gqa_inputs(shared, core, caches, attrs, n_kv_heads=n_kv_heads, head_dim=head_dim, decode=decode)
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
