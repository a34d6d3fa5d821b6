"""Rule (decode graphs): GroupQueryAttention rotates the packed QKV itself.

``GQA(RotaryEmbedding(q), RotaryEmbedding(k), v)`` with q, k, v the Split of one packed QKV
MatMul -> ``GQA(packed, do_rotary=1, cos_cache, sin_cache, position_ids)``, saving the Split
and the two RotaryEmbedding kernels per layer. Decode only: ONNX Runtime 1.32 returns an
unrotated ``present_key`` when it rotates a first prompt (past empty). It needs head_dim % 16
== 0 and rotates whole heads (no partial rotary).
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase

from kiln.exporter.passes.ir_utils import MS_DOMAIN
from kiln.exporter.patterns.rules import NotFused, apply_rules, explain, fail, rule_of

__all__ = ["RotaryInGroupQueryAttention", "fuse_rotary_in_gqa"]


class RotaryInGroupQueryAttention(RewriteRuleClassBase):
    """GQA of the RotaryEmbedding'd Split of a packed QKV -> GQA of the packed QKV, do_rotary=1."""

    def __init__(self, head_dim: int) -> None:
        super().__init__("RotaryInGroupQueryAttention")
        self.head_dim = head_dim

    def pattern(
        self,
        op: Any,
        packed: Any,
        sizes: Any,
        position_ids: Any,
        cos: Any,
        sin: Any,
        past_key: Any,
        past_value: Any,
        seqlens_k: Any,
        total: Any,
        bias: Any,
    ) -> Any:
        q, k, v = op.Split(packed, sizes, _outputs=["q", "k", "v"])
        rotated = [
            op.RotaryEmbedding(x, position_ids, cos, sin, _domain=MS_DOMAIN, _outputs=[f"r{name}"])
            for x, name in ((q, "q"), (k, "k"))
        ]
        inputs = [*rotated, v, past_key, past_value, seqlens_k, total, None, None, None, bias]
        # other inputs after the bias (head_sink: attention sinks) are carried as they are
        return op.GroupQueryAttention(
            *inputs, _domain=MS_DOMAIN, _allow_other_inputs=True, _outputs=["out", "present_key", "present_value"]
        )

    def check(self, op: Any, *_: Any, **bound: Any) -> MatchResult:  # op: the MatchContext (the base class names it so)
        if self.head_dim % 16:
            return fail(f"head_dim {self.head_dim} is not a multiple of 16 (GroupQueryAttention's own rotary needs it)")
        for value in (bound["rq"], bound["rk"]):
            node = value.producer()
            if (
                node is None
                or "rotary_embedding_dim" in node.attributes
                or node.attributes.get_int("interleaved", 0) != 0
            ):
                return fail(
                    "partial or interleaved rotary (GroupQueryAttention's own rotary turns whole heads, half by half)"
                )
        return MatchResult()

    def rewrite(
        self,
        op: Any,
        packed: ir.Value,
        position_ids: ir.Value,
        cos: ir.Value,
        sin: ir.Value,
        out: ir.Value,
        **bound: Any,
    ) -> Any:
        gqa = out.producer()
        assert gqa is not None
        attrs = {**{name: attr for name, attr in gqa.attributes.items()}, "do_rotary": 1, "rotary_interleaved": 0}
        lengths = (bound["past_key"], bound["past_value"], bound["seqlens_k"], bound["total"])
        inputs = [packed, None, None, *lengths, cos, sin, position_ids, bound["bias"], *gqa.inputs[11:]]
        return op.GroupQueryAttention(*inputs, **attrs, _domain=MS_DOMAIN, _outputs=3, _name=gqa.name)


def fuse_rotary_in_gqa(model: ir.Model, *, head_dim: int, not_fused: NotFused | None = None) -> int:
    """Let every GroupQueryAttention of a decode graph that reads a rotated packed QKV rotate it
    itself; returns how many. ``not_fused`` gets why the others keep their RotaryEmbedding
    (fusion ``gqa_rotary``)."""
    rules = [rule_of(RotaryInGroupQueryAttention(head_dim))]
    count = apply_rules(model, rules)
    if not_fused is not None:
        left = [n for n in model.graph if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN and _rotated(n)]
        not_fused.add(
            "gqa_rotary",
            explain(
                model,
                rules,
                left,
                otherwise=lambda _: "its q, k and v are not the Split of one packed QKV, q and k rotated alike",
            ),
        )
    return count


def _rotated(gqa: ir.Node) -> bool:
    """GQA reads a RotaryEmbedding of a Split: a packed, rotated QKV (``gqa.qkv_pack`` says why
    the others are not packed)."""
    node = gqa.inputs[0].producer() if gqa.inputs[0] is not None else None
    source = (
        node.inputs[0].producer()
        if node is not None and node.op_type == "RotaryEmbedding" and node.inputs[0] is not None
        else None
    )
    return source is not None and source.op_type == "Split"
