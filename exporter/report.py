"""``ExportReport``: what one export did, stage by stage; the manifest and the parity reports are
both written from it (``artifacts.manifest.build_manifest``, ``parity.report.write_reports``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.exporter.fold import FoldCheck
from kiln.exporter.graphs import GraphSet
from kiln.exporter.options import ExportOptions
from kiln.exporter.parity.results import ParityResult
from kiln.exporter.targets.base import TargetGraphs
from kiln.plugins.base import DecoderSpec

if TYPE_CHECKING:
    from kiln.plugins.hf.adapter import LoraAdapter

__all__ = ["ExportReport"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportReport:
    """Built by keyword (``pipeline``), so each value is seen beside its field's name."""

    spec: DecoderSpec
    options: ExportOptions
    model_ref: str | None  # what --model named
    checkpoint_files: dict[str, str]  # sha256 of each checkpoint file read, by name (hashed once)
    max_context: int
    folding: tuple[FoldCheck, ...]
    portable: GraphSet
    calibration: dict[str, Any] | None  # int8/fp8: where the ranges came from
    targets: tuple[TargetGraphs, ...]  # what each target wrote (--target NAME)
    parity: ParityResult  # every graph set's checks
    tokenizer: Path | None  # the checkpoint's tokenizer.json (copied into the export), when it has one
    # the family's files for consumers (Hugging Face's config.json...), copied into onnx/
    serving_files: tuple[Path, ...] = ()
    # what the precision kinds record in the manifest's export section (keep_fp32, quantization)
    precision_record: dict[str, Any] = dataclasses.field(default_factory=dict)
    precision_extras: dict[str, Any] = dataclasses.field(default_factory=dict)  # what the parity report shows of them
    checkpoint_path: str | None = None  # the absolute path the checkpoint was read from (None: built in memory)
    adapters: tuple[LoraAdapter, ...] = ()  # the LoRA adapters merged into it (--adapter)

    @property
    def keep_fp32(self) -> tuple[str, ...]:
        """The fp16 policy's rules, as widened by --keep-fp32 and the search (none without fp16)."""
        return tuple(self.precision_record.get("keep_fp32", ()))

    @property
    def quantization(self) -> dict[str, Any] | None:
        """What the manifest records of a quantized precision (``export.quantization``)."""
        return self.precision_record.get("quantization")

    def parity_extras(self) -> dict[str, Any]:
        """What the parity report shows besides the checks, in the order it shows it."""
        extras: dict[str, Any] = dict(self.precision_extras)
        if self.calibration is not None:
            extras["calibration"] = self.calibration
        if self.quantization is not None:
            extras["quantization"] = self.quantization
        extras["ple_folding"] = [dataclasses.asdict(c) for c in self.folding]
        return extras
