"""Rule: each layer's attention core (``patterns.attention.AttentionCoreRule``) -> com.microsoft
GroupQueryAttention, keeping the I/O contract; then RotaryEmbedding on its q and k (``rotary``),
its q/k/v projections packed, and at decode GQA's own rotary (``gqa_rotary``):

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
- rotary: ``RotaryEmbedding`` on the packed projections with the graph's own ``position_ids``
  and cos/sin tables obtained by evaluating the graph's own cos/sin subgraph at every position
  (``patterns.rotary_tables``), so a family's theta or scaling needs no formula here.
- q, k, v = MatMul(x, Wq|Wk|Wv) with constant weights and no bias -> one MatMul on the
  concatenated weight and a Split (``pack``), in q, k, v order, the packed QKV layout
  GroupQueryAttention reads (what ONNX Runtime GenAI's builder writes too). Hand-written: it
  reads the weights, and any of q/k/v may sit behind a RotaryEmbedding.

Not fused (left portable, still correct): a graph where GQA's CPU kernel refuses the shapes the
contract allows. ONNX Runtime 1.32's CPU GQA rejects ``sequence_length > 1`` with a non-empty
past when ``batch > 1`` ("batch_size must be 1 when sequence_length > 1 and past context is
given"), which is exactly what model.onnx must serve (chunked prefill of a batch), so the caller
does not fuse the unified graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from kiln.exporter.contract.io import is_cross
from kiln.exporter.passes.ir_utils import MS_DOMAIN, constant, copy_type, producer, use_ms_domain
from kiln.exporter.patterns.attention import AttentionCore, AttentionCoreRule
from kiln.exporter.patterns.heads import flatten_heads
from kiln.exporter.patterns.rotary_tables import TableFn
from kiln.exporter.patterns.rules import NotFused, apply_rules, explain, fail, rule_of, where
from kiln.exporter.targets.ort.gqa_rotary import fuse_rotary_in_gqa
from kiln.exporter.targets.ort.graph_values import GraphValues
from kiln.exporter.targets.ort.lora import SlotDelta, carry_deltas, slot_delta
from kiln.exporter.targets.ort.pack import pack_matmuls, packable_reason
from kiln.exporter.targets.ort.rotary import RotaryEmbeddingRule, rotary_candidates, rotary_label

__all__ = ["CROSS_ATTENTION", "ENCODER_ATTENTION", "GroupQueryAttention", "fuse_attention", "leave_encoder_attention"]


class GroupQueryAttention(AttentionCoreRule):
    """The attention core -> GroupQueryAttention on the flattened q/k/v heads (module docstring);
    ``fused`` lists the layers it rewrote."""

    def __init__(
        self,
        values: GraphValues,
        *,
        n_kv_heads: int,
        head_dim: int,
        decode: bool,
        other_shapes: Mapping[int, tuple[int, int]] | None = None,
    ) -> None:
        super().__init__(head_dim, "GroupQueryAttention", sinks=True)
        self.values, self.n_kv_heads, self.decode = values, n_kv_heads, decode
        self.other_shapes = dict(other_shapes or {})  # layer -> its cache's (KV heads, head dim) where not the spec's
        self.fused: list[int] = []

    def check(self, op: Any, *args: Any, **bound: Any) -> MatchResult:
        """The core, but not on a layer whose cache has other heads or another width than the spec's
        (Gemma 4's global layers): that layer keeps the portable attention, exact."""
        found = super().check(op, *args, **bound)
        if found and self.core is not None and self.core.layer in self.fused:
            self.core = None  # a layer reading another's cache, whose presents its owner's GQA already returns
            return fail("its keys and values are another layer's, already fused (a layer that reads another's cache)")
        if found and self.core is not None and self.core.layer in self.other_shapes:
            heads, width = self.other_shapes[self.core.layer]
            self.core = None
            return fail(
                f"its cache has {heads} KV heads of {width} (a per-layer shape), not the {self.n_kv_heads} of "
                f"{self.head_dim} this rewrite is built for"
            )
        return found

    def rewrite(self, op: Any, **_: Any) -> ir.Value:
        core = self.core
        assert core is not None
        attrs: dict[str, object] = {
            "num_heads": core.n_heads,
            "kv_num_heads": self.n_kv_heads,
            "scale": float(core.scale),
        }
        if core.softcap is not None:
            attrs["softcap"] = float(core.softcap)
        if not self.decode:
            attrs["causal"] = 0  # the family's mask alone decides (module docstring)
        q, k, v = (flatten_heads(op, heads) for heads in (core.q, core.k, core.v))
        seqlens_k, total = self.values.lengths()
        name = f"/layers.{core.layer}.attn/ort"
        inputs = [
            q,
            k,
            v,
            core.past_key,
            core.past_value,
            seqlens_k,
            total,
            None,
            None,
            None,
            self.values.bias(core.bias),
        ]
        if core.sink is not None:
            inputs.append(_head_sink(op, core.sink, core.n_heads, name))
        out, present_key, present_value = op.GroupQueryAttention(
            *inputs, **attrs, _domain=MS_DOMAIN, _outputs=3, _name=f"{name}/GroupQueryAttention"
        )
        if core.out.shape is None or len(core.out.shape) != 3:
            # GQA's [B, S, H*hd] has the element order of the Reshape's input, so the same
            # Reshape gives what o_proj reads (GPT-2's 2-D Gemm input)
            out = op.Reshape(out, core.out_shape, _name=f"{name}/Reshape")
        _rewire_presents(core, present_key, present_value)
        self.fused.append(core.layer)
        return out  # type: ignore[no-any-return]


def _head_sink(op: Any, sinks: ir.Value, n_heads: int, name: str) -> ir.Value:
    """GQA's ``head_sink`` input, [num_heads] of the queries' type: the sinks as they are when
    1-D (the traced initializer), else reshaped to that."""
    if sinks.shape is not None and len(sinks.shape) == 1:
        return sinks
    graph = sinks.graph
    assert isinstance(graph, ir.Graph), "matched sinks belong to the graph"
    flat: ir.Value = op.Reshape(
        sinks, constant(graph, "ort/head_sink_shape", np.array([n_heads], dtype=np.int64)), _name=f"{name}/head_sink"
    )
    flat.type, flat.shape = sinks.type, ir.Shape([n_heads])
    return flat


def _rewire_presents(core: AttentionCore, present_key: ir.Value, present_value: ir.Value) -> None:
    """GQA's presents become the graph outputs ``present.i.key/value`` (the old ones renamed)."""
    graph = core.present_key.graph
    assert isinstance(graph, ir.Graph)
    for old, new in ((core.present_key, present_key), (core.present_value, present_value)):
        name = old.name
        old.name = f"{name}.unfused"
        new.name = name
        copy_type(new, old)
        graph.outputs[graph.outputs.index(old)] = new


def _unrotated(value: ir.Value | None) -> ir.Value | None:
    """A GQA input behind its RotaryEmbedding when it has one."""
    node = value.producer() if value is not None else None
    if node is not None and node.op_type == "RotaryEmbedding" and node.domain == MS_DOMAIN:
        return node.inputs[0]
    return value


def _maker(value: ir.Value | None) -> str:
    """What computes a GQA input, behind its RotaryEmbedding."""
    source = _unrotated(value)
    node = source.producer() if source is not None else None
    return node.op_type if node is not None else "a graph input"


def _qkv_reason(node: ir.Node, matmuls: list[ir.Node | None], slotted: list[SlotDelta | None]) -> str | None:
    """Why a fused layer's q/k/v projections cannot be packed, or None."""
    if others := [f"{'qkv'[i]} by {_maker(node.inputs[i])}" for i, m in enumerate(matmuls) if m is None]:
        return f"q/k/v are not three MatMuls ({', '.join(others)})"
    if any(slotted) and not all(slotted):
        return "only some of q/k/v carry a LoRA slot"
    return packable_reason([m for m in matmuls if m is not None])


def _pack_qkv(model: ir.Model) -> list[str]:
    """Each fused layer's q/k/v projections -> one packed MatMul + Split (``pack``), their LoRA
    slots' deltas carried into it (``lora.carry_deltas``); "layer i: why" for each layer whose
    projections are not packable."""
    why = []
    for node in [n for n in model.graph if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN]:
        sources = [_unrotated(node.inputs[i]) for i in range(3)]
        slotted = [slot_delta(v) for v in sources]
        matmuls = [s[0] if s is not None else producer(v, "MatMul") for v, s in zip(sources, slotted, strict=True)]
        reason = _qkv_reason(node, matmuls, slotted)
        if reason is not None:
            why.append(f"{where(node)}: q/k/v not packed: {reason}")
            continue
        layer = where(node).removeprefix("layer ")
        outputs = pack_matmuls(model.graph, [m for m in matmuls if m is not None], f"layers.{layer}.attn.qkv_proj")
        if all(slotted):
            carry_deltas(model.graph, outputs, [s for s in slotted if s is not None])
    return why


def _readers(node: ir.Node) -> list[ir.Node]:
    """What reads ``node``'s output, through Casts."""
    found = []
    for use in node.outputs[0].uses():
        found.extend(_readers(use.node) if use.node.op_type == "Cast" else [use.node])
    return found


def _attention_softmax(node: ir.Node) -> bool:
    """A Softmax of 4-D scores, or one read by a MatMul (not a router's, before its TopK)."""
    if node.op_type != "Softmax" or node.domain != "":
        return False
    shape = node.inputs[0].shape if node.inputs[0] is not None else None
    return (shape is not None and len(shape) == 4) or any(r.op_type == "MatMul" for r in _readers(node))


CROSS_ATTENTION = (
    "cross-attention (keys and values from the encoder, computed once by prefill): kept as portable attention, "
    "exact; GroupQueryAttention is the decoder's growing causal self-attention"
)
ENCODER_ATTENTION = (
    "the encoder's bidirectional self-attention (no cache, no position_ids): kept as portable attention, exact"
)
_LAYOUT = ("Transpose", "Reshape", "Cast", "Identity", "Expand", "Unsqueeze")  # and repeat_kv


def _cross_attention(softmax: ir.Node) -> bool:
    """A softmax whose value MatMul reads a cross cache (``contract.io.is_cross``: the decode
    graph's past, or what prefill returns as its present), through layout ops only."""
    for reader in _readers(softmax):
        value = reader.inputs[1] if reader.op_type == "MatMul" and len(reader.inputs) > 1 else None
        while value is not None:
            if value.name is not None and is_cross(value.name) and (value.is_graph_input() or value.is_graph_output()):
                return True
            node = value.producer()
            value = node.inputs[0] if node is not None and node.op_type in _LAYOUT else None
    return False


def _unreached(softmax: ir.Node) -> str:
    readers = ", ".join(sorted({r.op_type for r in _readers(softmax)})) or "nothing"
    scores = softmax.inputs[0].producer() if softmax.inputs[0] is not None else None
    if scores is not None and scores.op_type == "Add" and any(producer(v, "Add") for v in scores.inputs):
        return (
            "its scores take two additive biases (a relative position bias, then the mask), where the core and "
            "GroupQueryAttention take one: kept as portable attention, exact"
        )
    return f"the softmax is read by {readers}, not by a value MatMul -> Transpose -> Reshape (the core's end)"


def leave_encoder_attention(model: ir.Model, *, not_fused: NotFused) -> list[int]:
    """The encoder graph: no layer fused; each attention softmax is reported (``ENCODER_ATTENTION``)."""
    not_fused.add("attention", [f"{where(n)}: {ENCODER_ATTENTION}" for n in model.graph if _attention_softmax(n)])
    return []


def fuse_attention(
    model: ir.Model,
    *,
    n_kv_heads: int,
    head_dim: int,
    tables: TableFn,
    decode: bool = False,
    not_fused: NotFused | None = None,
    other_shapes: Mapping[int, tuple[int, int]] | None = None,
) -> list[int]:
    """Replace every matched attention core; returns the fused layers. Unmatched layers stay as
    they were (``not_fused`` gets "layer i: why", fusion ``attention``); a rotary whose tables
    cannot be evaluated per position stays in the graph, GQA reading q and k rotated (so does
    one not in rotate-half form: fusion ``rotary`` says which).

    ``decode`` (the decode graph: one query per row, seq 1): GQA keeps its default ``causal=1``
    and, where it can, rotates the packed QKV itself (``gqa_rotary``)."""
    values = GraphValues(model.graph, tables)
    attention = GroupQueryAttention(
        values, n_kv_heads=n_kv_heads, head_dim=head_dim, decode=decode, other_shapes=other_shapes
    )
    rules = [rule_of(attention)]
    apply_rules(model, rules)
    log = not_fused if not_fused is not None else NotFused()
    if not_fused is not None:
        left = [n for n in model.graph if _attention_softmax(n)]
        reasons = explain(model, rules, left, otherwise=_unreached)
        crossed = [
            f"{where(n)}: {CROSS_ATTENTION}" if _cross_attention(n) else r for n, r in zip(left, reasons, strict=True)
        ]
        not_fused.add("attention", crossed)
    if not attention.fused:
        return []
    rotary = [rule_of(RotaryEmbeddingRule(values))]
    apply_rules(model, rotary)
    if not_fused is not None:
        not_fused.add("rotary", explain(model, rotary, rotary_candidates(model), label=rotary_label))
    log.add("qkv_pack", _pack_qkv(model))
    if decode:
        fuse_rotary_in_gqa(model, head_dim=head_dim, not_fused=not_fused)
    use_ms_domain(model)
    return sorted(attention.fused)
