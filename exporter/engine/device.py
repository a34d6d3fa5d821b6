"""The TensorRT, CUDA and GPU of this machine, for engines.json and the load-time check.

The CUDA runtime is reached through ctypes on the ``libcudart`` that polygraphy's CUDA wrapper
loads (the one its TrtRunner uses), so neither torch with CUDA nor cuda-python is needed. Calls and
constants from the CUDA Runtime API (``driver_types.h``/``cuda_runtime_api.h``):
``cudaRuntimeGetVersion(int*)`` (1000 * major + 10 * minor), ``cudaGetDevice(int*)``,
``cudaDeviceGetAttribute(int*, cudaDeviceAttr, int)`` with ``cudaDevAttrComputeCapabilityMajor = 75``
and ``cudaDevAttrComputeCapabilityMinor = 76``, and ``cudaGetDeviceProperties[_v2](cudaDeviceProp*,
int)`` whose first field is ``char name[256]``. This cannot run without a GPU; it is only read
and type-checked here.
"""

from __future__ import annotations

import ctypes
from types import ModuleType

from kiln.errors import EngineError
from kiln.exporter.engine.records import RuntimeInfo

__all__ = ["current_runtime"]

_CC_MAJOR, _CC_MINOR = 75, 76  # cudaDevAttrComputeCapabilityMajor / Minor (driver_types.h)
_PROPS_BYTES = 8192  # larger than any cudaDeviceProp so far (about 1 KiB); only name[256] is read


def _cudart() -> ctypes.CDLL:
    try:
        from polygraphy import (
            cuda,  # polygraphy ships no type information (Any: .ci/mypy)
        )

        handle = getattr(cuda.wrapper(), "handle", None)
        if isinstance(handle, ctypes.CDLL):
            return handle
    except Exception:  # polygraphy could not find it; try the loader's own search
        pass
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise EngineError(
        "cannot load the CUDA runtime library (libcudart); install TensorRT's CUDA dependencies (pip install "
        "tensorrt) or add CUDA's lib64 to LD_LIBRARY_PATH"
    )


def _int_call(lib: ctypes.CDLL, func: str, *args: object) -> int:
    value = ctypes.c_int(0)
    status = getattr(lib, func)(ctypes.byref(value), *args)
    if status != 0:
        raise EngineError(
            f"CUDA {func} failed with error {status}; is an NVIDIA GPU visible (nvidia-smi, CUDA_VISIBLE_DEVICES)?"
        )
    return value.value


def _device_name(lib: ctypes.CDLL, device: int) -> str:
    props = ctypes.create_string_buffer(_PROPS_BYTES)
    for func in ("cudaGetDeviceProperties_v2", "cudaGetDeviceProperties"):  # _v2 since CUDA 12
        try:
            status = getattr(lib, func)(props, ctypes.c_int(device))
        except AttributeError:
            continue
        if status == 0:
            return props.raw[:256].split(b"\0", 1)[0].decode(errors="replace") or "unknown GPU"
    return "unknown GPU"


def current_runtime(trt: ModuleType, device: int | None = None) -> RuntimeInfo:
    """TensorRT version, CUDA runtime version, GPU name and compute capability of ``device``
    (default: the current CUDA device)."""
    lib = _cudart()
    version = _int_call(lib, "cudaRuntimeGetVersion")
    index = _int_call(lib, "cudaGetDevice") if device is None else device
    major = _int_call(lib, "cudaDeviceGetAttribute", ctypes.c_int(_CC_MAJOR), ctypes.c_int(index))
    minor = _int_call(lib, "cudaDeviceGetAttribute", ctypes.c_int(_CC_MINOR), ctypes.c_int(index))
    return RuntimeInfo(
        tensorrt=str(getattr(trt, "__version__", "unknown")),
        cuda=f"{version // 1000}.{(version % 1000) // 10}",
        gpu=_device_name(lib, index),
        compute_capability=f"{major}.{minor}",
    )
