"""An export's precision prepared: each kind's ``prepare`` run once (``context.PrecisionContext``),
then, per graph, every kind's passes in the plan's order (the MatMuls' kind, then the float
type) and every kind's checks after them; what they record, merged."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from kiln.exporter.precision.context import PrecisionContext
from kiln.exporter.precision.kinds.base import GraphReports, Prepared

if TYPE_CHECKING:
    import onnx_ir as ir

    from kiln.exporter.contract.io import GraphKind
    from kiln.exporter.precision.kinds.plan import Precision

__all__ = ["PreparedPrecision", "prepare_precision"]


@dataclasses.dataclass(frozen=True)
class PreparedPrecision:
    precision: Precision
    prepared: tuple[Prepared, ...]

    def passes(self, kind: GraphKind) -> list[ir.passes.PassBase]:
        """Every kind's passes of graph ``kind``, then every kind's checks."""
        return [p for each in self.prepared for p in each.passes(kind)] + [
            c for each in self.prepared for c in each.checks(kind)
        ]

    def record(self, reports: GraphReports) -> dict[str, Any]:
        """What the manifest's ``export`` section records of the kinds."""
        return {key: value for each in self.prepared for key, value in each.record(reports).items()}

    def extras(self, reports: GraphReports) -> dict[str, Any]:
        """What the parity report shows of the kinds."""
        return {key: value for each in self.prepared for key, value in each.extras(reports).items()}


def prepare_precision(context: PrecisionContext) -> PreparedPrecision:
    return PreparedPrecision(context.precision, tuple(kind.prepare(context) for kind in context.precision.kinds))
