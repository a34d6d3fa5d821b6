"""What every target's fusions share: applying onnxscript rewrite rules, and saying why a
candidate did not fuse.

A fusion is an onnxscript rule (a ``pattern`` in the op vocabulary it matches, a ``check`` that
fails with ``MatchResult.fail(reason)``, a ``rewrite``) or, where a pattern cannot say it, a
hand-written matcher of the same shape (a check returning the reason). After a fusion ran, each
of its candidates that is still in the graph (a Softmax for attention, a ``ReduceMean(Pow)``
for RMSNorm, ...) is matched once more, only to read the reason: the rule's failing check, or
the pattern's first mismatch. ``NotFused`` collects them per fusion, "layer i: reason" (or the
candidate node's name), for the manifest.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

import onnx_ir as ir
from onnxscript.rewriter import (
    MatchingTracer,
    MatchResult,
    MatchStatus,
    RewriteRule,
    RewriteRuleClassBase,
    RewriteRuleSet,
)

__all__ = ["NotFused", "apply_rules", "explain", "fail", "first_match", "rule_of", "where"]

_LAYER = re.compile(r"(?:layers|\.h)\.(\d+)\.")  # kiln's and Hugging Face's module names; GPT-2's h.i


def fail(reason: str) -> MatchResult:
    """A failed check: ``reason`` is what the manifest reports."""
    return MatchResult().fail(reason)


def where(node: ir.Node) -> str:
    """ "layer i" for a node of layer i (named after its module), else the node's name."""
    found = _LAYER.search(node.name or "")
    return f"layer {found.group(1)}" if found else (node.name or node.op_type)


class NotFused:
    """The candidates of each fusion left unfused, and why: fusion -> ["layer i: reason", ...]."""

    def __init__(self) -> None:
        self.reasons: dict[str, list[str]] = {}

    def add(self, fusion: str, reasons: Iterable[str]) -> None:
        listed = self.reasons.setdefault(fusion, [])
        listed.extend(r for r in reasons if r not in listed)

    def record(self) -> dict[str, tuple[str, ...]] | None:
        """The manifest's form: only fusions with unfused candidates; None when there are none."""
        kept = {fusion: tuple(reasons) for fusion, reasons in sorted(self.reasons.items()) if reasons}
        return kept or None


class _Attempts(MatchingTracer):
    """Every match attempt, with the nodes it matched before it failed."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts: list[tuple[MatchResult, MatchStatus]] = []

    def log(
        self, rule: object, container: object, node: ir.Node, match_result: MatchResult, status: MatchStatus
    ) -> None:
        self.attempts.append((match_result, status))


def rule_of(instance: RewriteRuleClassBase) -> RewriteRule:
    """``instance`` as a rule (``RewriteRuleClassBase.rule`` for an instance the caller keeps, to
    read what its check found)."""
    return RewriteRule(
        instance.pattern, instance.rewrite, instance.check, name=instance.name, remove_nodes=instance.remove_nodes
    )


def apply_rules(model: ir.Model, rules: Sequence[RewriteRule], *, commute: bool = False) -> int:
    """Apply ``rules`` to ``model`` (each node tried against each rule, in order); how many fired."""
    return int(RewriteRuleSet(list(rules), commute=commute).apply_to_model(model))


def _reason(match: MatchResult, status: MatchStatus) -> str:
    """A check's reason as it is; a pattern mismatch with the node it stopped at."""
    if status is MatchStatus.CONDITION_FAILED or not match.reason:
        return match.reason
    at = next((n for n in match.failure_nodes_and_values if isinstance(n, ir.Node)), None)
    return f"the pattern stops at {at.op_type} {at.name}: {match.reason}" if at is not None else match.reason


def _best(attempts: list[tuple[MatchResult, MatchStatus]], around: ir.Node | None) -> str | None:
    """The reason of the failed attempt (around a node) that matched the most: a failing check
    beats a pattern mismatch."""
    tried = [
        (status, len(m.nodes), m)
        for m, status in attempts
        if status is not MatchStatus.SUCCESS and (around is None or around in m.nodes)
    ]
    best = max(tried, default=None, key=lambda t: (t[0] is MatchStatus.CONDITION_FAILED, t[1]))
    return _reason(best[2], best[0]) or None if best is not None else None


def first_match(model: ir.Model, rules: Sequence[RewriteRule], node: ir.Node) -> RewriteRule | str:
    """The first of ``rules`` whose pattern and check match at ``node`` (nothing is rewritten), or
    the reason none does."""
    tracer = _Attempts()
    graph = node.graph if node.graph is not None else model.graph
    for rule in rules:
        if rule.match(model, graph, node, check_nodes_are_removable=False, tracer=tracer):
            return rule
    return _best(tracer.attempts, None) or f"no pattern matches at {node.op_type}"


def explain(
    model: ir.Model,
    rules: Sequence[RewriteRule],
    candidates: Sequence[ir.Node],
    *,
    commute: bool = False,
    label: Callable[[ir.Node], str] = where,
    otherwise: Callable[[ir.Node], str] = lambda _: "no pattern of this fusion matches around it",
) -> list[str]:
    """ "<label>: reason" for each candidate node: the reason of the attempt that matched the most
    of the pattern around it (``_best``), ``otherwise(node)`` when none reached it. Nothing is
    rewritten."""
    if not candidates:
        return []
    tracer = _Attempts()
    graph = model.graph
    for rule in RewriteRuleSet(list(rules), commute=commute):
        for node in list(graph):
            rule.match(model, graph, node, check_nodes_are_removable=rule.remove_nodes, tracer=tracer)
    return [f"{label(c)}: {_best(tracer.attempts, c) or otherwise(c)}" for c in candidates]
