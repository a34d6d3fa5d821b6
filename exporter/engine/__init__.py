"""TensorRT engines of an export directory (docs/commands.md, kiln build): ``kiln build DIR``.

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
from kiln.exporter.artifacts.staging import Owner
from kiln.exporter.artifacts.verify import unlisted
from kiln.exporter.engine.trtexec import DEFAULT_TIMING_CACHE, SCRIPT, timing_cache_path, write_script

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


def _kiln_build_wrote(manifest: Manifest, own: set[str]) -> Owner:
    """The replacement rule (``artifacts.staging``) for ``engines/``, which kiln build writes in
    place: every file there is one the manifest lists or one kiln build writes by name (``own``:
    what a build killed before it recorded its files leaves, or trtexec.sh's own output); a file
    of anything else is never overwritten or recorded."""

    def owner(engines: Path) -> str | None:
        foreign = [f for f in unlisted(engines.parent, manifest, engines.name) if f not in own]
        if not foreign:
            return None
        more = f" (and {len(foreign) - 5} more)" if len(foreign) > 5 else ""
        return f"kiln build writes only its own files in {_ENGINES}, and manifest.json does not list {', '.join(foreign[:5])}{more}"

    return owner


def _own_files(directory: Path, profiles: tuple[EngineProfile, ...], options: BuildOptions) -> set[str]:
    """What kiln build writes (paths relative to the export): the engines, their record, the
    script, the timing cache when it lives in the export, and each one's temporary name."""
    own = {p.engine for p in profiles} | {SCRIPT, ENGINES_JSON, DEFAULT_TIMING_CACHE}
    cache, root = timing_cache_path(directory, options).absolute(), directory.absolute()
    if cache.is_relative_to(root):
        own.add(cache.relative_to(root).as_posix())
    return own | {f"{Path(f).parent.as_posix()}/.{Path(f).name}.tmp" for f in own}  # written first, then renamed into place


def prepare(directory: Path, options: BuildOptions) -> tuple[Manifest, tuple[EngineProfile, ...], Path]:
    """Check the directory, derive both profiles and write ``engines/trtexec.sh`` (no TensorRT needed)."""
    from kiln.exporter.artifacts import manifest as manifest_mod
    from kiln.exporter.artifacts.staging import require_replaceable
    from kiln.exporter.artifacts.verify import require_verified

    manifest = manifest_mod.read(directory)
    if manifest.model.has_encoder:
        raise ArtifactError(
            f"{directory}: TensorRT engines for encoder-decoders are not built yet (the encoder graph would need its own engine,"
            " and engine parity a runner for it); run the graphs on ONNX Runtime (kiln generate) or build onnx/*.onnx with trtexec yourself"
        )
    profiles = engine_profiles(manifest, options)
    require_replaceable(directory / _ENGINES, True, _kiln_build_wrote(manifest, _own_files(directory, profiles, options)))
    manifest = require_verified(directory, rewritten=_ENGINES)  # that folder is what kiln build rewrites
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
