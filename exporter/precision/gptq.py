"""GPTQ (Frantar et al., 2022) for symmetric block int4, in numpy: ``(q, scale)`` from a weight and
the Hessian ``H = 2/n X^T X`` of its input activations over calibration data.

Written here because ONNX Runtime's GPTQ does not work for this (1.32's
``matmul_nbits_quantizer`` -> ``neural_compressor/weight_only.py::gptq``, the same code as
onnx-neural-compressor 1.0): it factors ``H^-1`` into its *upper* Cholesky factor and then
propagates each column's rounding error through that factor's entries *below* the diagonal,
which are zero, so no error is ever propagated and its result equals RTN bit for bit; with
``sym`` it then re-quantizes its already quantized weights with a fresh scale, a second rounding
that made it worse than RTN on kiln's demo model (measured in issue 16). The
torch GPTQ libraries (auto-gptq, gptqmodel, llmcompressor) work on Hugging Face modules with
CUDA kernels and export no ONNX; kiln only needs the numbers.

Row ``i`` of the upper factor ``U`` (``H^-1 = U^T U``) carries the error of row ``i`` to the rows
after it, as in the reference implementation. Each block's scale is chosen when the block is
reached, from the weights as updated so far, by the same clip search as RTN's. Columns are
independent given ``H``, so the q/k/v (or gate/up) weights that read one input get the same
numbers whether they are quantized apart or side by side.
"""

from __future__ import annotations

import numpy as np

from kiln.exporter.precision.int4_numbers import clip_scales

__all__ = ["gptq", "CLIP_RATIOS", "PERCDAMP"]

CLIP_RATIOS = tuple(float(r) for r in np.linspace(1.0, 0.6, 9))  # clip search: amax * r / 7
PERCDAMP = 0.1  # diagonal damping, a fraction of H's mean diagonal (0.1 beat 0.01 on the demo, measured in issue 16)
_LAZY = 128  # rows updated together before the rest of the matrix is


def gptq(weight: np.ndarray, hessian: np.ndarray, block: int, scale_dtype: np.dtype, percdamp: float = PERCDAMP) -> tuple[np.ndarray, np.ndarray]:
    """``weight [K, N]``, ``hessian [K, K]`` -> (q int8 [K, N] in [-8, 7], scale [K/B, N] of ``scale_dtype``)."""
    w = np.array(weight, dtype=np.float64)  # updated in place
    k, n = w.shape
    if k % block:
        raise ValueError(f"K={k} is not a multiple of the block size {block}")
    h = np.array(hessian, dtype=np.float64)
    dead = np.diag(h) == 0  # an input channel that never fired: its weights do not matter
    h[dead, dead] = 1.0
    w[dead, :] = 0.0
    h[np.diag_indices(k)] += percdamp * float(np.mean(np.diag(h)))
    inverse = np.linalg.inv(h)
    del h  # at most two [K, K] float64 matrices at once (1.6 GB each at K = 14336)
    u = np.linalg.cholesky(inverse).T  # upper: H^-1 = U^T U
    del inverse
    q = np.zeros((k, n), np.int8)
    scale = np.zeros((k // block, n), dtype=scale_dtype)
    lazy = max(block, (_LAZY // block) * block)
    for i1 in range(0, k, lazy):
        i2 = min(i1 + lazy, k)
        w1 = w[i1:i2].copy()
        err = np.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            row = i1 + i
            if row % block == 0:  # a new block: its scale from the weights as updated so far
                scale[row // block] = clip_scales(w1[i : i + block][None], scale_dtype, CLIP_RATIOS)[0]
            s = scale[row // block].astype(np.float64)
            qi = np.clip(np.rint(w1[i] / s), -8, 7)
            q[row] = qi
            e = (w1[i] - qi * s) / u1[i, i]
            w1[i:] -= np.outer(u1[i, i:], e)
            err[i] = e
        w[i2:] -= u[i1:i2, i2:].T @ err
    return q, scale
