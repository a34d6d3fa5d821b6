"""``--auto-keep-fp32``: find a small set of modules that must stay fp32 for fp16 parity.

Candidates are the modules of the unified graph (a group is every node named
``/<module>/...``, so a found group applies to all three graphs). Bisection: if keeping every
candidate in fp32 does not meet the tolerance, nothing can; otherwise halve the candidates and
keep the half that suffices, and when neither half suffices alone, find what each half needs
given the other (delta debugging). Each evaluation converts the graph with the candidate set
kept, runs it with ONNX's reference evaluator (true fp16 arithmetic, see ``evaluate``) and
compares its logits with PyTorch's.

The result names modules and their nodes, each with the logit error that putting it back in
fp16 causes (the rest of the found set staying fp32), so a user can map it to the model.
"""

from __future__ import annotations

import dataclasses
import tempfile
import typing
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from torch import nn

from kiln.errors import ExportError
from kiln.exporter.contract.io import ENCODER_STATES, GraphKind, carried_cache, is_cross
from kiln.exporter.contract.steps import empty_past
from kiln.exporter.parity import tensor_feeds
from kiln.exporter.precision.fp16 import convert_to_fp16
from kiln.exporter.precision.policy import Fp16Policy, resolve_kept_nodes, rule_matches
from kiln.exporter.runners import TorchRunner
from kiln.plugins.base import DecoderSpec

__all__ = ["SensitiveGroup", "SensitivityResult", "find_fp32_groups", "module_groups", "search_against_reference"]


@dataclasses.dataclass(frozen=True)
class SensitiveGroup:
    rule: str  # "/layers.1.mlp.fc1/": a module rule for --keep-fp32
    nodes: tuple[str, ...]
    error_in_fp16: float  # max logit error when this group alone goes back to fp16


@dataclasses.dataclass(frozen=True)
class SensitivityResult:
    tolerance: float
    error_default: float  # with the default policy only
    error_found: float  # with the found groups kept too
    evaluations: int
    groups: tuple[SensitiveGroup, ...]


def module_groups(graph: ir.Graph, skip: set[str]) -> dict[str, list[str]]:
    """Float-computing nodes by the module they sit in, ``/<module>/`` -> node names, in graph order."""
    groups: dict[str, list[str]] = {}
    for node in graph:
        name = node.name or ""
        if (
            name in skip
            or not name.startswith("/")
            or not any(o.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16) for o in node.outputs)
        ):
            continue
        groups.setdefault(name[: name.rfind("/") + 1], []).append(name)
    return groups


class _Search:
    """Delta debugging over module rules: ``error(rules)`` converts a fresh copy of the fp32 graph
    with ``rules`` also kept fp32 and evaluates it (memoised)."""

    def __init__(
        self,
        fp32_graph: onnx.ModelProto,
        policy: Fp16Policy,
        evaluate: Callable[[Path], float],
        tolerance: float,
        kind: GraphKind,
    ) -> None:
        self._graph, self._policy, self._evaluate, self.tolerance, self._kind = (
            fp32_graph,
            policy,
            evaluate,
            tolerance,
            kind,
        )
        self.cache: dict[frozenset[str], float] = {}

    def error(self, rules: Sequence[str]) -> float:
        key = frozenset(rules)
        if key not in self.cache:
            model = ir.serde.deserialize_model(self._graph)
            converted, _ = convert_to_fp16(model, self._policy.widened(tuple(sorted(rules))))
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / f"{self._kind.value}.onnx"
                ir.save(converted, path, external_data="weights.bin")
                self.cache[key] = self._evaluate(path)
        return self.cache[key]

    def passes(self, rules: Sequence[str]) -> bool:
        e = self.error(rules)
        return bool(np.isfinite(e)) and e <= self.tolerance

    def bisect(self, cands: list[str], keep: list[str]) -> list[str]:
        """A small subset of ``cands`` that, with ``keep``, passes (``keep + cands`` does)."""
        if self.passes(keep):
            return []
        if len(cands) == 1:
            return cands
        half = len(cands) // 2
        first, second = cands[:half], cands[half:]
        if self.passes(keep + first):
            return self.bisect(first, keep)
        if self.passes(keep + second):
            return self.bisect(second, keep)
        need_first = self.bisect(first, keep + second)
        return need_first + self.bisect(second, keep + need_first)


def find_fp32_groups(
    fp32_graph: onnx.ModelProto,
    policy: Fp16Policy,
    evaluate: Callable[[Path], float],
    tolerance: float,
    kind: GraphKind = GraphKind.UNIFIED,
) -> SensitivityResult:
    """``evaluate(path)`` runs an fp16 graph and returns its max logit error against PyTorch.
    ``fp32_graph`` holds its weights in memory (each evaluation converts a fresh copy)."""
    base = ir.serde.deserialize_model(fp32_graph)
    kept = set(resolve_kept_nodes(base.graph, policy))
    candidates = list(module_groups(base.graph, kept))
    graph_nodes = [n for n in base.graph if n.name and n.name not in kept]
    search = _Search(fp32_graph, policy, evaluate, tolerance, kind)
    default_error = search.error([])
    if search.passes([]):
        return SensitivityResult(tolerance, default_error, default_error, len(search.cache), ())
    if not search.passes(candidates):
        raise ExportError(
            f"--auto-keep-fp32: even with every module in fp32 the logit error is {search.error(candidates):.3g} "
            f"(tolerance {tolerance:g}); the fp16 graph's inputs/outputs themselves lose too much"
        )
    found = search.bisect(candidates, [])
    groups = tuple(
        SensitiveGroup(
            rule,
            tuple(n.name or "" for n in graph_nodes if rule_matches(rule, n)),
            search.error([r for r in found if r != rule]),
        )
        for rule in found
    )
    return SensitivityResult(tolerance, default_error, search.error(found), len(search.cache), groups)


def search_against_reference(
    reference: nn.Module,
    spec: DecoderSpec,
    fp32_unified: ir.Model,
    policy: Fp16Policy,
    tolerance: float,
    seed: int = 0,
) -> SensitivityResult:
    """``find_fp32_groups`` on the unified graph, judged by its logits against the PyTorch
    ``reference`` on a prefill-shaped and a decode-shaped input (left-padded, non-empty past)."""
    from onnx.reference import ReferenceEvaluator

    torch_runner = TorchRunner(reference, spec.n_layers)
    unified = tensor_feeds(spec, GraphKind.UNIFIED, seed, np.dtype(np.float16))
    feeds16 = [unified, _prefill_as_unified(spec, seed, unified)]
    wants = [torch_runner.run(GraphKind.UNIFIED, f)["logits"] for f in feeds16]

    def evaluate(path: Path) -> float:
        # ONNX's reference evaluator, not ONNX Runtime: on x86 CPUs ONNX Runtime has no fp16
        # kernels for MatMul and most element-wise ops, so it runs them in fp32 between Casts
        # and drops the Cast pairs in between; an fp16 overflow never shows. The reference
        # evaluator rounds every op's output to fp16, as a GPU does.
        session = ReferenceEvaluator(str(path))
        worst = 0.0
        for feeds, want in zip(feeds16, wants, strict=True):
            with np.errstate(all="ignore"):
                got = typing.cast(list[np.ndarray], session.run(["logits"], feeds))[0]
            diff = np.abs(got.astype(np.float64) - want)
            worst = max(worst, float(diff.max()) if np.isfinite(diff).all() else float("inf"))
        return worst

    return find_fp32_groups(ir.serde.serialize_model(fp32_unified), policy, evaluate, tolerance)


def _prefill_as_unified(spec: DecoderSpec, seed: int, with_past: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A prompt through the unified graph: an empty self-attention past (and, for a
    cross-attention decoder, the cross cache of ``with_past``, the unified feeds)."""
    feeds = tensor_feeds(spec, GraphKind.PREFILL, seed, np.dtype(np.float16))
    feeds.pop(ENCODER_STATES, None)
    feeds.update(
        {past: with_past[past] for past, _ in carried_cache(spec) if is_cross(past)}
        | empty_past(spec, 2, np.dtype(np.float16))
    )
    return feeds
