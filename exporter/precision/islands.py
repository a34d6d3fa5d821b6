"""The fp16 kind's machinery (``kinds.fp16``): an export's fp32 islands, the default policy
(``policy``) widened by ``--keep-fp32`` and by what ``--auto-keep-fp32``'s search finds
(``sensitivity``), and each graph's passes: the conversion (``fp16``), then the contract's I/O
at fp16."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from kiln.exporter.contract.io import GraphIO, GraphKind
from kiln.exporter.passes.contract import ApplyContract
from kiln.exporter.precision.context import PrecisionContext
from kiln.exporter.precision.fp16 import ConvertFp16
from kiln.exporter.precision.kinds.base import GraphReports, Prepared
from kiln.exporter.precision.policy import Fp16Policy
from kiln.exporter.precision.sensitivity import SensitivityResult, search_against_reference

if TYPE_CHECKING:
    from kiln.exporter.precision.kinds.fp16 import Fp16

__all__ = ["prepare"]


def prepare(kind: Fp16, context: PrecisionContext) -> Prepared:
    """The fp32 islands: the default policy, the family's own (``DecoderSpec.keep_fp32``), ``--keep-fp32`` and
    what ``--auto-keep-fp32`` finds."""
    policy = Fp16Policy().widened(context.reference.spec.keep_fp32 + kind.keep_fp32)  # the family's, then asked
    if not kind.auto_keep_fp32:
        return _Fp16Prepared(policy, None, context.contract_io)
    reference = context.reference
    with context.progress.stage("fp16 sensitivity search"):
        unified = context.fp32_graph(GraphKind.UNIFIED)
        found = search_against_reference(reference.module, reference.spec, unified, policy, kind.tolerance.logits_atol)
    context.progress.note(_found_line(found))
    return _Fp16Prepared(policy.widened(tuple(g.rule for g in found.groups)), found, context.contract_io)


def _found_line(found: SensitivityResult) -> str:
    """What ``--auto-keep-fp32`` found, in one line (the manifest and the report hold the detail)."""
    if not found.groups:
        return (
            f"--auto-keep-fp32: no module needs fp32 (logits error {found.error_default:.3g} within "
            f"{found.tolerance:g} at fp16)"
        )
    rules = ", ".join(g.rule for g in found.groups[:5]) + (
        f" (and {len(found.groups) - 5} more)" if len(found.groups) > 5 else ""
    )
    return (
        f"--auto-keep-fp32: kept {len(found.groups)} module{'s' if len(found.groups) > 1 else ''} in fp32: {rules}"
        f" (logits error {found.error_default:.3g} at fp16, {found.error_found:.3g} with them kept; limit "
        f"{found.tolerance:g})"
    )


@dataclasses.dataclass(frozen=True)
class _Fp16Prepared(Prepared):
    policy: Fp16Policy  # as widened by --keep-fp32 and the search
    sensitivity: SensitivityResult | None  # --auto-keep-fp32's search
    contract_io: Callable[[GraphKind, str], GraphIO]

    def passes(self, kind: GraphKind) -> list[ir.passes.PassBase]:
        return [ConvertFp16(self.policy), ApplyContract(self.contract_io(kind, "float16"), kind)]

    def record(self, reports: GraphReports) -> dict[str, Any]:
        return {"keep_fp32": self.policy.keep}

    def extras(self, reports: GraphReports) -> dict[str, Any]:
        fp32 = {
            kind.value: {"nodes": r["fp16"]["fp32_nodes"], "tables": r["fp16"]["fp32_ple_tables"]}
            for kind, r in reports.items()
            if "fp16" in r
        }
        found = {"fp16_sensitivity": dataclasses.asdict(self.sensitivity)} if self.sensitivity is not None else {}
        return ({"kept_fp32": fp32} if fp32 else {}) | found
