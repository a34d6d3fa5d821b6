"""What a precision kind's ``prepare`` is given (``kinds.base.PrecisionKind.prepare``): the model
and what the pipeline has made of it. Apart from the kinds' declarations, which sit below the
export's options and the load stage that it names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx_ir as ir

    from kiln.exporter.contract.io import GraphIO, GraphKind
    from kiln.exporter.load import Reference
    from kiln.exporter.options import ExportOptions
    from kiln.exporter.precision.kinds.base import Ranges
    from kiln.exporter.precision.kinds.plan import Precision
    from kiln.exporter.progress import Progress

__all__ = ["PrecisionContext"]


@dataclasses.dataclass(frozen=True)
class PrecisionContext:
    """What a kind's ``prepare`` is given: the model and what the pipeline has made of it."""

    reference: Reference
    options: ExportOptions
    progress: Progress
    ranges: Callable[[GraphKind, ir.Model], Ranges] | None  # ``Needs.RANGES``: a graph's calibrated activation ranges
    contract_io: Callable[[GraphKind, str], GraphIO]  # a graph's contract I/O at a KV dtype
    fp32_graph: Callable[[GraphKind], ir.Model]  # a graph in fp32, as the portable set derives it

    @property
    def precision(self) -> Precision:
        return self.options.precision
