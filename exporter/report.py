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
from kiln.exporter.precision.sensitivity import SensitivityResult
from kiln.exporter.targets.base import TargetGraphs
from kiln.plugins.base import DecoderSpec

if TYPE_CHECKING:
    from kiln.plugins.hf.adapter import LoraAdapter

__all__ = ["ExportReport"]


@dataclasses.dataclass(frozen=True)
class ExportReport:
    spec: DecoderSpec
    options: ExportOptions
    model_ref: str | None  # what --model named
    checkpoint_files: dict[str, str]  # sha256 of each checkpoint file read, by name (hashed once)
    max_context: int
    folding: tuple[FoldCheck, ...]
    keep_fp32: tuple[str, ...]  # the fp16 policy's rules, as widened by --keep-fp32 and the search
    portable: GraphSet
    calibration: dict[str, Any] | None  # int8: where the ranges came from
    sensitivity: SensitivityResult | None  # --auto-keep-fp32
    targets: tuple[TargetGraphs, ...]  # what each target wrote (--target NAME)
    parity: ParityResult  # every graph set's checks
    tokenizer: Path | None  # the checkpoint's tokenizer.json (copied into the export), when it has one
    serving_files: tuple[Path, ...] = ()  # the family's files for consumers (Hugging Face's config.json...), copied into onnx/
    quantization: dict[str, Any] | None = None  # int4 / fp8: what the manifest records of them (``export.quantization``)
    checkpoint_path: str | None = None  # the absolute path the checkpoint was read from (None: built in memory)
    adapters: tuple[LoraAdapter, ...] = ()  # the LoRA adapters merged into it (--adapter)

    def parity_extras(self) -> dict[str, Any]:
        """What the parity report shows besides the checks, in the order it shows it."""
        extras: dict[str, Any] = {}
        fp16 = {kind.value: g.passes["fp16"] for kind, g in self.portable.graphs.items() if "fp16" in g.passes}
        fp32 = {kind: {"nodes": r["fp32_nodes"], "tables": r["fp32_ple_tables"]} for kind, r in fp16.items()}
        if fp32:
            extras["kept_fp32"] = fp32
        if self.calibration is not None:
            extras["calibration"] = self.calibration
            if self.options.precision.has_int8:
                extras["int8_nodes"] = {kind.value: g.passes.get("int8", {}).get("nodes", []) for kind, g in self.portable.graphs.items()}
        if self.quantization is not None:
            extras["quantization"] = self.quantization
        if self.sensitivity is not None:
            extras["fp16_sensitivity"] = dataclasses.asdict(self.sensitivity)
        extras["ple_folding"] = [dataclasses.asdict(c) for c in self.folding]
        return extras
