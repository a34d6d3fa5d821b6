"""Pattern: each layer's attention core as the tracer writes it, ending at the Reshape o_proj reads.

The traced attention of both families (the native decoder's hand-written one and Hugging Face's
eager one) has one shape between the q/k/v heads and o_proj::

    present.i.key/value = Concat(past, k / v)     (prefill: k / v themselves)
    scores = MatMul(q, Transpose(repeat_kv(present.key))) [* scale | / scale]
    scores = tanh(scores / cap) * cap             (soft-capping, Gemma 2/3; optional)
    scores = Where(allowed, scores, min) | scores + mask   [then a no-op Cast]
    out = Reshape(Transpose(MatMul(Softmax(scores) [Cast], repeat_kv(present.value))))   -> o_proj

and, with ``sinks=True``, the attention sinks of gpt-oss, Flint and Granite-SWA in either of
transformers' two forms (``sinks``: concatenated to the scores and sliced off the probabilities,
or gating the output by a sigmoid of the scores' log-sum-exp); ``AttentionCore.sink`` holds them.

``AttentionCoreRule`` is that pattern (onnxscript's rewriter; either operand order of its Mul and
Add) and a check naming why a near miss is not one; it only matches. Both targets rewrite what it
finds: ``--target ort``'s ``targets/ort/gqa.py`` into ONNX Runtime's GroupQueryAttention (and its
``targets/ort/rotary.py`` then fuses the rotary on the flattened q and k), ``--target onnx``'s
``targets/onnx/cache.py`` into ONNX's Attention over a static cache. q/k/v are matched as heads
``[B, N, S, hd]`` whatever computes them (rotary, per-head norms).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, pattern

from kiln.exporter.passes.ir_utils import producer, scalar_of
from kiln.exporter.patterns.heads import Bias, projection_of
from kiln.exporter.patterns.rotary import find_rotary
from kiln.exporter.patterns.rules import fail, rule_of
from kiln.exporter.patterns.sinks import concat_sink, gate_sink

__all__ = ["AttentionCore", "AttentionCoreRule", "find_attention"]

_PRESENT = re.compile(r"^present\.(\d+)\.(key|value)$")


@dataclasses.dataclass
class AttentionCore:
    """One layer's attention as found in the traced graph."""

    layer: int
    q: ir.Value  # heads [B, N, S, hd] as the scores read them (rotated, normed, ...)
    k: ir.Value  # the new keys' heads (before the Concat with the past)
    v: ir.Value
    n_heads: int
    past_key: ir.Value | None
    past_value: ir.Value | None
    present_key: ir.Value
    present_value: ir.Value
    bias: Bias
    scale: float
    softcap: float | None  # Gemma 2's cap * tanh(scores / cap) on the scaled scores, before the mask
    out: ir.Value  # what o_proj reads: Reshape(Transpose(attention)), usually [B, S, H*hd]
    out_shape: ir.Value | None  # that Reshape's shape input (GPT-2 reshapes to 2-D [B*S, H*hd])
    rotary: tuple[ir.Value, ir.Value] | None = None  # find_attention: q's rotary (cos, sin), when rotate-half
    sink: ir.Value | None = None  # attention sinks (``sinks``): one logit per query head, N values


def _width(heads: ir.Value) -> int | None:
    """N*hd of the packed ``[B, S, N*hd]`` form of heads ``[B, N, S, hd]``: the projection's last
    dim when there is one (None unless it is 3-D), else from the heads' static dims."""
    direct = projection_of(heads)
    if direct is not None:
        dims = list(direct.shape) if direct.shape is not None else []
        return dims[-1] if len(dims) == 3 and isinstance(dims[-1], int) else None
    dims = list(heads.shape) if heads.shape is not None else []
    return dims[1] * dims[3] if len(dims) == 4 and isinstance(dims[1], int) and isinstance(dims[3], int) else None


def _present_source(start: ir.Value | None, expect: str) -> tuple[int, ir.Value] | None:
    """Walk back from a repeated K/V ([B, H, T, hd]) through repeat_kv to ``present.i.<expect>``."""
    seen, value = 0, start
    while value is not None and seen < 8:
        match = _PRESENT.match(value.name or "")
        if match and match.group(2) == expect and value.is_graph_output():
            return int(match.group(1)), value
        twin = _twin_cast(value)
        if twin is not None:  # an --fp16 prefill: repeat_kv reads its own Cast of the fp32 keys the present casts too
            value = twin
            continue
        node = producer(value, ("Reshape", "Expand", "Unsqueeze"))
        if node is None:
            return None
        value = node.inputs[0]
        seen += 1
    return None


def _twin_cast(value: ir.Value) -> ir.Value | None:
    """When ``value = Cast(x)`` and another Cast of ``x`` to the same type is a graph output
    (the fp16 pass casts an fp32 island's output once per reader), that output."""
    node = producer(value, "Cast")
    source = node.inputs[0] if node is not None else None
    if node is None or source is None:
        return None
    to = node.attributes.get_int("to", 0)
    for use in source.uses():
        other = use.node
        if (
            other is not node
            and other.op_type == "Cast"
            and other.attributes.get_int("to", 0) == to
            and other.outputs[0].is_graph_output()
        ):
            return other.outputs[0]
    return None


def _split_present(present: ir.Value) -> tuple[ir.Value | None, ir.Value]:
    """present = Concat(past input, new, axis=2) -> (past, new); prefill: (None, present)."""
    concat = producer(present, "Concat")
    if concat is not None and len(concat.inputs) == 2 and concat.attributes.get_int("axis", 0) in (2, -2):
        past, new = concat.inputs
        if past is not None and new is not None and past.is_graph_input():
            return past, new
    return None, present


def _or(values: list[Any], tag: str, tags: list[Any] | None = None) -> Any:
    return pattern.OrValue(values, tag_var=tag, tag_values=tags)


def _read_once(value: ir.Value | None) -> bool:
    return value is not None and len(list(value.uses())) == 1 and not value.is_graph_output()


class AttentionCoreRule(RewriteRuleClassBase):
    """The attention core (module docstring); ``check`` leaves what it found in ``self.core``.
    This class only matches (``find_attention``); ``targets.ort.gqa.GroupQueryAttention`` rewrites."""

    def __init__(
        self, head_dim: int, name: str = "AttentionCore", *, softmax_island: bool = False, sinks: bool = False
    ) -> None:
        super().__init__(name, remove_nodes=False)  # the presents are graph outputs: rewired, not matched away
        self.head_dim = head_dim
        self.softmax_island = (
            softmax_island  # also match fp16 scores whose softmax runs in fp32 (an --fp16 graph's island)
        )
        self.sinks = sinks  # also match a core with attention sinks (``sinks``): only for a rewrite that carries them
        self.core: AttentionCore | None = None

    def pattern(
        self,
        op: Any,
        q: Any,
        key: Any,
        value: Any,
        scale: Any,
        cap: Any,
        cap_div: Any,
        cond: Any,
        fill: Any,
        mask: Any,
        out_shape: Any,
        sink_wide: Any,
        max_axes: Any,
        slice_starts: Any,
        slice_ends: Any,
        lse_axes: Any,
        sink_lse: Any,
        gate_axes: Any,
    ) -> Any:
        # a Mul or Add of a computed value and a variable, in either order, is an OrValue of both
        # (a Mul of two variables could not be told apart: then ``commute`` makes two rules);
        # every OrValue has a tag: onnxscript 0.7's commute() cannot copy one without
        scores = op.MatMul(q, op.Transpose(key, perm=[0, 1, 3, 2]))
        scaled = _or(
            [op.Mul(scores, scale), op.Mul(scale, scores), op.Div(scores, scale), scores],
            "scale_op",
            ["Mul", "Mul", "Div", None],
        )
        tanh = op.Tanh(
            _or(
                [op.Div(scaled, cap_div), op.Mul(scaled, cap_div), op.Mul(cap_div, scaled)],
                "cap_op",
                ["Div", "Mul", "Mul"],
            )
        )
        capped = _or([op.Mul(tanh, cap), op.Mul(cap, tanh), scaled], "capped", [True, True, False])
        where = [op.Where(cond, capped, fill), op.Where(cond, fill, capped)]
        masked = _or(
            [*where, op.Add(capped, mask), op.Add(mask, capped)], "mask_kind", ["where", "where_inv", "add", "add"]
        )
        # attention sinks (``sinks``), concatenated: Softmax(Concat(masked, sinks) [- row max])[..., :-1]
        joined = op.Concat(masked, sink_wide, _outputs=["joined"])
        shifted = op.Sub(joined, op.ReduceMax(joined, max_axes, _outputs=["row_max"]))
        logits = _or([shifted, joined, masked], "sink_form", ["shifted", "concat", None])
        probs = op.Softmax(_or([op.Cast(logits, _outputs=["cast_in"]), logits], "cast_before"), _outputs=["probs"])
        kept = _or(
            [op.Slice(probs, slice_starts, slice_ends, _allow_other_inputs=True, _outputs=["kept"]), probs],
            "sink_slice",
            [True, False],
        )
        pv = op.MatMul(_or([op.Cast(kept, _outputs=["probs_cast"]), kept], "cast_after"), value, _outputs=["pv"])
        # attention sinks as a gate: pv * Unsqueeze(Sigmoid(ReduceLogSumExp(masked) - sinks))
        lse = op.ReduceLogSumExp(masked, lse_axes, _outputs=["lse"])
        gate = op.Unsqueeze(op.Sigmoid(op.Sub(lse, sink_lse)), gate_axes, _outputs=["gate"])
        gated = _or([op.Mul(pv, gate), op.Mul(gate, pv), pv], "sink_gate", [True, True, False])
        return op.Reshape(op.Transpose(gated, perm=[0, 2, 1, 3], _outputs=["pv_bsnh"]), out_shape, _outputs=["out"])

    def check(self, op: Any, *_: Any, **bound: Any) -> MatchResult:  # op: the MatchContext (the base class names it so)
        self.core = None
        scored = _scores(bound)
        if isinstance(scored, MatchResult):
            return scored
        readers = _readers(bound, self.softmax_island)
        if readers is not None:
            return readers
        caches = _presents(bound["key"], bound["value"])
        if isinstance(caches, MatchResult):
            return caches
        (layer, present_key, past_key, new_key), (present_value, past_value, new_value) = caches
        q: ir.Value = bound["q"]
        if any(h.producer() is None for h in (q, new_key, new_value)):
            return fail("the query, key or value heads are graph inputs (nothing to flatten for GroupQueryAttention)")
        width = _width(q)
        if width is None or width % self.head_dim:
            return fail(
                f"the query is not [B, N, S, {self.head_dim}] heads of a static N, packed [B, S, "
                f"N*{self.head_dim}] (width {width})"
            )
        if _width(new_key) is None or _width(new_value) is None:
            return fail(
                "the new keys or values are not heads [B, N, S, hd] of a static N whose packed form is [B, S, N*hd]"
            )
        scale, softcap, bias = scored
        sink = self._sink(bound, width // self.head_dim, q.dtype)
        if isinstance(sink, MatchResult):
            return sink
        self.core = AttentionCore(
            layer,
            q,
            new_key,
            new_value,
            width // self.head_dim,
            past_key,
            past_value,
            present_key,
            present_value,
            bias,
            scale,
            softcap,
            bound["out"],
            bound["out_shape"],
            sink=sink,
        )
        return MatchResult()

    def _sink(self, bound: dict[str, Any], n_heads: int, dtype: ir.DataType | None) -> ir.Value | MatchResult | None:
        """The core's attention sinks (``sinks``), None without, or why they are not matched."""
        if not bound.get("sink_form") and not bound.get("sink_gate"):
            return (
                fail("the probabilities are sliced, but the scores have no attention sinks concatenated")
                if bound.get("sink_slice")
                else None
            )
        if not self.sinks:
            return fail(
                "the softmax has attention sinks (a learned logit per head in its denominator), which this "
                "rewrite does not carry"
            )
        if bound.get("sink_form") and bound.get("sink_gate"):
            return fail("attention sinks both concatenated to the scores and gating the output")
        return concat_sink(bound, n_heads, dtype) if bound.get("sink_form") else gate_sink(bound, n_heads, dtype)

    def rewrite(self, op: Any, **_: Any) -> Any:
        return None  # matching only: see targets.ort.gqa.GroupQueryAttention


def _scores(bound: dict[str, Any]) -> MatchResult | tuple[float, float | None, Bias]:
    """The scale, soft cap and bias of the matched scores, or why they do not fit."""
    scale = 1.0
    if bound.get("scale_op") is not None:
        c = scalar_of(bound["scale"])
        if c is None or c == 0.0:
            return fail("the scores are scaled by something other than a nonzero constant")
        scale = c if bound["scale_op"] == "Mul" else 1.0 / c
    softcap = None
    if bound.get("capped"):
        cap, divisor = scalar_of(bound["cap"]), scalar_of(bound["cap_div"])
        if cap is None or cap <= 0.0 or divisor is None or divisor == 0.0:
            return fail("the soft cap is not a positive constant")
        if not np.isclose(divisor if bound["cap_op"] == "Div" else 1.0 / divisor, cap, rtol=1e-6, atol=0.0):
            return fail(
                f"tanh(scores / {divisor}) * {cap}: the soft cap divides by another constant than it multiplies by"
            )
        softcap = cap
    kind = bound["mask_kind"]
    if kind == "add":
        return scale, softcap, ("add", bound["mask"], None)
    fill = scalar_of(bound["fill"])
    if fill is None:
        return fail("the masked scores are filled with something other than a constant")
    return scale, softcap, (kind, bound["cond"], fill)


def _island(source: ir.Value | None, cast: ir.Value, bound: dict[str, Any]) -> bool:
    """fp16 scores -> fp32 softmax -> probabilities cast back to fp16 (the fp16 pass's island)."""
    back = bound.get("probs_cast")
    return (
        source is not None
        and (source.dtype, cast.dtype) == (ir.DataType.FLOAT16, ir.DataType.FLOAT)
        and back is not None
        and back.dtype == ir.DataType.FLOAT16
    )


def _readers(bound: dict[str, Any], softmax_island: bool = False) -> MatchResult | None:
    """Why the core's intermediate values cannot be replaced (a reader outside it), or None;
    ``softmax_island``: an fp16 core whose softmax runs in fp32 is one too."""
    cast = bound.get("cast_in")
    if cast is not None:
        node = cast.producer()
        source = node.inputs[0] if node is not None else None
        if source is None or (source.dtype != cast.dtype and not (softmax_island and _island(source, cast, bound))):
            return fail("the scores are cast to another type before the softmax")
    if not all(_read_once(bound[name]) for name in ("probs", "probs_cast", "kept") if bound.get(name) is not None):
        return fail("the attention probabilities are read by more than the value MatMul")
    if not _read_once(bound["pv"]) or not _read_once(bound["pv_bsnh"]):
        return fail("the attention output is read by more than its Transpose and Reshape")
    return None


def _presents(
    key: ir.Value, value: ir.Value
) -> MatchResult | tuple[tuple[int, ir.Value, ir.Value | None, ir.Value], tuple[ir.Value, ir.Value | None, ir.Value]]:
    """The layer's present.i.key behind the keys and present.i.value behind the values, each
    split into (past, new)."""
    got_key, got_value = _present_source(key, "key"), _present_source(value, "value")
    if got_key is None:
        return fail("the keys are not a present.i.key graph output (through repeat_kv)")
    if got_value is None or got_value[0] != got_key[0]:
        return fail(f"the values are not present.{got_key[0]}.value (through repeat_kv)")
    past_key, new_key = _split_present(got_key[1])
    past_value, new_value = _split_present(got_value[1])
    if (past_key is None) != (past_value is None):
        return fail("one of present.key and present.value is a Concat with its past, the other not")
    return (got_key[0], got_key[1], past_key, new_key), (got_value[1], past_value, new_value)


def find_attention(model: ir.Model, head_dim: int, *, softmax_island: bool = False) -> list[AttentionCore]:
    """Every layer's attention core that the pass can replace, in layer order (nothing rewritten);
    ``rotary`` holds q's rotate-half (cos, sin) when it has one. A core with attention sinks is not
    one (``--target onnx``'s ``Attention`` has no sink input)."""
    finder = AttentionCoreRule(head_dim, softmax_island=softmax_island)
    cores: dict[int, AttentionCore] = {}
    rule = rule_of(finder)
    for node in model.graph:
        if (
            node.op_type == "Reshape"
            and rule.match(model, model.graph, node, check_nodes_are_removable=False)
            and finder.core is not None
        ):
            found = find_rotary(model, finder.core.q)
            cores.setdefault(
                finder.core.layer,
                dataclasses.replace(finder.core, rotary=(found.cos, found.sin) if not isinstance(found, str) else None),
            )
    return [cores[layer] for layer in sorted(cores)]
