"""``manifest.json``: the contract between an export directory and whoever serves it.

It holds everything a host needs without reading Python: graph files with their I/O names,
dtypes and shapes (named dims), KV layout, limits, precision, special token ids, the sha256 of
every file, and the tool versions. It has no timestamps, so the same export gives the same file.
"""

from __future__ import annotations

import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from kiln import __version__
from kiln.errors import ArtifactError
from kiln.jsonfile import read_json_object
from kiln.exporter.artifacts import hash_tree, sha256_file
from kiln.exporter.io_contract import GraphKind, graph_io
from kiln.exporter.options import ExportOptions
from kiln.exporter.precision import Fp16Policy
from kiln.exporter.parity import ParityResult
from kiln.exporter.weights import SharedWeights
from kiln.plugins import LoadedModel

__all__ = ["MANIFEST", "MANIFEST_VERSION", "build", "write", "read", "tool_versions"]

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
_TOOLS = ("torch", "onnx", "onnx-ir", "onnxscript", "onnxruntime", "polygraphy")


def tool_versions() -> dict[str, str]:
    out = {"kiln": __version__, "python": platform.python_version()}
    for name in _TOOLS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def build(
    root: Path,
    loaded: LoadedModel,
    options: ExportOptions,
    *,
    max_context: int,
    weights: SharedWeights,
    table_shapes: tuple[tuple[int, int], ...],
    parity: ParityResult,
    model_ref: str | None,
    kept_fp32: dict[str, dict[str, list[str]]],
    policy: Fp16Policy,
    int8_nodes: dict[str, list[str]],
    calibration: dict[str, Any] | None,
    ort_target: dict[str, Any] | None = None,
) -> dict[str, Any]:
    spec = loaded.spec
    graphs: dict[str, Any] = {}
    for kind in GraphKind:
        io_spec = graph_io(spec, kind, last_logits_only=options.last_logits_only, ple_tables=table_shapes, kv_dtype=options.precision.kv_dtype)
        graphs[kind.value] = {
            "file": f"onnx/{kind.value}.onnx",
            "inputs": [t.to_dict() for t in io_spec.inputs],
            "outputs": [t.to_dict() for t in io_spec.outputs],
        }
        if kind.value in int8_nodes:
            graphs[kind.value]["int8_nodes"] = int8_nodes[kind.value]
        if kind.value in kept_fp32:
            graphs[kind.value]["fp32_nodes"] = kept_fp32[kind.value]["nodes"]
            graphs[kind.value]["fp32_ple_tables"] = kept_fp32[kind.value]["tables"]
    tokenizer = "onnx/tokenizer.json" if (root / "onnx" / "tokenizer.json").is_file() else None
    manifest: dict[str, Any] = {
        "manifest_version": MANIFEST_VERSION,
        "family": spec.family,
        "checkpoint": {
            "reference": model_ref,
            "files": {p.name: sha256_file(p) for p in loaded.files},
        },
        "config": spec.config,
        "model": {
            "n_layers": spec.n_layers,
            "n_kv_heads": spec.n_kv_heads,
            "head_dim": spec.head_dim,
            "vocab_size": spec.vocab_size,
            "bos_token_id": spec.bos_token_id,
            "eos_token_id": spec.eos_token_id,
            "pad_token_id": spec.pad_token_id,
            "encoder_dim": spec.encoder_dim,
        },
        "precision": options.precision.value,
        "kv_cache": {"layout": "BNSH", "dims": ["batch", "n_kv_heads", "seq", "head_dim"], "dtype": options.precision.kv_dtype},
        "limits": {"max_batch": options.max_batch, "max_context": max_context},
        "export": {
            "opset": options.opset,
            "keep_fp32": list(policy.keep) if options.precision.has_fp16 else [],
            "calibration": calibration,
            "logits": options.logits.value,
            "ple": None
            if spec.ple_positions is None
            else {
                "folded": True,
                "trained_rows": spec.ple_positions,
                "rows": options.ple_extend or spec.ple_positions,
                "extend_mode": options.ple_extend_mode.value if options.ple_extend else None,
                "tables": options.ple_tables.value,
            },
        },
        "graphs": graphs,
        "weights": {"file": f"onnx/{weights.path.name}", "tensors": weights.tensors, "bytes": weights.bytes},
        "tokenizer": tokenizer,
        "parity": {"passed": parity.passed, "report": "reports/parity.json"},
        "tools": tool_versions(),
        "files": hash_tree(root, exclude=(MANIFEST,)),
    }
    if ort_target is not None:  # --target ort: the ONNX Runtime-target graphs beside the portable ones
        manifest["targets"] = {"ort": ort_target}
    return manifest


def write(root: Path, manifest: dict[str, Any]) -> Path:
    path = root / MANIFEST
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def read(root: Path) -> dict[str, Any]:
    """Read and minimally check a manifest; the error says what is wrong with the directory."""
    path = root / MANIFEST
    if not root.is_dir():
        raise ArtifactError(f"{root}: not a directory")
    data = read_json_object(path, ArtifactError, f"{root}: no {MANIFEST}; is this a kiln export directory?")
    version = data.get("manifest_version")
    if version != MANIFEST_VERSION:
        raise ArtifactError(f"{path}: manifest_version {version!r} is not supported (this kiln reads version {MANIFEST_VERSION}); re-export with this kiln")
    return data

