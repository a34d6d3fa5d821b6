"""TensorRT engines of an export directory (docs/commands.md, kiln build): ``kiln build DIR``.

One strongly typed engine per graph, ``engines/prefill.plan`` and ``engines/decode.plan``, each with
one optimization profile from the manifest's limits; from the ``--target onnx`` graphs
(``engines/prefill.std.plan``, ``engines/decode.std.plan``) where the export has them and TensorRT
is 10.15+ (``graphs``: ``--graphs auto|portable|onnx``); ``engines/engines.json`` records the files
(sha256), the graph set and why, TensorRT, CUDA, GPU and compute capability and the profile
shapes; ``engines/trtexec.sh`` holds the equivalent trtexec commands (both sets, and the same
choice made by trtexec's version) and is written even where TensorRT is not installed.

``tensorrt`` is imported only inside functions (``build.load_tensorrt``): importing this package
never imports it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from kiln.errors import ArtifactError, ConfigError, EngineError
from kiln.exporter.artifacts.manifest import Manifest
from kiln.exporter.artifacts.staging import Owner
from kiln.exporter.artifacts.verify import unlisted
from kiln.exporter.engine import compat
from kiln.exporter.engine.build import build_engines, load_tensorrt
from kiln.exporter.engine.graphs import GraphChoice, choose_graphs, has_onnx_graphs, require_onnx_graphs
from kiln.exporter.engine.options import BuildOptions, GraphSet, HardwareCompat, parse_size
from kiln.exporter.engine.profiles import ENGINE_GRAPHS, EngineProfile, engine_file, engine_profiles
from kiln.exporter.engine.records import (
    ENGINES_JSON,
    RuntimeInfo,
    check_engine_compat,
    read_records,
    update_manifest,
)
from kiln.exporter.engine.runner import TrtRunner
from kiln.exporter.engine.static_runner import StaticTrtRunner
from kiln.exporter.engine.trtexec import (
    DEFAULT_TIMING_CACHE,
    SCRIPT,
    script_cache_note,
    timing_cache_path,
    write_script,
)
from kiln.newfile import target_of_temporary

__all__ = [
    "BuildOptions",
    "GraphSet",
    "HardwareCompat",
    "RuntimeInfo",
    "TrtRunner",
    "StaticTrtRunner",
    "open_engines",
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
        foreign = [
            f for f in unlisted(engines.parent, manifest, engines.name) if f not in own and not _temporary_of(f, own)
        ]
        if not foreign:
            return None
        more = f" (and {len(foreign) - 5} more)" if len(foreign) > 5 else ""
        return (
            f"kiln build writes only its own files in {_ENGINES}, and manifest.json does not list "
            f"{', '.join(foreign[:5])}{more}"
        )

    return owner


def _own_files(directory: Path, options: BuildOptions) -> set[str]:
    """What kiln build writes (paths relative to the export): the engines of either graph set, their
    record, the script, the timing cache when it lives in the export, and each one's temporary name."""
    engines = {engine_file(kind, graphs) for kind in ENGINE_GRAPHS for graphs in (GraphSet.PORTABLE, GraphSet.ONNX)}
    own = engines | {SCRIPT, ENGINES_JSON, DEFAULT_TIMING_CACHE}
    cache, root = timing_cache_path(directory, options).absolute(), directory.absolute()
    if cache.is_relative_to(root):
        own.add(_cache_in_engines(cache.relative_to(root).as_posix(), options))
    return own


def _temporary_of(relative: str, own: set[str]) -> bool:
    """Whether ``relative`` is the temporary file of one of kiln build's own files (written first, then
    renamed into place: a killed build leaves it)."""
    path = Path(relative)
    target = target_of_temporary(path.name)
    return target is not None and (path.parent / target).as_posix() in own


def _cache_in_engines(relative: str, options: BuildOptions) -> str:
    """A timing cache inside the export lives in ``engines/``, the folder kiln build writes:
    elsewhere it would overwrite one of the export's files (``onnx/weights.bin`` was taken)."""
    if not relative.startswith(_ENGINES):
        raise ConfigError(
            f"--timing-cache {options.timing_cache}: inside the export but outside {_ENGINES}, which is all kiln "
            f"build writes; name a file in {_ENGINES} or outside the export"
        )
    return relative


ProfileSets = dict[GraphSet, tuple[EngineProfile, ...]]


def prepare(directory: Path, options: BuildOptions) -> tuple[Manifest, ProfileSets, Path]:
    """Check the directory, derive the profiles of each graph set it holds (the portable graphs,
    and ``--target onnx``'s when its manifest has ``targets.onnx``) and write ``engines/trtexec.sh``
    (no TensorRT needed). ``--graphs onnx`` on an export without those graphs is refused first."""
    from kiln.exporter.artifacts import manifest as manifest_mod
    from kiln.exporter.artifacts.staging import require_replaceable
    from kiln.exporter.artifacts.verify import require_verified

    manifest = manifest_mod.read(directory)
    if manifest.model.has_encoder:
        raise ArtifactError(
            f"{directory}: TensorRT engines for encoder-decoders are not built yet (the encoder graph would need "
            "its own engine,"
            " and engine parity a runner for it); run the graphs on ONNX Runtime (kiln generate) or build "
            "onnx/*.onnx with trtexec yourself"
        )
    require_onnx_graphs(manifest, options.graphs)
    sets: ProfileSets = {GraphSet.PORTABLE: engine_profiles(manifest, options)}
    if has_onnx_graphs(manifest):
        sets[GraphSet.ONNX] = engine_profiles(manifest, options, GraphSet.ONNX)
    require_replaceable(directory / _ENGINES, True, _kiln_build_wrote(manifest, _own_files(directory, options)))
    manifest = require_verified(directory, rewritten=_ENGINES)  # that folder is what kiln build rewrites
    for profile in (p for profiles in sets.values() for p in profiles):
        if not (directory / profile.onnx).is_file():
            raise ArtifactError(f"{directory / profile.onnx}: graph file missing; re-export the directory")
    return manifest, sets, write_script(directory, sets[GraphSet.PORTABLE], options, sets.get(GraphSet.ONNX))


def _one_line(exc: EngineError) -> str:
    return " ".join(str(exc.args[0] if exc.args else exc).split())


def write_trtexec_or_raise(directory: Path, options: BuildOptions) -> tuple[GraphChoice, tuple[EngineProfile, ...]]:
    """Write ``engines/trtexec.sh``, then import TensorRT and choose the graph set for its version
    (``graphs.choose_graphs``); where TensorRT is missing, or refuses ``--graphs onnx``, record the
    script in the manifest and raise one ``EngineError`` saying so in one line and what to do.
    Returns the choice and its engine profiles."""
    manifest, sets, script = prepare(directory, options)
    try:
        trt = load_tensorrt()
        choice = choose_graphs(manifest, options.graphs, compat.trt_version(trt))
    except EngineError as exc:
        update_manifest(directory, None)
        both = (
            " (it builds the --target onnx graphs where trtexec is TensorRT 10.15+, else the portable ones)"
            if GraphSet.ONNX in sets
            else ""
        )
        raise EngineError(f"{_one_line(exc)} (wrote {script}{both}{script_cache_note(directory, options)})") from None
    return choice, sets[choice.graphs]


def build_command(directory: Path, options: BuildOptions) -> dict[str, Any]:
    """``kiln build DIR``: both engines of the chosen graph set, engines.json, trtexec.sh and the
    manifest's record of them. Returns a JSON-ready summary."""
    choice, profiles = write_trtexec_or_raise(directory, options)
    try:
        records = build_engines(directory, options, profiles, choice)
    except BaseException:
        with contextlib.suppress(Exception):  # never hide the build's own error
            update_manifest(directory, None)  # kiln verify keeps matching what is on disk
        raise
    update_manifest(directory, records, choice.to_dict())
    return {
        "directory": str(directory),
        "record": ENGINES_JSON,
        "trtexec": SCRIPT,
        "graphs": choice.to_dict(),
        "engines": {kind: record.to_dict() for kind, record in records.items()},
    }


def open_engines(directory: Path, extra_feeds: Any = None) -> TrtRunner | StaticTrtRunner:
    """The runner of ``DIR``'s engines, as engines.json records them: ``TrtRunner`` for engines of
    the portable graphs, ``StaticTrtRunner`` (the static-cache contract, one buffer bound as past
    and present) for those of the ``--target onnx`` graphs."""
    graphs = read_records(directory).get("graphs", {}).get("set", GraphSet.PORTABLE.value)
    if graphs == GraphSet.ONNX.value:
        return StaticTrtRunner.from_directory(directory, extra_feeds)
    return TrtRunner.from_directory(directory, extra_feeds)
