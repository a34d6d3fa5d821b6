"""A graph set as parity checks it (``parity.Candidate``): judged by its precision's tolerances
and fed its KV dtype, and, for a weight-only set, by its float precision's against PyTorch on its
own quantized numbers. Shared by ``kiln export`` (``pipeline``) and ``kiln check`` (``check``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.parity import Candidate
from kiln.exporter.precision.kinds.plan import Precision
from kiln.exporter.runners import Runner

__all__ = ["candidate"]


def candidate(
    open_runner: Callable[[], contextlib.AbstractContextManager[Runner]],
    graphs: tuple[GraphKind, ...],
    precision: str,
    quantized: str | None,
    target: str | None = None,
) -> Candidate:
    """The graph set whose graphs are of ``precision`` (a manifest's name), judged against the
    quantized model at ``quantized``'s tolerances (None: not judged so)."""
    plan = Precision.parse(precision)
    against = Precision.parse(quantized).tolerance if quantized is not None else None
    return Candidate(open_runner, graphs, plan.value, plan.tolerance, plan.kv_dtype, target=target, quantized=against)
