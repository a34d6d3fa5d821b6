"""The order a candidate's parity work runs in: each graph's work together, so that a runner holding one
session at a time (``OrtRunner``, which keeps a model's weights in memory once) opens each graph's session
once instead of once per check (ten openings for three graphs, each reading and prepacking every weight).

    prefill: its tensor checks (batch 2, batch 1), quality (the graphs' prefill on the quality text),
             the greedy run's prompt step
    decode:  the greedy run's steps, then its tensor checks
    model:   its tensor checks (with its prompt from an empty cache), then its chunks on the greedy tokens

The checks are reported in the order they always were (every graph's batch-2 checks, then every graph's
batch-1 checks): only the order they run in changes, and no check's feeds or outputs."""

from __future__ import annotations

from collections.abc import Sequence

from kiln.exporter.contract.io import GraphKind

__all__ = ["tensors_after_generation", "tensors_before_generation"]

_AFTER = (GraphKind.DECODE, GraphKind.UNIFIED)  # where the greedy run ends, then the graph fed its tokens


def tensors_before_generation(graphs: Sequence[GraphKind]) -> tuple[GraphKind, ...]:
    """The graphs whose tensors are checked before the greedy run: those it starts on (prefill, an encoder)."""
    return tuple(kind for kind in graphs if kind not in _AFTER)


def tensors_after_generation(graphs: Sequence[GraphKind]) -> tuple[GraphKind, ...]:
    """The graphs whose tensors are checked after the greedy run: decode (still open where it ended),
    then the unified graph, whose chunks on the greedy tokens follow its checks."""
    return tuple(kind for kind in _AFTER if kind in graphs)
