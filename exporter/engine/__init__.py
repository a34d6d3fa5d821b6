"""TensorRT engines of an export directory (design.md section 6): ``kiln build DIR``.

One strongly typed engine per graph, ``engines/prefill.plan`` and ``engines/decode.plan``, each with
one optimization profile from the manifest's limits; ``engines/engines.json`` records the files
(sha256), TensorRT, CUDA, GPU and compute capability and the profile shapes; ``engines/trtexec.sh``
holds the equivalent trtexec commands and is written even where TensorRT is not installed.

``tensorrt`` is imported only inside functions (``build.load_tensorrt``): importing this package
never imports it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from kiln.errors import ArtifactError, EngineError
from kiln.exporter.artifacts.manifest import Manifest
from kiln.exporter.engine.build import build_engines, load_tensorrt
from kiln.exporter.engine.options import BuildOptions, HardwareCompat, parse_size
from kiln.exporter.engine.profiles import EngineProfile, engine_profiles
from kiln.exporter.engine.records import (
    ENGINES_JSON,
    RuntimeInfo,
    check_engine_compat,
    update_manifest,
)
from kiln.exporter.engine.runner import TrtRunner
from kiln.exporter.engine.trtexec import SCRIPT, write_script

__all__ = [
    "BuildOptions",
    "HardwareCompat",
    "RuntimeInfo",
    "TrtRunner",
    "parse_size",
    "engine_profiles",
    "build_engines",
    "check_engine_compat",
    "prepare",
    "write_trtexec_or_raise",
    "build_command",
]

_ENGINES = "engines/"


def prepare(directory: Path, options: BuildOptions) -> tuple[Manifest, tuple[EngineProfile, ...], Path]:
    """Check the directory, derive both profiles and write ``engines/trtexec.sh`` (no TensorRT needed)."""
    from kiln.exporter.artifacts.verify import require_verified

    manifest = require_verified(directory, rewritten=_ENGINES)  # that folder is what kiln build rewrites
    profiles = engine_profiles(manifest, options)
    for profile in profiles:
        if not (directory / profile.onnx).is_file():
            raise ArtifactError(f"{directory / profile.onnx}: graph file missing; re-export the directory")
    return manifest, profiles, write_script(directory, profiles, options)


def write_trtexec_or_raise(directory: Path, options: BuildOptions) -> tuple[EngineProfile, ...]:
    """Write ``engines/trtexec.sh``, then import TensorRT; where it is missing, record the script in
    the manifest and raise one ``EngineError`` saying so in one line and how to install it.
    Returns both engine profiles."""
    _, profiles, script = prepare(directory, options)
    try:
        load_tensorrt()
    except EngineError as exc:
        update_manifest(directory, None)
        message = " ".join(str(exc.args[0] if exc.args else exc).split())  # one line
        raise EngineError(f"{message} (wrote {script})") from None
    return profiles


def build_command(directory: Path, options: BuildOptions) -> dict[str, Any]:
    """``kiln build DIR``: both engines, engines.json, trtexec.sh and the manifest's record of them.
    Returns a JSON-ready summary."""
    profiles = write_trtexec_or_raise(directory, options)
    try:
        records = build_engines(directory, options, profiles)
    except BaseException:
        with contextlib.suppress(Exception):  # never hide the build's own error
            update_manifest(directory, None)  # kiln verify keeps matching what is on disk
        raise
    update_manifest(directory, records)
    return {
        "directory": str(directory),
        "record": ENGINES_JSON,
        "trtexec": SCRIPT,
        "engines": {kind: record.to_dict() for kind, record in records.items()},
    }
