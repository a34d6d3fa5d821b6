"""An int8 or fp8 Q/DQ export's graph sets against PyTorch with the export's Q/DQ numbers
(``parity.qdq_model``): each graph's tensor outputs against the reference with that graph's
scales, and each generation path against the reference scored with the scales of the graphs
that generated it (prefill's over the prompt then decode's; the unified graph's throughout)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from torch import nn

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.parity.against import Judged, KeptRun, judged_against
from kiln.exporter.parity.qdq_model import QdqReference
from kiln.exporter.parity.qdq_numbers import QdqNumbers
from kiln.exporter.runners.base import Runner
from kiln.plugins.base import DecoderSpec

__all__ = ["Judged", "against_qdq"]


def against_qdq(
    module: nn.Module,
    spec: DecoderSpec,
    numbers: QdqNumbers,
    ran: Sequence[KeptRun],
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
    return judged_against(
        ran, lambda kind: reference.runner(kind, last_logits_only=last_logits_only), stepped, unified
    )  # each graph's tensors against the model with that graph's scales
