"""The ``trtexec`` command equivalent to each engine build, written to ``engines/trtexec.sh``.

Flags checked against trtexec's option parser, ``samples/common/sampleOptions.cpp`` of NVIDIA/TensorRT
(``release/10.12``, ``release/10.13`` and ``main`` = 11.1): ``--minShapes/--optShapes/--maxShapes``
(``name:AxB,...``), ``--memPoolSize=workspace:<N>M``, ``--builderOptimizationLevel``,
``--timingCacheFile``, ``--hardwareCompatibilityLevel=none|ampere+|sameComputeCapability``,
``--versionCompatible``, ``--refit``, ``--noTF32``, ``--skipInference`` and ``--stronglyTyped``
(10.x: "Create a strongly typed network"; 11.x help: "[Deprecated] ... This flag is a no-op").
The script works without TensorRT: it only needs the export directory and a trtexec binary.
For an export with ``--target onnx`` graphs it holds both graph sets and chooses between them as
``kiln build --graphs`` does (``engine.graphs``), from trtexec's own version line, unless
``KILN_GRAPHS`` says which.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from kiln.errors import ConfigError
from kiln.exporter.engine.gpus import gpu_note
from kiln.exporter.engine.graphs import ONNX_MIN_VERSION
from kiln.exporter.engine.options import MIB, BuildOptions, GraphSet, HardwareCompat
from kiln.exporter.engine.profiles import EngineProfile, InputShape, Shape
from kiln.newfile import new_output

__all__ = [
    "SCRIPT",
    "DEFAULT_TIMING_CACHE",
    "timing_cache_path",
    "trtexec_args",
    "trtexec_command",
    "render_script",
    "write_script",
]

SCRIPT = "engines/trtexec.sh"
DEFAULT_TIMING_CACHE = "engines/timing.cache"
# trtexec's spelling of each level (sampleOptions.cpp: "none" | "ampere+" | "sameComputeCapability")
_HARDWARE = {
    HardwareCompat.NONE: "none",
    HardwareCompat.AMPERE_PLUS: "ampere+",
    HardwareCompat.SAME_CC: "sameComputeCapability",
}
_ONNX_VERSION_INT = ONNX_MIN_VERSION[0] * 10000 + ONNX_MIN_VERSION[1] * 100  # NV_TENSORRT_VERSION of 10.15.0
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


def script_cache_note(directory: Path, options: BuildOptions) -> str:
    """Why the script's timing cache is not ``--timing-cache``'s file, when it is not (a part of the one
    line kiln build prints): the script runs from the export directory on the GPU machine."""
    if options.timing_cache is None or _script_cache(directory, options) != DEFAULT_TIMING_CACHE:
        return ""
    if timing_cache_path(directory, options).absolute() == (directory / DEFAULT_TIMING_CACHE).absolute():
        return ""
    return (
        f"; the script keeps its timing cache in {DEFAULT_TIMING_CACHE}, as --timing-cache {options.timing_cache} is "
        "outside the export it runs from"
    )


def _dims(shape: Shape) -> str:
    return "x".join(str(d) for d in shape)


def _shapes(inputs: Sequence[InputShape], which: str) -> str:
    parts = []
    for spec in inputs:
        if _UNSAFE_NAME & set(spec.name):
            raise ConfigError(
                f"input name {spec.name!r} cannot be written as a trtexec shape (it has one of : , ' = or a space)"
            )
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


def _commands(
    profiles: Sequence[EngineProfile], options: BuildOptions, timing_cache: str, indent: str = ""
) -> list[str]:
    lines = []
    for profile in profiles:
        args = trtexec_args(profile, options, timing_cache)
        lines.append("")
        lines.append(f"{indent}# {profile.kind.value}: {profile.onnx} -> {profile.engine}")
        lines.append(f"{indent}trtexec \\")
        lines.extend(f"{indent}  {shlex.quote(arg)} \\" for arg in args[:-1])
        lines.append(f"{indent}  {shlex.quote(args[-1])}")
    return lines


def _graph_switch(default: GraphSet) -> list[str]:
    """The lines that set ``graphs`` to ``onnx`` or ``portable`` (``KILN_GRAPHS``, else ``default``),
    reading trtexec's version from the first line every trtexec run prints, ``&&&& RUNNING
    TensorRT.trtexec [TensorRT v<NV_TENSORRT_VERSION>] ...``, its --help included
    (``samples/common/logging.h`` ``defineTest`` and ``samples/trtexec/trtexec.cpp`` on
    ``release/10.15`` and ``main`` = 11.1; ``NV_TENSORRT_VERSION`` = major * 10000 + minor * 100 +
    patch, ``NvInferRuntimeBase.h``)."""
    need = _ONNX_VERSION_INT
    return [
        f'graphs="${{KILN_GRAPHS:-{default.value}}}"',
        "version=0",
        "if [[ $graphs != portable ]]; then",
        "  banner=$(trtexec --help 2>&1 || true)",
        r"  re='\[TensorRT v([0-9]+)\]'",
        "  if [[ $banner =~ $re ]]; then version=${BASH_REMATCH[1]}; fi",
        "fi",
        "case $graphs in",
        f"  auto) if (( version >= {need} )); then graphs=onnx; else graphs=portable; fi ;;",
        f'  onnx) if (( version > 0 && version < {need} )); then echo "trtexec.sh: KILN_GRAPHS=onnx needs '
        'TensorRT 10.15 or newer, trtexec is TensorRT v$version; use KILN_GRAPHS=portable" >&2; exit 1; fi ;;',
        "  portable) ;;",
        '  *) echo "trtexec.sh: KILN_GRAPHS must be auto, portable or onnx, found $graphs" >&2; exit 2 ;;',
        "esac",
        'if (( version > 0 )); then seen="trtexec TensorRT v$version"; else seen="trtexec\'s version not read"; fi',
        'echo "trtexec.sh: building the $graphs graphs (KILN_GRAPHS=${KILN_GRAPHS:-' + default.value + '}, $seen)" >&2',
    ]


def render_script(
    profiles: Sequence[EngineProfile],
    options: BuildOptions,
    timing_cache: str = DEFAULT_TIMING_CACHE,
    precision: str | None = None,
    std: Sequence[EngineProfile] | None = None,
) -> str:
    """The text of ``engines/trtexec.sh``: one trtexec command per engine, run from the export
    directory (``precision``: the export's, for the note on which GPUs build it). With ``std``
    (the ``--target onnx`` graphs' profiles) it holds both sets and a switch between them, chosen as
    ``kiln build --graphs`` chooses (``engine.graphs``), ``options.graphs`` the default."""
    lines = [
        "#!/usr/bin/env bash",
        "# Builds this export's TensorRT engines with trtexec; written by `kiln build`, equivalent to it.",
        "# Copy the whole export directory to a machine with an NVIDIA GPU and TensorRT, then run",
        "#   bash engines/trtexec.sh",
        "# Paths are relative to the export directory (the script changes to it first).",
        "# --stronglyTyped is for TensorRT 10.x (precision comes from the ONNX types); on 11.x every",
        "# network is strongly typed and the flag is a no-op. No precision flags: int8/int4/fp8 are Q/DQ in the ONNX.",
        *([note] if (note := gpu_note(precision or "")) is not None else []),
    ]
    if std:
        lines += [
            "# Two graph sets: the portable graphs (onnx/*.onnx, any TensorRT 10.12+) and the --target onnx graphs",
            "# (onnx/*.std.onnx: Attention, RotaryEmbedding, RMSNormalization, a static KV cache written in place by",
            "# TensorScatter; TensorRT 10.15+). KILN_GRAPHS=auto|portable|onnx picks, as kiln build --graphs does;",
            f"# default {options.graphs.value}. auto: the --target onnx graphs when trtexec is TensorRT 10.15 or "
            "newer.",
        ]
    if any(p.slot_inputs for p in profiles):
        lines += [
            "# LoRA slots (--lora-slots): each slot's A/B carry the rank range [0, max_rank] below. In "
            "onnx/*.onnx they are also",
            "# initializers (ONNX Runtime's optional inputs), which TensorRT's parser takes for constants: kiln "
            "build parses the",
            "# graphs without them, but trtexec reads the file as it is (and refuses external weights under ../, "
            "so no slot-free",
            "# copy can sit in engines/): these commands build engines that take no adapter. Build slotted "
            "engines with kiln build.",
        ]
    lines += ["set -euo pipefail", 'cd "$(dirname "$0")/.."', "mkdir -p engines"]
    if not std:
        return "\n".join([*lines, *_commands(profiles, options, timing_cache)]) + "\n"
    lines += _graph_switch(options.graphs)
    lines += [
        "",
        "if [[ $graphs == onnx ]]; then",
        *_commands(std, options, timing_cache, "  ")[1:],
        "else",
        *_commands(profiles, options, timing_cache, "  ")[1:],
        "fi",
    ]
    return "\n".join(lines) + "\n"


def write_script(
    directory: Path,
    profiles: Sequence[EngineProfile],
    options: BuildOptions,
    std: Sequence[EngineProfile] | None = None,
) -> Path:
    """Write ``DIR/engines/trtexec.sh`` (mode 755; ``std``: the ``--target onnx`` graphs' profiles,
    when the export has them) and return its path. Graphs TensorRT would refuse (int4 blocks outside
    its sizes: ``lowbit_check.require_tensorrt_int4``) are refused first: no script is written for them."""
    from kiln.exporter.precision.lowbit_check import require_tensorrt_int4

    require_tensorrt_int4(directory, [profile.onnx for profile in (*profiles, *(std or ()))])
    path = directory / SCRIPT
    path.parent.mkdir(parents=True, exist_ok=True)
    from kiln.exporter.artifacts import manifest as manifest_mod

    precision = manifest_mod.read(directory).precision if (directory / manifest_mod.MANIFEST).is_file() else None
    with new_output(path, executable=True) as tmp:
        tmp.write_text(render_script(profiles, options, _script_cache(directory, options), precision, std))
    return path
