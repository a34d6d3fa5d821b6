"""Pattern: the rotary the tracer writes on attention heads, "rotate half" (matched, never rewritten here).

The traced rotary of the heads ``x`` ``[B, N, S, hd]`` (halves by Split or two Slices)::

    x*cos + rotate_half(x)*sin                        rotate_half(x) = Concat(-x[..., d/2:], x[..., :d/2])
    Concat(rotate(x[..., :d]), x[..., d:])            partial rotary: the first d channels (Phi, StableLM)

``RotateHalf`` is that pattern; ``find_rotary`` (or a ``RotaryFinder`` kept for many lookups) says
which rotary computes a value, as a ``Rotary`` (what it rotates, the graph's cos/sin, the rotated
width), or why it is not one. Both targets rewrite what it finds: ``--target ort`` into
``com.microsoft.RotaryEmbedding`` (``targets/ort/rotary.py``), ``--target onnx`` into ONNX's own
``RotaryEmbedding`` (``targets/onnx/rotary.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRule, RewriteRuleClassBase, RewriteRuleSet

from kiln.exporter.passes.ir_utils import producer, scalar_of
from kiln.exporter.patterns.rules import fail, first_match, rule_of

__all__ = ["Rotary", "RotaryFinder", "RotateHalf", "find_rotary", "same_value"]


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
    if (
        depth == 0
        or na is None
        or nb is None
        or (na.op_type, na.domain, len(na.inputs)) != (nb.op_type, nb.domain, len(nb.inputs))
    ):
        return False
    same_attrs = {k: repr(v.value) for k, v in na.attributes.items()} == {
        k: repr(v.value) for k, v in nb.attributes.items()
    }
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
        return (
            op.Concat(out, op.Slice(x_rest, _allow_other_inputs=True, _outputs=["rest"]), _outputs=["joined"])
            if self.partial
            else out
        )

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
            if (
                part is None
                or rest is None
                or part[0] != 0
                or rest[0] != part[1]
                or part[1] % 2
                or not same_value(bound["x_rest"], x)
            ):
                return fail("partial rotary: not Concat(rotate(x[..., :d]), x[..., d:]) of one x")
            dim = part[1]
        last = rotated.shape[-1] if rotated.shape is not None else None
        if not _halves(self.split, first, second, dim if dim is not None else last if isinstance(last, int) else None):
            return fail("rotate_half's halves are not the two halves of the last axis")
        self.found = Rotary(x, cos, sin, dim)
        return MatchResult()

    def rewrite(self, op: Any, **_: Any) -> Any:
        return None  # matching only: RotaryEmbeddingRule rewrites


class RotaryFinder:
    """The rotate-half patterns in every form (commuted Add/Mul operands included)."""

    def __init__(self) -> None:
        self.patterns = [RotateHalf(split=s, partial=p) for p in (False, True) for s in (True, False)]
        self.rules: list[tuple[RotateHalf, RewriteRule]] = [
            (f, r) for f in self.patterns for r in RewriteRuleSet([rule_of(f)], commute=True)
        ]

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
    return RotaryFinder().find(model, value)
