"""Rule: the rotary on the q and k that GroupQueryAttention reads -> ``com.microsoft.RotaryEmbedding``.

The rotary is the traced "rotate half" one ``patterns.rotary`` finds. The rule,
``RotaryEmbeddingRule``, fires only where the attention rule flattened a rotated q or k for a
GroupQueryAttention (``Reshape(Transpose(rotated))``): it writes ``RotaryEmbedding`` on the
packed ``[B, S, N*hd]`` projection with the graph's own ``position_ids`` and cos/sin tables
evaluated from the graph (``patterns.rotary_tables``; ``rotary_embedding_dim = d`` when partial). A
rotary whose tables cannot be evaluated per position (longrope past its switch), or not in this
form (interleaved: GPT-J, Cohere), stays in the graph, GroupQueryAttention reading it flattened.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase

from kiln.exporter.passes.ir_utils import MS_DOMAIN
from kiln.exporter.patterns.heads import flatten_heads
from kiln.exporter.patterns.rotary import Rotary, RotaryFinder
from kiln.exporter.patterns.rules import fail, where
from kiln.exporter.targets.ort.graph_values import GraphValues

__all__ = ["RotaryEmbeddingRule", "rotary_candidates", "rotary_label"]


class RotaryEmbeddingRule(RewriteRuleClassBase):
    """A flattened, rotated q or k read by GroupQueryAttention -> RotaryEmbedding of the projection."""

    def __init__(self, values: GraphValues) -> None:
        super().__init__("RotaryEmbedding", remove_nodes=False)
        self.values = values
        self._finder = RotaryFinder()
        self._found: tuple[Rotary, tuple[ir.Value, ir.Value], ir.Node, int] | None = None

    def pattern(self, op: Any, rotated: Any, shape: Any) -> Any:
        return op.Reshape(op.Transpose(rotated, perm=[0, 2, 1, 3]), shape, _outputs=["flat"])

    def check(self, op: Any, *_: Any, **bound: Any) -> MatchResult:  # op: the MatchContext (the base class names it so)
        self._found = None
        rotated, shape, flat = bound["rotated"], bound["shape"], bound["flat"]
        readers = [
            (u.node, u.idx)
            for u in flat.uses()
            if u.node.op_type == "GroupQueryAttention" and u.node.domain == MS_DOMAIN and u.idx in (0, 1)
        ]
        if shape.const_value is None or shape.const_value.numpy().tolist() != [0, 0, -1] or len(readers) != 1:
            return fail("not a flattened q or k read by GroupQueryAttention")
        found = self._finder.find(op.model, rotated)
        if isinstance(found, str):
            return fail(found)
        caches = self.values.caches(found.cos, found.sin)
        if caches is None:
            return fail(
                "its cos/sin tables cannot be evaluated per position (they read more than position_ids, or a row "
                "depends on the call's other positions)"
            )
        self._found = (found, caches, *readers[0])
        return MatchResult()

    def rewrite(self, op: Any, **_: Any) -> ir.Value:
        assert self._found is not None
        rotary, caches, gqa, index = self._found
        heads = gqa.attributes.get_int("num_heads" if index == 0 else "kv_num_heads", 0)
        attrs: dict[str, int] = {"num_heads": heads, "interleaved": 0}
        if rotary.dim is not None:
            attrs["rotary_embedding_dim"] = rotary.dim
        name = f"{(gqa.name or '').rsplit('/ort/', 1)[0]}/ort/RotaryEmbedding_{'qk'[index]}"
        packed = flatten_heads(op, rotary.x)
        value: ir.Value = op.RotaryEmbedding(
            packed, self.values.position_ids, *caches, **attrs, _domain=MS_DOMAIN, _name=name
        )
        return value


def _reader(flat: ir.Node) -> tuple[ir.Node, int] | None:
    """The GroupQueryAttention reading a flattened q (input 0) or k (input 1)."""
    uses = [
        (u.node, u.idx)
        for u in flat.outputs[0].uses()
        if u.node.op_type == "GroupQueryAttention" and u.node.domain == MS_DOMAIN and u.idx in (0, 1)
    ]
    return uses[0] if len(uses) == 1 else None


def rotary_label(flat: ir.Node) -> str:
    """ "layer i q" (or k) for a flattened q or k."""
    reader = _reader(flat)
    return f"{where(reader[0])} {'qk'[reader[1]]}" if reader is not None else where(flat)


def rotary_candidates(model: ir.Model) -> list[ir.Node]:
    """The flattened q and k GroupQueryAttention still reads (their rotary, if any, not fused)."""
    return [
        n
        for n in model.graph
        if n.op_type == "Reshape" and (n.name or "").startswith("/ort/heads/") and _reader(n) is not None
    ]
