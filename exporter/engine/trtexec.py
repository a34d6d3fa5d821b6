"""The ``trtexec`` command equivalent to each engine build, written to ``engines/trtexec.sh``.

Flags checked against trtexec's option parser, ``samples/common/sampleOptions.cpp`` of NVIDIA/TensorRT
(``release/10.12``, ``release/10.13`` and ``main`` = 11.1): ``--minShapes/--optShapes/--maxShapes``
(``name:AxB,...``), ``--memPoolSize=workspace:<N>M``, ``--builderOptimizationLevel``,
``--timingCacheFile``, ``--hardwareCompatibilityLevel=none|ampere+|sameComputeCapability``,
``--versionCompatible``, ``--refit``, ``--noTF32``, ``--skipInference`` and ``--stronglyTyped``
(10.x: "Create a strongly typed network"; 11.x help: "[Deprecated] ... This flag is a no-op").
The script works without TensorRT: it only needs the export directory and a trtexec binary.
"""

from __future__ import annotations

import os
import shlex
import stat
from collections.abc import Sequence
from pathlib import Path

from kiln.errors import ConfigError
from kiln.exporter.engine.gpus import gpu_note
from kiln.exporter.engine.options import MIB, BuildOptions, HardwareCompat
from kiln.exporter.engine.profiles import EngineProfile, InputShape, Shape

__all__ = ["SCRIPT", "DEFAULT_TIMING_CACHE", "timing_cache_path", "trtexec_args", "trtexec_command", "render_script", "write_script"]

SCRIPT = "engines/trtexec.sh"
DEFAULT_TIMING_CACHE = "engines/timing.cache"
# trtexec's spelling of each level (sampleOptions.cpp: "none" | "ampere+" | "sameComputeCapability")
_HARDWARE = {
    HardwareCompat.NONE: "none",
    HardwareCompat.AMPERE_PLUS: "ampere+",
    HardwareCompat.SAME_CC: "sameComputeCapability",
}
_UNSAFE_NAME = set(":,' \t\n\"=")  # trtexec splits shape lists on ',' and name from dims on ':'


def timing_cache_path(directory: Path, options: BuildOptions) -> Path:
    """The timing cache the Python build reads and writes (shared by both engines)."""
    return options.timing_cache if options.timing_cache is not None else directory / DEFAULT_TIMING_CACHE


def _script_cache(directory: Path, options: BuildOptions) -> str:
    """The cache path inside the script: relative to the export directory when the cache lives
    in it, else the default (a cache outside DIR does not travel with it to the GPU machine)."""
    path = timing_cache_path(directory, options)
    try:
        return path.absolute().relative_to(directory.absolute()).as_posix()
    except ValueError:
        return DEFAULT_TIMING_CACHE


def _dims(shape: Shape) -> str:
    return "x".join(str(d) for d in shape)


def _shapes(inputs: Sequence[InputShape], which: str) -> str:
    parts = []
    for spec in inputs:
        if _UNSAFE_NAME & set(spec.name):
            raise ConfigError(f"input name {spec.name!r} cannot be written as a trtexec shape (it has one of : , ' = or a space)")
        shape: Shape = getattr(spec, which)
        parts.append(f"{spec.name}:{_dims(shape)}")
    return ",".join(parts)


def _mem(nbytes: int) -> str:
    if nbytes % MIB == 0:
        return f"{nbytes // MIB}M"
    if nbytes % 1024 == 0:
        return f"{nbytes // 1024}K"
    return f"{nbytes}B"


def trtexec_args(profile: EngineProfile, options: BuildOptions, timing_cache: str = DEFAULT_TIMING_CACHE) -> list[str]:
    """The trtexec arguments (without ``trtexec``) that build ``profile`` as ``kiln build`` does."""
    args = [
        f"--onnx={profile.onnx}",
        f"--saveEngine={profile.engine}",
        f"--minShapes={_shapes(profile.inputs, 'min')}",
        f"--optShapes={_shapes(profile.inputs, 'opt')}",
        f"--maxShapes={_shapes(profile.inputs, 'max')}",
        f"--timingCacheFile={timing_cache}",
        f"--memPoolSize=workspace:{_mem(options.workspace)}",
        f"--builderOptimizationLevel={options.opt_level}",
        "--stronglyTyped",  # TensorRT 10.x: precision as the ONNX types it; 11.x: a no-op (always strongly typed)
        "--noTF32",  # FP32 tensors stay FP32 (TF32 is on by default), as in the Python build
        f"--hardwareCompatibilityLevel={_HARDWARE[options.hardware_compat]}",
    ]
    if options.version_compatible:
        args.append("--versionCompatible")
    if options.refittable:
        args.append("--refit")
    args.append("--skipInference")  # build only, like kiln build
    return args


def trtexec_command(profile: EngineProfile, options: BuildOptions, timing_cache: str = DEFAULT_TIMING_CACHE) -> str:
    """One shell line: ``trtexec --onnx=... --saveEngine=... ...``."""
    return shlex.join(["trtexec", *trtexec_args(profile, options, timing_cache)])


def render_script(profiles: Sequence[EngineProfile], options: BuildOptions, timing_cache: str = DEFAULT_TIMING_CACHE, precision: str | None = None) -> str:
    """The text of ``engines/trtexec.sh``: one trtexec command per engine, run from the export
    directory (``precision``: the export's, for the note on which GPUs build it)."""
    lines = [
        "#!/usr/bin/env bash",
        "# Builds this export's TensorRT engines with trtexec; written by `kiln build`, equivalent to it.",
        "# Copy the whole export directory to a machine with an NVIDIA GPU and TensorRT, then run",
        "#   bash engines/trtexec.sh",
        "# Paths are relative to the export directory (the script changes to it first).",
        "# --stronglyTyped is for TensorRT 10.x (precision comes from the ONNX types); on 11.x every",
        "# network is strongly typed and the flag is a no-op. No precision flags: int8/int4/fp8 are Q/DQ in the ONNX.",
        *([note] if (note := gpu_note(precision or "")) is not None else []),
        "set -euo pipefail",
        'cd "$(dirname "$0")/.."',
        "mkdir -p engines",
    ]
    for profile in profiles:
        args = trtexec_args(profile, options, timing_cache)
        lines.append("")
        lines.append(f"# {profile.kind.value}: {profile.onnx} -> {profile.engine}")
        lines.append("trtexec \\")
        lines.extend(f"  {shlex.quote(arg)} \\" for arg in args[:-1])
        lines.append(f"  {shlex.quote(args[-1])}")
    return "\n".join(lines) + "\n"


def write_script(directory: Path, profiles: Sequence[EngineProfile], options: BuildOptions) -> Path:
    """Write ``DIR/engines/trtexec.sh`` (mode 755) and return its path."""
    path = directory / SCRIPT
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    from kiln.exporter.artifacts import manifest as manifest_mod

    precision = manifest_mod.read(directory).precision if (directory / manifest_mod.MANIFEST).is_file() else None
    tmp.write_text(render_script(profiles, options, _script_cache(directory, options), precision))
    mode = tmp.stat().st_mode
    tmp.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.replace(tmp, path)
    return path
