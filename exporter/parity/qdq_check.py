"""An int8 or fp8 Q/DQ export's graph sets against PyTorch with the export's Q/DQ numbers
(``parity.qdq_model``): each graph's tensor outputs against the reference with that graph's
scales, and each generation path against the reference scored with the scales of the graphs
that generated it (prefill's over the prompt then decode's; the unified graph's throughout)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
from torch import nn

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.parity.qdq_model import QdqReference
from kiln.exporter.parity.qdq_numbers import QdqNumbers
from kiln.exporter.parity.results import TensorCheck
from kiln.exporter.parity.tensors import compare_outputs
from kiln.exporter.parity.tolerances import Tolerance
from kiln.exporter.runners.base import Feeds, Runner
from kiln.plugins.base import DecoderSpec

__all__ = ["Judged", "against_qdq"]


class _Candidate(Protocol):
    @property
    def quantized(self) -> Tolerance | None: ...


class _Ran(Protocol):
    """A candidate's kept outputs (``parity.driver``)."""

    @property
    def candidate(self) -> _Candidate: ...

    @property
    def outputs(self) -> list[tuple[GraphKind, Feeds, Feeds]]: ...


Judged = tuple[
    Tolerance, list[TensorCheck], list[np.ndarray], list[np.ndarray]
]  # its tolerance, tensor checks, each path's scores


def against_qdq(
    module: nn.Module,
    spec: DecoderSpec,
    numbers: QdqNumbers,
    ran: Sequence[_Ran],
    last_logits_only: bool,
    length: int,
    score: Callable[[Runner], list[list[np.ndarray]]],
) -> list[Judged | None]:
    """Each candidate with a ``quantized`` tolerance checked against ``module`` made to compute
    with ``numbers`` (in place): its tensor checks, then the reference's logits at every step of
    its runs, per group, for the prefill + decode path and the unified path (``score`` scores
    those candidates' runs with a runner; ``length`` is the prompts' padded length); None for the others."""
    reference = QdqReference(module, numbers, spec.n_layers, last_logits_only)
    stepped = iter(score(reference.runner(GraphKind.PREFILL, length, GraphKind.DECODE)))
    unified = iter(score(reference.runner(GraphKind.UNIFIED))) if GraphKind.UNIFIED.value in numbers.graphs else None
    out: list[Judged | None] = []
    for r in ran:
        tolerance = r.candidate.quantized
        if tolerance is None:
            out.append(None)
            continue
        tensors = [
            check
            for kind, feeds, got in r.outputs
            for check in compare_outputs(
                kind, feeds, reference.runner(kind, last_logits_only=last_logits_only).run(kind, feeds), got, tolerance
            )
        ]
        scored = next(stepped)
        out.append((tolerance, tensors, scored, next(unified) if unified is not None else scored))
    return out
