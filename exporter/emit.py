"""The emit stage (docs/how-it-works.md): everything of an export besides its graphs, written into
the staged directory from the ``ExportReport``, after parity: the parity reports, the tokenizer, the serving configs
(ONNX Runtime GenAI's, and the Triton repository with ``--triton``), the family's files for
consumers (a Hugging Face checkpoint's ``config.json`` and ``generation_config.json``, which
Optimum reads beside ``model.onnx``) and, last, the manifest with the sha256 of every file (each
file is hashed once, here)."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

from kiln.errors import ArtifactError
from kiln.exporter.artifacts.build import build_manifest
from kiln.exporter.artifacts.hashing import hash_tree, sha256_file
from kiln.exporter.artifacts.layout import ONNX_DIR, REPORTS_DIR, TOKENIZER
from kiln.exporter.artifacts.manifest import MANIFEST, Manifest, write
from kiln.exporter.parity.report import write_parity_reports
from kiln.exporter.report import ExportReport
from kiln.exporter.serving.genai import genai_refusal, write_genai_config
from kiln.exporter.serving.triton import write_triton_models

__all__ = ["write_artifacts"]


def write_artifacts(root: Path, report: ExportReport, digest: Callable[[Path], str] = sha256_file) -> Manifest:
    """Write the reports, serving configs and manifest of the export staged in ``root``; ``digest``:
    a file's sha256 (the export's ``HashAhead.digest``: the graphs hashed beside parity)."""
    write_parity_reports(report.parity, root / REPORTS_DIR, report.parity_extras())
    if report.tokenizer is not None:
        shutil.copyfile(report.tokenizer, root / TOKENIZER)
    for source in report.serving_files:  # e.g. Hugging Face's config.json: Optimum loads onnx/ as written
        target = root / ONNX_DIR / source.name
        if target.exists():
            raise ArtifactError(
                f"{source}: the family asks for {source.name} beside the graphs, where kiln already wrote one"
            )
        shutil.copyfile(source, target)
    manifest = build_manifest(report, root)
    # GenAI's decoder-only models have no way to feed a cross cache, nor a cache of per-tensor shapes (genai_refusal)
    if report.spec.encoder_dim is None and genai_refusal(manifest) is None:
        write_genai_config(root / ONNX_DIR, manifest)  # beside model.onnx
    if report.options.triton is not None:
        write_triton_models(root, manifest, report.options.triton)
    manifest = dataclasses.replace(manifest, files=hash_tree(root, exclude=(MANIFEST,), digest=digest))
    write(root, manifest)
    return manifest
