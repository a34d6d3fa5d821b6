"""The graph sets of a low-bit export judged against its quantized model (PyTorch on the int4
weights, ``parity.quantized``, or with the Q/DQ numbers, ``parity.qdq_check``): one loop for both.
Each candidate with a ``quantized`` tolerance gets its kept tensor outputs compared with the
quantized model's on the same feeds, and its runs' scores from that model."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.parity.results import TensorCheck
from kiln.exporter.parity.tensors import compare_outputs
from kiln.exporter.runners.base import Feeds, Runner
from kiln.exporter.tolerance import Tolerance

__all__ = ["Judged", "KeptRun", "judged_against"]


class _Candidate(Protocol):
    @property
    def quantized(self) -> Tolerance | None: ...


class KeptRun(Protocol):
    """A candidate's kept outputs (``parity.driver``)."""

    @property
    def candidate(self) -> _Candidate: ...

    @property
    def outputs(self) -> list[tuple[GraphKind, Feeds, Feeds]]: ...


Judged = tuple[
    Tolerance, list[TensorCheck], list[np.ndarray], list[np.ndarray]
]  # its tolerance, tensor checks, each path's scores: prefill + decode's, then the unified graph's


def judged_against(
    ran: Sequence[KeptRun],
    runner_for: Callable[[GraphKind], Runner],
    stepped: Iterator[list[np.ndarray]],
    unified: Iterator[list[np.ndarray]] | None = None,
) -> list[Judged | None]:
    """Each candidate of ``ran`` with a ``quantized`` tolerance: its tensor outputs against
    ``runner_for(kind)``'s on the same feeds, and its next scores from ``stepped`` (the prefill +
    decode path's) and ``unified`` (the unified graph's; ``stepped``'s where None); None for the
    others, which take no scores."""
    out: list[Judged | None] = []
    for r in ran:
        tolerance = r.candidate.quantized
        if tolerance is None:
            out.append(None)
            continue
        tensors = [
            check
            for kind, feeds, got in r.outputs
            for check in compare_outputs(kind, feeds, runner_for(kind).run(kind, feeds), got, tolerance)
        ]
        scored = next(stepped)
        out.append((tolerance, tensors, scored, next(unified) if unified is not None else scored))
    return out
