"""Every difference between TensorRT 10.x (10.12+) and 11.x that kiln touches, in one place.

Names are looked up with ``hasattr``/``getattr``, never by enum number: enum values moved between
versions (``NetworkDefinitionCreationFlag.STRONGLY_TYPED`` is 1 in 10.x and 0 in 11.x). Each
function takes the imported ``tensorrt`` module, so tests can pass a stand-in namespace.

Sources (NVIDIA/TensorRT): ``python/src/infer/pyCore.cpp`` on ``release/10.13``, ``release/10.16``
and ``main`` (= 11.1); the migration guide "Migrating from TensorRT 10.x to 11.x" and "Removed Python
APIs and Replacements" (docs.nvidia.com/deeplearning/tensorrt/latest/api/migration/
tensorrt-10x-to-11x-python-api-reference.html); "Engine Compatibility"
(docs.nvidia.com/deeplearning/tensorrt/11.1.0/inference-library/engine-compatibility.html).
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kiln.errors import EngineError
from kiln.exporter.engine.options import HardwareCompat

if TYPE_CHECKING:
    import tensorrt as trt_types

__all__ = [
    "MIN_VERSION",
    "version_tuple",
    "trt_version",
    "require_supported",
    "network_flags",
    "hardware_level",
    "builder_flag",
    "disable_tf32",
    "allow_host_code",
    "device_memory_bytes",
    "weights_bytes",
    "aliased_inputs",
]

MIN_VERSION = (10, 12)  # docs/commands.md, kiln build: "TensorRT 10.12+ and 11.x"

# trt.HardwareCompatibilityLevel member of each option (pyCore.cpp, the same names in 10.13 and 11.1)
_HARDWARE_NAMES = {
    HardwareCompat.NONE: "NONE",
    HardwareCompat.AMPERE_PLUS: "AMPERE_PLUS",
    HardwareCompat.SAME_CC: "SAME_COMPUTE_CAPABILITY",
}


def version_tuple(version: str) -> tuple[int, ...]:
    """``"10.13.0.35"`` -> ``(10, 13, 0, 35)``; suffixes such as ``post1`` or ``rc`` are dropped."""
    parts: list[int] = []
    for piece in version.split("."):
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def trt_version(trt: ModuleType) -> tuple[int, ...]:
    version = getattr(trt, "__version__", None)
    parsed = version_tuple(version) if isinstance(version, str) else ()
    if len(parsed) < 2:
        raise EngineError(f"cannot read the TensorRT version (tensorrt.__version__ is {version!r})")
    return parsed


def require_supported(trt: ModuleType) -> tuple[int, ...]:
    """The version, if kiln can build with it (10.12 or newer), else one clear error."""
    version = trt_version(trt)
    if version[:2] < MIN_VERSION:
        need = ".".join(map(str, MIN_VERSION))
        raise EngineError(
            f"TensorRT {trt.__version__} is too old: kiln builds strongly typed engines on TensorRT {need} or "
            "newer; pip install -U tensorrt"
        )
    return version


def network_flags(trt: ModuleType) -> int:
    """The ``create_network`` flags of a strongly typed network.

    10.x: strong typing is opt-in, ``1 << int(NetworkDefinitionCreationFlag.STRONGLY_TYPED)``
    (pyCore.cpp release/10.13: ``EXPLICIT_BATCH`` = 0, ignored since 10.0; ``STRONGLY_TYPED`` = 1).
    11.x: every network is strongly typed; ``STRONGLY_TYPED`` (now = 0, ``EXPLICIT_BATCH`` removed)
    is "[DEPRECATED] ... retained for API compatibility but is ignored" (pyCoreDoc.h on main), so
    no flag is passed and no deprecation warning is logged.
    """
    if trt_version(trt)[0] >= 11:
        return 0
    flags = getattr(trt, "NetworkDefinitionCreationFlag", None)
    if flags is None or not hasattr(flags, "STRONGLY_TYPED"):
        raise EngineError(
            f"TensorRT {trt.__version__} has no NetworkDefinitionCreationFlag.STRONGLY_TYPED; kiln needs 10.12 or newer"
        )
    return 1 << int(flags.STRONGLY_TYPED)


def hardware_level(trt: ModuleType, level: HardwareCompat) -> Any:
    """The ``trt.HardwareCompatibilityLevel`` member for ``--hardware-compat`` (8.6+; all three
    names in 10.12, 10.13 and 11.1)."""
    name = _HARDWARE_NAMES[level]
    levels = getattr(trt, "HardwareCompatibilityLevel", None)
    if levels is None or not hasattr(levels, name):
        raise EngineError(
            f"TensorRT {trt.__version__} has no HardwareCompatibilityLevel.{name}; build with --hardware-compat "
            "none or upgrade TensorRT"
        )
    return getattr(levels, name)


def builder_flag(trt: ModuleType, name: str) -> Any:
    """A ``trt.BuilderFlag`` member by name, or an error naming what this TensorRT lacks.

    Only names present in both 10.x and 11.x are asked for (``REFIT``, ``VERSION_COMPATIBLE``,
    ``TF32``). The weak-typing flags ``FP16``, ``BF16``, ``INT8``, ``FP8``, ``INT4``, ``FP4``,
    ``OBEY_/PREFER_PRECISION_CONSTRAINTS`` and ``DIRECT_IO`` were removed in 11.x (migration guide,
    "Removed Python APIs") and calibrators with them: kiln never uses them, the ONNX carries the
    precision.
    """
    flags = getattr(trt, "BuilderFlag", None)
    if flags is None or not hasattr(flags, name):
        raise EngineError(f"TensorRT {getattr(trt, '__version__', '?')} has no BuilderFlag.{name}")
    return getattr(flags, name)


def disable_tf32(trt: ModuleType, config: trt_types.IBuilderConfig) -> bool:
    """Keep FP32 tensors in FP32: ``BuilderFlag.TF32`` "Allow (but not require) computations on
    tensors of type DataType.FLOAT to use TF32 ... Enabled by default" (pyCoreDoc.h, 10.x and 11.x).
    Returns whether the flag existed and was cleared."""
    flags = getattr(trt, "BuilderFlag", None)
    if flags is None or not hasattr(flags, "TF32"):
        return False
    config.clear_flag(flags.TF32)
    return True


def allow_host_code(runtime: trt_types.Runtime) -> None:
    """Version-compatible plans embed the lean runtime (host code): the runtime must be told to
    trust them, ``runtime.engine_host_code_allowed = True`` (8.6+, kept in 11.1; Engine
    Compatibility docs). Only called for plans kiln built itself."""
    if hasattr(runtime, "engine_host_code_allowed"):
        runtime.engine_host_code_allowed = True


def device_memory_bytes(engine: trt_types.ICudaEngine) -> int | None:
    """Device memory one execution context needs: ``device_memory_size_v2`` (10.1+; the only one in
    11.x, which removed ``device_memory_size``: "Removed Python APIs and Replacements")."""
    if hasattr(engine, "device_memory_size_v2"):
        return int(engine.device_memory_size_v2)
    if hasattr(engine, "device_memory_size"):  # removed in 11.x
        return int(engine.device_memory_size)
    return None


def weights_bytes(trt: ModuleType, engine: trt_types.ICudaEngine) -> int | None:
    """Total weight bytes of the engine: ``ICudaEngine.get_engine_stat(EngineStat.TOTAL_WEIGHTS_SIZE)``
    exists from 10.14 on (pyCore.cpp release/10.14 and main), not in 10.12/10.13 nor in the 10.13
    ``tensorrt-stubs``: looked up with getattr, and None where it is missing."""
    stats = getattr(trt, "EngineStat", None)  # 10.14+ / 11.x only
    get_stat = getattr(engine, "get_engine_stat", None)  # 10.14+ / 11.x only
    if stats is None or get_stat is None or not hasattr(stats, "TOTAL_WEIGHTS_SIZE"):
        return None
    value = get_stat(stats.TOTAL_WEIGHTS_SIZE)
    return int(value) if isinstance(value, int) and value >= 0 else None


def aliased_inputs(trt: ModuleType, engine: trt_types.ICudaEngine) -> dict[str, str] | None:
    """Each output the engine writes in place, mapped to the input it shares its memory with:
    ``ICudaEngine.get_aliased_input_tensor(name)``, "the name of the input tensor that shares memory
    with the given output tensor name ... ``None`` [if] the output does not alias with any input"
    (pyCoreDoc.h and pyCore.cpp, ``release/10.15``, ``release/10.16`` and ``main`` = 11.1; not in
    10.13 nor in the 10.13 ``tensorrt-stubs``: looked up with getattr). An ``IKVCacheUpdateLayer``'s
    output aliases its cache input ("The cache input tensor and the output tensor must share the
    same device memory ... If different addresses are assigned, TensorRT reports an API error":
    TensorRT 10.16 docs, inference-library/transformers-kv-cache.html). None where the method is
    missing (TensorRT before 10.15)."""
    get_alias = getattr(engine, "get_aliased_input_tensor", None)
    if get_alias is None:
        return None
    outputs = (engine.get_tensor_name(i) for i in range(engine.num_io_tensors))
    found = {name: get_alias(name) for name in outputs if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT}
    return {name: str(source) for name, source in found.items() if source}
