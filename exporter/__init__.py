"""kiln's exporter: what writes an export directory, and its Python API.

    from kiln.exporter import ExportOptions, Precision, export, check_dir, verify_dir

    result = export("demo", Path("build/demo"), ExportOptions(precision=Precision.FP16))
    result.manifest.graphs["decode"].inputs   # the typed manifest.json
    check_dir(Path("build/demo")).passed      # parity again, against the checkpoint

The stages, in the order ``pipeline.export`` runs them: ``plan`` (every refusal, asked at once),
``load`` (reference module and limits),
``fold`` (PLE tables), ``trace`` + ``graphs`` (the portable graphs and their ``passes``,
``precision``), ``targets`` (the registry of ``--target NAME``: ``ort``, ``onnx``; what both
recognise in a graph is ``patterns``), ``parity`` (with ``runners``), ``emit`` (reports,
``serving`` configs, the manifest of ``artifacts``, which also stages, reads and verifies export
directories). ``engine`` builds TensorRT engines from an
export. Names are imported on first use, so ``import kiln.exporter`` is cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.exporter.artifacts.manifest import Manifest, read
    from kiln.exporter.artifacts.verify import Verification, verify_dir
    from kiln.exporter.check import check_dir
    from kiln.exporter.options import (
        ExportOptions,
        LogitsMode,
        PLETables,
        Precision,
    )
    from kiln.exporter.parity import ParityResult
    from kiln.exporter.pipeline import ExportResult, export, export_loaded
    from kiln.exporter.report import ExportReport

__all__ = [
    "ExportOptions",
    "ExportReport",
    "ExportResult",
    "LogitsMode",
    "Manifest",
    "PLETables",
    "ParityResult",
    "Precision",
    "Verification",
    "check_dir",
    "export",
    "export_loaded",
    "read",
    "verify_dir",
]

_LAZY = {
    "ExportOptions": "options",
    "LogitsMode": "options",
    "PLETables": "options",
    "Precision": "options",
    "ExportReport": "report",
    "ExportResult": "pipeline",
    "export": "pipeline",
    "export_loaded": "pipeline",
    "Manifest": "artifacts.manifest",
    "read": "artifacts.manifest",
    "ParityResult": "parity",
    "Verification": "artifacts.verify",
    "verify_dir": "artifacts.verify",
    "check_dir": "check",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
