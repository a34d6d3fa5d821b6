"""The calibration cache (ranges keyed by sha256 of the weights, the data and the method
settings) and the legacy TensorRT calibration cache for TensorRT 10's implicit INT8."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from kiln.errors import CalibrationError
from kiln.inputs import read_input
from kiln.jsonfile import MAX_BYTES
from kiln.newfile import new_output

__all__ = ["cache_key", "read_cache", "write_cache", "trt_calibration_cache", "TRT_CACHE_VERSION"]

# NV_TENSORRT_VERSION of the cache header: major*10000 + minor*100 + patch for 10.x (10.13.0)
TRT_CACHE_VERSION = 101300
Ranges = dict[str, dict[str, tuple[float, float]]]  # graph -> tensor -> (lo, hi)


def cache_key(weights_sha256: str, data_sha256: str, settings: dict[str, object]) -> str:
    text = json.dumps({"weights": weights_sha256, "data": data_sha256, "settings": settings}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def read_cache(directory: Path, key: str) -> Ranges | None:
    path = directory / f"{key}.json"
    try:  # a FIFO, a device or an outsize file there is a miss, as a damaged one is (and the next write replaces it)
        text = read_input(path, CalibrationError, MAX_BYTES, what="a calibration cache file")
        data = json.loads(text.decode("utf-8"))
    except (FileNotFoundError, CalibrationError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    try:
        return {g: {t: (float(r[0]), float(r[1])) for t, r in ranges.items()} for g, ranges in data["ranges"].items()}
    except (KeyError, IndexError, AttributeError, TypeError, ValueError):  # a damaged file is a cache miss
        return None


def write_cache(directory: Path, key: str, ranges: Ranges, settings: dict[str, object]) -> Path:
    """Atomically: a cache file is whole or absent."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}.json"
    payload = json.dumps({"key": key, "settings": settings, "ranges": ranges}, indent=1, sort_keys=True)
    with new_output(path) as tmp:  # kiln's one way of writing a single file
        tmp.write_text(payload)
    return path


def trt_calibration_cache(ranges: dict[str, tuple[float, float]], version: int = TRT_CACHE_VERSION) -> str:
    """``TRT-<version>-EntropyCalibration2``, then ``tensor: <big-endian hex of the float32
    scale amax/127>`` a line (the format TensorRT's ``IInt8EntropyCalibrator2`` reads)."""
    lines = [f"TRT-{version}-EntropyCalibration2"]
    for name in sorted(ranges):
        lo, hi = ranges[name]
        scale = max(abs(lo), abs(hi)) / 127.0
        lines.append(f"{name}: {struct.pack('>f', scale).hex()}")
    return "\n".join(lines) + "\n"
