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
after it, as in the reference implementation, which also gives the factor's recipe: Cholesky of
``H``, its inverse from that, Cholesky of the inverse (1.3 K^3 flops against an LU inverse's 2.3),
computed once per Hessian (``inverse_factor``) for every weight that reads its input. Each block's
scale is chosen when the block is reached, from the weights as updated so far, by the same clip
search as RTN's. Columns are
independent given ``H``, so the q/k/v (or gate/up) weights that read one input get the same
numbers whether they are quantized apart or side by side.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kiln.exporter.int4.numbers import clip_scales
from kiln.exporter.runners.device import current

__all__ = ["gptq", "gptq_factored", "inverse_factor", "InverseFactor", "CLIP_RATIOS", "PERCDAMP"]

CLIP_RATIOS = tuple(float(r) for r in np.linspace(1.0, 0.6, 9))  # clip search: amax * r / 7
PERCDAMP = 0.1  # diagonal damping, a fraction of H's mean diagonal (0.1 beat 0.01 on the demo, measured in issue 16)
_LAZY = 128  # rows updated together before the rest of the matrix is
NUMERICS = np.float64  # the factor and the updates (float32: measured in docs/benchmarks.md, streaming GPTQ)


@dataclasses.dataclass(frozen=True)
class InverseFactor:
    """What GPTQ reads of a Hessian: the upper ``U`` with ``H^-1 = U^T U`` (``H`` damped), ``[K, K]``
    of ``NUMERICS``, and the input channels that never fired (their weights do not matter)."""

    u: torch.Tensor
    dead: np.ndarray


def inverse_factor(hessian: np.ndarray, percdamp: float = PERCDAMP) -> InverseFactor:
    """``hessian [K, K]`` (any float type) -> its ``InverseFactor``; at most two ``[K, K]`` matrices
    of ``NUMERICS`` exist at once (1.6 GB each at K = 14336 in float64), on parity's device
    (``runners.device``: the GPU with ``--parity-device cuda``, where ``u`` stays)."""
    h = _placed(torch.from_numpy(np.array(hessian, dtype=NUMERICS)))  # a copy, damped in place
    diag = h.diagonal()
    dead = _host(diag == 0)
    diag[_placed(torch.from_numpy(dead))] = 1.0
    diag += percdamp * float(diag.mean())
    lower = torch.linalg.cholesky(h)
    del h, diag
    inverse = torch.cholesky_inverse(lower)
    del lower
    return InverseFactor(torch.linalg.cholesky(inverse, upper=True), dead)


def gptq(
    weight: np.ndarray, hessian: np.ndarray, block: int, scale_dtype: np.dtype, percdamp: float = PERCDAMP
) -> tuple[np.ndarray, np.ndarray]:
    """``weight [K, N]``, ``hessian [K, K]`` -> (q int8 [K, N] in [-8, 7], scale [K/B, N] of ``scale_dtype``)."""
    return gptq_factored(weight, inverse_factor(hessian, percdamp), block, scale_dtype)


def gptq_factored(
    weight: np.ndarray, factor: InverseFactor, block: int, scale_dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """``gptq`` from the Hessian's ``InverseFactor`` (shared by the weights that read one input)."""
    k, n = weight.shape
    if k % block:
        raise ValueError(f"K={k} is not a multiple of the block size {block}")
    w = torch.from_numpy(np.array(weight, dtype=NUMERICS)).to(factor.u.device)  # updated in place, on u's device
    w[torch.from_numpy(factor.dead).to(w.device)] = 0.0
    u = factor.u.to(w.dtype)
    q = np.zeros((k, n), np.int8)
    scale = np.zeros((k // block, n), dtype=scale_dtype)
    lazy = max(block, (_LAZY // block) * block)
    for i1 in range(0, k, lazy):
        i2 = min(i1 + lazy, k)
        w1 = w[i1:i2].clone()
        err = torch.zeros_like(w1)
        for i in range(i2 - i1):
            row = i1 + i
            if row % block == 0:  # a new block: its scale from the weights as updated so far
                scale[row // block] = clip_scales(_host(w1[i : i + block])[None], scale_dtype, CLIP_RATIOS)[0]
            s = torch.from_numpy(scale[row // block].astype(NUMERICS)).to(w.device)
            qi = torch.clamp(torch.round(w1[i] / s), -8, 7)
            q[row] = _host(qi)
            e = (w1[i] - qi * s) / u[row, row]
            w1[i:].addr_(u[row, row:i2], e, alpha=-1.0)  # [i2 - row, N] rank-1 update in place
            err[i] = e
        w[i2:].addmm_(u[i1:i2, i2:].T, err, alpha=-1.0)
    return q, scale


def _placed(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on parity's device (``runners.device``; on the CPU: itself)."""
    device = current()
    return tensor.to(device.name) if device.cuda else tensor


def _host(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` as a CPU array (on the CPU: the tensor's own memory)."""
    return tensor.numpy() if tensor.device.type == "cpu" else tensor.cpu().numpy()
