"""Rule: the rotary on the q and k that GroupQueryAttention reads -> ``com.microsoft.RotaryEmbedding``.

The traced rotary of the heads ``x`` ``[B, N, S, hd]`` ("rotate half", halves by Split or two
Slices)::

    x*cos + rotate_half(x)*sin                        rotate_half(x) = Concat(-x[..., d/2:], x[..., :d/2])
    Concat(rotate(x[..., :d]), x[..., d:])            partial rotary: the first d channels (Phi, StableLM)

``RotateHalf`` is that pattern (matched, never rewritten by itself: ``find_rotary``). The rule,
``RotaryEmbeddingRule``, fires only where the attention rule flattened a rotated q or k for a
GroupQueryAttention (``Reshape(Transpose(rotated))``): it writes ``RotaryEmbedding`` on the
packed ``[B, S, N*hd]`` projection with the graph's own ``position_ids`` and cos/sin tables
evaluated from the graph (``rotary_tables``; ``rotary_embedding_dim = d`` when partial). A
rotary whose tables cannot be evaluated per position (longrope past its switch), or not in this
form (interleaved: GPT-J, Cohere), stays in the graph, GroupQueryAttention reading it flattened.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx_ir as ir
from kiln.exporter.passes.ir_utils import MS_DOMAIN, producer, scalar_of
from kiln.exporter.targets.ort.heads import flatten_heads
from kiln.exporter.targets.ort.graph_values import GraphValues
from kiln.exporter.targets.ort.rules import fail, first_match, rule_of, where
from onnxscript.rewriter import MatchResult, RewriteRule, RewriteRuleClassBase, RewriteRuleSet

__all__ = ["Rotary", "RotaryEmbeddingRule", "RotateHalf", "find_rotary", "rotary_candidates", "rotary_label", "same_value"]


@dataclasses.dataclass(frozen=True)
class Rotary:
    """A rotary found on heads: what it rotates, the graph's cos/sin, the rotated width."""

    x: ir.Value  # the heads [B, N, S, hd] before the rotary
    cos: ir.Value
    sin: ir.Value
    dim: int | None  # rotated channels per head when partial (None: the whole head)


def same_value(a: ir.Value | None, b: ir.Value | None, depth: int = 4) -> bool:
    """The same value, or one computed by identical nodes from the same inputs (the tracer may
    write a transpose twice)."""
    if a is b:
        return True
    na, nb = (a.producer() if a is not None else None), (b.producer() if b is not None else None)
    if depth == 0 or na is None or nb is None or (na.op_type, na.domain, len(na.inputs)) != (nb.op_type, nb.domain, len(nb.inputs)):
        return False
    same_attrs = {k: repr(v.value) for k, v in na.attributes.items()} == {k: repr(v.value) for k, v in nb.attributes.items()}
    return same_attrs and all(same_value(x, y, depth - 1) for x, y in zip(na.inputs, nb.inputs, strict=True))


def _slice(value: ir.Value | None) -> tuple[int, int] | None:
    """``Slice(x, [start], [end], [-1 | 3], [1])`` -> (start, end); None when not one."""
    node = producer(value, "Slice")
    if node is None or len(node.inputs) < 4:
        return None
    start, end, axis = (scalar_of(node.inputs[i]) for i in (1, 2, 3))
    step = scalar_of(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else 1.0
    if start is None or end is None or axis not in (-1.0, 3.0) or step != 1.0:
        return None
    return int(start), int(min(end, 2**62))


def _halves(split: bool, first: ir.Value, second: ir.Value, width: int | None) -> bool:
    """The two halves of rotate_half: x[..., :w/2] and x[..., w/2:] of the last axis."""
    if split:
        node = first.producer()
        sizes = node.inputs[1] if node is not None and len(node.inputs) > 1 else None
        equal = sizes is None or (sizes.const_value is not None and len(set(sizes.const_value.numpy().tolist())) == 1)
        return node is not None and len(node.outputs) == 2 and node.attributes.get_int("axis", 0) in (-1, 3) and equal
    a, b = _slice(first), _slice(second)
    if a is None or b is None or a[0] != 0 or a[1] != b[0]:
        return False
    return width is None or (2 * a[1] == width and b[1] >= width)


class RotateHalf(RewriteRuleClassBase):
    """``x*cos + rotate_half(x)*sin`` (``partial``: ``Concat(that of x[..., :d], x[..., d:])``),
    the halves by Split or by two Slices; ``check`` leaves the ``Rotary`` in ``self.found``."""

    def __init__(self, *, split: bool, partial: bool) -> None:
        super().__init__(f"RotateHalf{'Split' if split else 'Slice'}{'Partial' if partial else ''}", remove_nodes=False)
        self.split, self.partial = split, partial
        self.found: Rotary | None = None

    def pattern(self, op: Any, x: Any, x_a: Any, x_b: Any, cos: Any, sin: Any, x_rest: Any) -> Any:
        rotated = op.Slice(x, _allow_other_inputs=True, _outputs=["part"]) if self.partial else x
        if self.split:
            first, second = op.Split(x_a, _allow_other_inputs=True, _outputs=["first", "second"])
        else:
            first = op.Slice(x_a, _allow_other_inputs=True, _outputs=["first"])
            second = op.Slice(x_b, _allow_other_inputs=True, _outputs=["second"])
        half = op.Concat(op.Neg(second), first, _outputs=["half"])
        out = op.Add(op.Mul(rotated, cos), op.Mul(half, sin))
        return op.Concat(out, op.Slice(x_rest, _allow_other_inputs=True, _outputs=["rest"]), _outputs=["joined"]) if self.partial else out

    def check(self, op: Any, *_: Any, **bound: Any) -> MatchResult:  # op: the MatchContext (the base class names it so)
        self.found = None
        x, x_a, cos, sin = bound["x"], bound["x_a"], bound["cos"], bound["sin"]
        first, second, half = bound["first"], bound["second"], bound["half"]
        rotated: ir.Value = bound["part"] if self.partial else x
        concats = [half.producer(), *([bound["joined"].producer()] if self.partial else [])]
        if any(c is None or c.attributes.get_int("axis", 0) not in (-1, 3) for c in concats):
            return fail("rotate_half does not concatenate along the last axis")
        if not same_value(x_a, rotated) or (not self.split and not same_value(bound["x_b"], rotated)):
            return fail("rotate_half's halves are not taken from the rotated tensor")
        dim = None
        if self.partial:
            part, rest = _slice(rotated), _slice(bound["rest"])
            if part is None or rest is None or part[0] != 0 or rest[0] != part[1] or part[1] % 2 or not same_value(bound["x_rest"], x):
                return fail("partial rotary: not Concat(rotate(x[..., :d]), x[..., d:]) of one x")
            dim = part[1]
        last = rotated.shape[-1] if rotated.shape is not None else None
        if not _halves(self.split, first, second, dim if dim is not None else last if isinstance(last, int) else None):
            return fail("rotate_half's halves are not the two halves of the last axis")
        self.found = Rotary(x, cos, sin, dim)
        return MatchResult()

    def rewrite(self, op: Any, **_: Any) -> Any:
        return None  # matching only: RotaryEmbeddingRule rewrites


class _Finder:
    """The rotate-half patterns in every form (commuted Add/Mul operands included)."""

    def __init__(self) -> None:
        self.patterns = [RotateHalf(split=s, partial=p) for p in (False, True) for s in (True, False)]
        self.rules: list[tuple[RotateHalf, RewriteRule]] = [(f, r) for f in self.patterns for r in RewriteRuleSet([rule_of(f)], commute=True)]

    def find(self, model: ir.Model, value: ir.Value) -> Rotary | str:
        node = value.producer()
        if node is None:
            return "the heads are a graph input"
        got = first_match(model, [r for _, r in self.rules], node)
        if isinstance(got, str):
            return f"not a rotate-half rotary ({got})"
        return next(f.found for f, r in self.rules if r is got and f.found is not None)


def find_rotary(model: ir.Model, value: ir.Value) -> Rotary | str:
    """The rotate-half rotary that computes ``value``, or why it is not one."""
    return _Finder().find(model, value)


class RotaryEmbeddingRule(RewriteRuleClassBase):
    """A flattened, rotated q or k read by GroupQueryAttention -> RotaryEmbedding of the projection."""

    def __init__(self, values: GraphValues) -> None:
        super().__init__("RotaryEmbedding", remove_nodes=False)
        self.values = values
        self._finder = _Finder()
        self._found: tuple[Rotary, tuple[ir.Value, ir.Value], ir.Node, int] | None = None

    def pattern(self, op: Any, rotated: Any, shape: Any) -> Any:
        return op.Reshape(op.Transpose(rotated, perm=[0, 2, 1, 3]), shape, _outputs=["flat"])

    def check(self, op: Any, *_: Any, **bound: Any) -> MatchResult:  # op: the MatchContext (the base class names it so)
        self._found = None
        rotated, shape, flat = bound["rotated"], bound["shape"], bound["flat"]
        readers = [(u.node, u.idx) for u in flat.uses() if u.node.op_type == "GroupQueryAttention" and u.node.domain == MS_DOMAIN and u.idx in (0, 1)]
        if shape.const_value is None or shape.const_value.numpy().tolist() != [0, 0, -1] or len(readers) != 1:
            return fail("not a flattened q or k read by GroupQueryAttention")
        found = self._finder.find(op.model, rotated)
        if isinstance(found, str):
            return fail(found)
        caches = self.values.caches(found.cos, found.sin)
        if caches is None:
            return fail("its cos/sin tables cannot be evaluated per position (they read more than position_ids, or a row depends on the call's other positions)")
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
        return op.RotaryEmbedding(packed, self.values.position_ids, *caches, **attrs, _domain=MS_DOMAIN, _name=name)  # type: ignore[no-any-return]


def _reader(flat: ir.Node) -> tuple[ir.Node, int] | None:
    """The GroupQueryAttention reading a flattened q (input 0) or k (input 1)."""
    uses = [(u.node, u.idx) for u in flat.outputs[0].uses() if u.node.op_type == "GroupQueryAttention" and u.node.domain == MS_DOMAIN and u.idx in (0, 1)]
    return uses[0] if len(uses) == 1 else None


def rotary_label(flat: ir.Node) -> str:
    """"layer i q" (or k) for a flattened q or k."""
    reader = _reader(flat)
    return f"{where(reader[0])} {'qk'[reader[1]]}" if reader is not None else where(flat)


def rotary_candidates(model: ir.Model) -> list[ir.Node]:
    """The flattened q and k GroupQueryAttention still reads (their rotary, if any, not fused)."""
    return [n for n in model.graph if n.op_type == "Reshape" and (n.name or "").startswith("/ort/heads/") and _reader(n) is not None]

