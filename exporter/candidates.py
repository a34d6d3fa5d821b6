"""A graph set as parity checks it (``parity.Candidate``): judged by its precision's tolerances
and fed its KV dtype, and, for a weight-only set, by its float precision's against PyTorch on its
own quantized numbers. Shared by ``kiln export`` (``pipeline``) and ``kiln check`` (``check``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.external_data import set_bytes
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
    files: Iterable[Path] = (),
) -> Candidate:
    """The graph set whose graphs are of ``precision`` (a manifest's name), judged against the
    quantized model at ``quantized``'s tolerances (None: not judged so), where no greedy token may
    differ but by a tie: the quantized model computes the graphs' own numbers, so only their
    arithmetic's rounding may reorder its tokens, and only those within the tolerance of each other
    (a token-match floor, int8's 90%, would refuse a correct graph of a model whose logits are
    mostly near-ties: the random Llama-3-8B-shaped one's ``--target ort`` matched 64-70% here,
    every mismatch a tie; and it would let a wrong token through on a model with few). ``files``:
    its graph files, sized for parity's memory rule (``parity.memory``)."""
    plan = Precision.parse(precision)
    against = dataclasses.replace(Precision.parse(quantized).tolerance, min_token_match=1.0) if quantized is not None else None
    return Candidate(open_runner, graphs, plan.value, plan.tolerance, plan.kv_dtype, target=target, quantized=against, weight_bytes=set_bytes(files))
