"""Llama 4's rotary in real arithmetic, patched in while a graph is traced.

transformers 5.25 writes Llama 4's rotary with complex numbers: ``Llama4TextRotaryEmbedding``
returns ``torch.polar(1, position * inv_freq) * attention_scaling`` and ``apply_rotary_emb``
views each head's adjacent pairs (x[2i], x[2i+1]) as one complex number and multiplies. torch.onnx
has no translation for complex tensors (``aten.unsqueeze`` on one fails), so while
``torch.compiler.is_exporting()`` the two are replaced by the same product in real arithmetic:
the rotary returns ``[..., half, 2]`` (cos, sin) times the scaling, and the pair (a, b) becomes
(a*cos - b*sin, a*sin + b*cos), interleaved back as the complex view lays it out. Eager runs
(kiln's PyTorch reference) keep transformers' own code; tests/unit/test_hf_real_rotary.py proves
the two equal.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from kiln.plugins.hf.trace_rewrites import Rewrite, patched_rotary, while_exporting

__all__ = ["real_apply_rotary", "real_freqs", "real_rotary", "rewrites_for"]

_MODULE = "transformers.models.llama4.modeling_llama4"


def real_freqs(rotary: nn.Module, x: Tensor, position_ids: Tensor) -> Tensor:
    """``Llama4TextRotaryEmbedding.forward`` as [B, S, half, 2] reals: (cos, sin) of each
    position's angles times the module's ``attention_scaling`` (what its complex ``freqs_cis`` holds)."""
    inv_freq: Any = rotary.inv_freq
    angles = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    return torch.stack((torch.cos(angles), torch.sin(angles)), dim=-1) * scale


def _rotate(x: Tensor, freqs: Tensor) -> Tensor:
    """x [B, S, H, D] with its adjacent pairs rotated by freqs [B, S, D/2, 2], in float32, back in x's dtype."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = freqs[:, :, None, :, 0], freqs[:, :, None, :, 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(3).type_as(x)


def real_apply_rotary(xq: Tensor, xk: Tensor, freqs: Tensor) -> tuple[Tensor, Tensor]:
    """``apply_rotary_emb`` of transformers' Llama 4 on ``real_freqs``' output."""
    return _rotate(xq, freqs), _rotate(xk, freqs)


def real_rotary() -> contextlib.AbstractContextManager[None]:
    """Llama 4's complex rotary replaced by ``real_freqs`` and ``real_apply_rotary`` while inside
    (transformers' module attributes patched, restored on exit)."""
    return patched_rotary(_MODULE, "Llama4TextRotaryEmbedding", real_freqs, real_apply_rotary)


def rewrites_for(model: nn.Module) -> Rewrite:
    """What enters the trace-time rewrites ``model`` needs (``real_rotary`` for a Llama 4 text
    model) while torch.export traces it, and nothing otherwise (eager runs keep transformers' code)."""
    return while_exporting(model, "Llama4TextRotaryEmbedding", real_rotary)
