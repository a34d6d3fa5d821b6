"""``engines/engines.json``: what was built, by which TensorRT, for which GPU; and the check that
refuses to load an engine somewhere it cannot run.

Compatibility rules (TensorRT "Engine Compatibility", docs.nvidia.com/deeplearning/tensorrt/
11.1.0/inference-library/engine-compatibility.html, and the 11.4.1 support matrix):

- By default an engine runs only on the TensorRT version that built it (major, minor, patch and
  build must match). A ``--version-compatible`` engine also runs on later versions of the same
  major, and TensorRT 10 version-compatible engines run on an 11 runtime (8 -> 10 likewise).
- ``--hardware-compat none`` and ``same-cc``: the compute capability it was built on;
  ``ampere+``: compute capability 8.0 or newer.

Everything here is pure (no TensorRT, no GPU) so that it can be unit-tested.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.errors import ArtifactError, EngineError
from kiln.exporter.artifacts.manifest import EnginesEntry, Manifest
from kiln.exporter.engine.compat import version_tuple
from kiln.exporter.engine.options import HardwareCompat
from kiln.jsonfile import read_json_object
from kiln.newfile import new_output

__all__ = [
    "ENGINES_JSON",
    "ENGINES_VERSION",
    "RuntimeInfo",
    "EngineRecord",
    "compat_problems",
    "check_engine_compat",
    "write_records",
    "read_records",
    "update_manifest",
]

ENGINES_JSON = "engines/engines.json"
ENGINES_VERSION = 1
_ENGINES_PREFIX = "engines/"
_CROSS_MAJOR = {(8, 10), (10, 11)}  # version-compatible plans across majors (11.4.1 support matrix)
_AMPERE = (8, 0)


@dataclasses.dataclass(frozen=True)
class RuntimeInfo:
    """The TensorRT, CUDA and GPU of a machine (where an engine is built or loaded)."""

    tensorrt: str  # tensorrt.__version__, e.g. "10.13.0.35"
    cuda: str | None  # CUDA runtime version, e.g. "12.9"; None if unknown
    gpu: str  # device name, e.g. "NVIDIA H200"
    compute_capability: str  # "9.0"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RuntimeInfo:
        cuda = data.get("cuda")
        return cls(
            str(data["tensorrt"]),
            None if cuda is None else str(cuda),
            str(data["gpu"]),
            str(data["compute_capability"]),
        )


@dataclasses.dataclass(frozen=True)
class EngineRecord:
    """One built engine; ``profiles`` maps each input to its dtype and min/opt/max shapes."""

    kind: str  # "prefill" | "decode"
    file: str  # relative to the export directory
    sha256: str
    bytes: int
    onnx: str
    onnx_sha256: str
    built_with: RuntimeInfo
    hardware_compat: str  # HardwareCompat value
    version_compatible: bool
    refittable: bool
    tf32: bool
    profiles: tuple[dict[str, dict[str, Any]], ...]
    device_memory_bytes: int | None = None
    weights_bytes: int | None = None
    graphs: str = "portable"  # GraphSet value: the portable graphs or --target onnx's (the static-cache contract)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "file": self.file,
            "sha256": self.sha256,
            "bytes": self.bytes,
            "onnx": self.onnx,
            "onnx_sha256": self.onnx_sha256,
            "graphs": self.graphs,
            "tensorrt": self.built_with.tensorrt,
            "cuda": self.built_with.cuda,
            "gpu": self.built_with.gpu,
            "compute_capability": self.built_with.compute_capability,
            "hardware_compat": self.hardware_compat,
            "version_compatible": self.version_compatible,
            "refittable": self.refittable,
            "tf32": self.tf32,
            "strongly_typed": True,
            "profiles": list(self.profiles),
            "device_memory_bytes": self.device_memory_bytes,
            "weights_bytes": self.weights_bytes,
        }


def _cc(text: str) -> tuple[int, int] | None:
    parts = version_tuple(text)
    return (parts[0], parts[1]) if len(parts) >= 2 else None


def compat_problems(engine_record: Mapping[str, Any], runtime_info: RuntimeInfo) -> list[str]:
    """Why the engine of ``engine_record`` (one entry of engines.json) cannot run on
    ``runtime_info``: each message says what was found and what is needed. Empty: it can."""
    problems: list[str] = []
    name = engine_record.get("file", "engine")
    built = str(engine_record.get("tensorrt", "?"))
    here = runtime_info.tensorrt
    built_v, here_v = version_tuple(built), version_tuple(here)
    if engine_record.get("version_compatible"):
        same_or_allowed = bool(built_v and here_v) and (
            built_v[0] == here_v[0] or (built_v[0], here_v[0]) in _CROSS_MAJOR
        )
        if not (same_or_allowed and here_v >= built_v):
            major = built_v[0] if built_v else "?"
            later = "".join(f" or any {to}.x" for frm, to in sorted(_CROSS_MAJOR) if frm == major)
            problems.append(
                f"{name} is a version-compatible engine built by TensorRT {built}: it needs TensorRT {built} or "
                "a later "
                f"{major}.x{later}, found TensorRT {here}; rebuild it here with kiln build"
            )
    elif built_v != here_v:
        problems.append(
            f"{name} was built by TensorRT {built} and needs exactly that version, found TensorRT {here}; "
            f"pip install tensorrt=={built}, or rebuild it here with kiln build (--version-compatible makes "
            "engines that run on later versions)"
        )
    level = str(engine_record.get("hardware_compat", HardwareCompat.NONE.value))
    built_cc_text = str(engine_record.get("compute_capability", "?"))
    built_cc, here_cc = _cc(built_cc_text), _cc(runtime_info.compute_capability)
    gpu = engine_record.get("gpu", "?")
    if level == HardwareCompat.AMPERE_PLUS.value:
        if here_cc is None or here_cc < _AMPERE:
            problems.append(
                f"{name} was built with --hardware-compat ampere+ and needs compute capability 8.0 or newer, "
                f"found {runtime_info.compute_capability} ({runtime_info.gpu})"
            )
    elif built_cc is None or here_cc != built_cc:
        problems.append(
            f"{name} was built for compute capability {built_cc_text} ({gpu}) and needs a GPU of that compute "
            "capability, "
            f"found {runtime_info.compute_capability} ({runtime_info.gpu}); rebuild it here with kiln build, "
            f"or build with --hardware-compat ampere+ for any GPU of compute capability 8.0 or newer"
        )
    return problems


def check_engine_compat(engine_record: Mapping[str, Any], runtime_info: RuntimeInfo) -> None:
    """Refuse (``EngineError``) an engine built by another TensorRT version or for another
    compute capability than ``runtime_info``'s."""
    problems = compat_problems(engine_record, runtime_info)
    if problems:
        raise EngineError("; ".join(problems))


def write_records(
    directory: Path,
    records: Mapping[str, EngineRecord],
    build_options: Mapping[str, Any],
    trtexec: str,
    graphs: Mapping[str, str] | None = None,
) -> Path:
    """Write ``DIR/engines/engines.json`` (no timestamps) and return its path; ``graphs``: the graph
    set the engines were built from and why (``GraphChoice.to_dict``)."""
    path = directory / ENGINES_JSON
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "engines_version": ENGINES_VERSION,
        "build_options": dict(build_options),
        "graphs": dict(graphs) if graphs is not None else {"set": "portable", "reason": "not recorded"},
        "engines": {kind: record.to_dict() for kind, record in records.items()},
        "trtexec": trtexec,
    }
    with new_output(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
    return path


def read_records(directory: Path) -> dict[str, Any]:
    """The parsed ``engines.json`` of an export directory, or one clear error."""
    path = directory / ENGINES_JSON
    data = read_json_object(
        path, ArtifactError, f"{directory}: no {ENGINES_JSON}; run kiln build {directory} on a machine with TensorRT"
    )
    if data.get("engines_version") != ENGINES_VERSION or not isinstance(data.get("engines"), dict):
        raise ArtifactError(
            f"{path}: not an engines.json of version {ENGINES_VERSION}; rebuild with kiln build {directory}"
        )
    return data


def update_manifest(
    directory: Path, records: Mapping[str, EngineRecord] | None, graphs: Mapping[str, str] | None = None
) -> Manifest:
    """Record the files under ``engines/`` (sha256) in ``manifest.json`` so that ``kiln verify``
    still passes, and, after a build (``records``), the engines with their TensorRT, CUDA and GPU
    and the graph set they were built from (``graphs``: ``GraphChoice.to_dict``) under
    ``manifest.engines``; without engines.json that entry is dropped. Returns the manifest."""
    from kiln.exporter.artifacts import manifest as manifest_mod
    from kiln.exporter.artifacts.hashing import rehash_subtree

    manifest = manifest_mod.read(directory)
    engines = manifest.engines
    if not (directory / ENGINES_JSON).is_file():
        engines = None  # no (or a failed) build: nothing to record
    elif records:
        first_record = next(iter(records.values()))
        first = first_record.built_with
        chosen = graphs or {"set": first_record.graphs, "reason": "not recorded"}
        engines = EnginesEntry(
            ENGINES_JSON,
            first.tensorrt,
            first.cuda,
            first.gpu,
            first.compute_capability,
            {kind: r.file for kind, r in records.items()},
            chosen["set"],
            chosen["reason"],
        )
    manifest = dataclasses.replace(
        manifest, files=rehash_subtree(manifest.files, directory, _ENGINES_PREFIX.rstrip("/")), engines=engines
    )
    manifest_mod.write(directory, manifest)
    return manifest
