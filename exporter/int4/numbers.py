"""int4 weight-only numbers: symmetric block quantization of a MatMul weight ``W [K, N]`` along K.

One convention for every form kiln writes: ``q`` in [-8, 7] (int8 storage here), ``scale``
``[K/B, N]`` with ``W ~= q * repeat(scale, B, axis=0)``; round-to-nearest uses ``scale = amax / 7``
(ModelOpt's ``rtn_dq`` convention, so ``-8`` is never produced by RTN; GPTQ may reach it). The
scale is rounded to the graph's float dtype *before* ``q`` is computed, so ``q`` is exact for
the scale that is stored. The portable ``DequantizeLinear`` form stores ``q`` as ONNX INT4
(two per byte, element ``2j`` in the low nibble); ``MatMulNBits`` stores ``q + 8`` as uint4 in
``[N, K/B, B/2]`` with its default zero point 8 (``pack_nbits``).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "QMAX",
    "MIN_BLOCK",
    "layer_block",
    "rtn",
    "dequantize",
    "pack_int4",
    "unpack_int4",
    "pack_nbits",
    "clip_scales",
]

QMAX = 7.0
MIN_BLOCK = 16  # MatMulNBits' smallest block (a power of two >= 16)


def layer_block(k: int, block: int) -> int | None:
    """The block size a weight with ``k`` input channels gets: ``block`` when it divides ``k``,
    else the largest smaller power of two that does (TensorRT wants whole blocks; ONNX and
    ONNX Runtime would accept a partial last one); None when no block of at least 16 divides ``k``."""
    b = block
    while b >= MIN_BLOCK:
        if k % b == 0:
            return b
        b //= 2
    return None


def _blocks(w: np.ndarray, block: int) -> np.ndarray:
    k, n = w.shape
    return w.reshape(k // block, block, n)  # [K/B, B, N]


def _round(wb: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(wb / scale[:, None, :].astype(np.float64)), -8, 7).astype(np.int8)


def clip_scales(wb: np.ndarray, scale_dtype: np.dtype, ratios: tuple[float, ...] = (1.0,)) -> np.ndarray:
    """Per block and column of ``wb [blocks, B, N]``: the scale ``r * amax / 7`` (rounded to
    ``scale_dtype``) of the ratio ``r`` with the least squared weight error. Never 0."""
    amax = np.abs(wb).max(axis=1)  # [blocks, N]
    best = best_err = None
    for r in ratios:
        s = (amax * r / QMAX).astype(scale_dtype)
        s = np.where(s > 0, s, np.asarray(1, dtype=scale_dtype))  # an all-zero block: any scale > 0
        if len(ratios) == 1:
            return s  # nothing to choose between: no error to compute (RTN's default)
        err = ((_round(wb, s) * s[:, None, :].astype(np.float64) - wb) ** 2).sum(axis=1)
        if best is None or best_err is None:
            best, best_err = s, err
        else:
            better = err < best_err
            best, best_err = np.where(better, s, best), np.where(better, err, best_err)
    assert best is not None
    return best


def rtn(weight: np.ndarray, block: int, scale_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Round to nearest: ``weight [K, N]`` -> (q int8 [K, N] in [-7, 7], scale [K/B, N] of ``scale_dtype``)."""
    w = np.asarray(weight, dtype=np.float64)
    k, n = w.shape
    if k % block:
        raise ValueError(f"K={k} is not a multiple of the block size {block}")
    wb = _blocks(w, block)
    scale = clip_scales(wb, scale_dtype)
    return _round(wb, scale).reshape(k, n), scale


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """What ``DequantizeLinear(q, scale, axis=0, block_size=K/blocks)`` computes, in float32."""
    block = q.shape[0] // scale.shape[0]
    return q.astype(np.float32) * np.repeat(scale.astype(np.float32), block, axis=0)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int8 values in [-8, 7] -> ONNX INT4 bytes (flat, element 2j in the low nibble)."""
    flat = q.reshape(-1).astype(np.int16) & 0x0F
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.int16)])
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of ``pack_int4``: int8 values of ``shape``."""
    lo, hi = (packed & 0x0F).astype(np.int16), (packed >> 4).astype(np.int16)
    flat = np.stack([lo, hi], axis=-1).reshape(-1)[: int(np.prod(shape))]
    return np.where(flat > 7, flat - 16, flat).astype(np.int8).reshape(shape)


def pack_nbits(q: np.ndarray, block: int) -> np.ndarray:
    """q int8 [K, N] -> MatMulNBits' ``B`` uint8 [N, K/B, B/2]: per column and block, ``q + 8``
    as uint4, two a byte, element 2j in the low nibble (verified against ONNX Runtime's own
    quantizer and kernel in issue 16; every ``--target ort --int4`` export's parity runs ONNX Runtime's
    kernel on it: tests/export/test_int4.py)."""
    k, n = q.shape
    u = (q.astype(np.int16) + 8).astype(np.uint8).T.reshape(n, k // block, block)  # [N, blocks, B]
    return (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8)
