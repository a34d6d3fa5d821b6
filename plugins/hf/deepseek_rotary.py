"""DeepSeek-V2's rotary in real arithmetic, patched in while a graph is traced.

transformers 5.25 writes DeepSeek-V2's rotary with complex numbers: ``DeepseekV2RotaryEmbedding``
returns ``torch.polar(1, position * inv_freq) * attention_scaling`` and ``apply_rotary_emb`` views
each head's adjacent pairs (x[2i], x[2i+1]) of ``[B, H, S, D]`` queries and keys as one complex
number and multiplies. torch.onnx has no translation for complex tensors (``aten.unsqueeze`` on
one fails), so while ``torch.compiler.is_exporting()`` the two are replaced by the same product in
real arithmetic (``real_rotary.real_freqs``: ``[B, S, D/2, 2]`` (cos, sin) times the scaling; the
pair (a, b) becomes (a*cos - b*sin, a*sin + b*cos), interleaved back as the complex view lays it
out). Eager runs (kiln's PyTorch reference) keep transformers' own code;
tests/unit/test_hf_deepseek_rotary.py proves the two equal.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from kiln.plugins.hf.real_rotary import real_freqs
from kiln.plugins.hf.trace_rewrites import Rewrite, patched_rotary, while_exporting

__all__ = ["real_apply_rotary_bhsd", "real_deepseek_rotary", "deepseek_rewrites_for"]

_MODULE = "transformers.models.deepseek_v2.modeling_deepseek_v2"


def _rotate(x: Tensor, freqs: Tensor) -> Tensor:
    """x [B, H, S, D] with its adjacent pairs rotated by freqs [B, S, D/2, 2], in float32, back in x's dtype."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = freqs[:, None, :, :, 0], freqs[:, None, :, :, 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(3).type_as(x)


def real_apply_rotary_bhsd(xq: Tensor, xk: Tensor, freqs: Tensor) -> tuple[Tensor, Tensor]:
    """``apply_rotary_emb`` of transformers' DeepSeek-V2 on ``real_freqs``' output."""
    return _rotate(xq, freqs), _rotate(xk, freqs)


def real_deepseek_rotary() -> contextlib.AbstractContextManager[None]:
    """DeepSeek-V2's complex rotary replaced by ``real_freqs`` and ``real_apply_rotary_bhsd``
    while inside (transformers' module attributes patched, restored on exit)."""
    return patched_rotary(_MODULE, "DeepseekV2RotaryEmbedding", real_freqs, real_apply_rotary_bhsd)


def deepseek_rewrites_for(model: nn.Module) -> Rewrite:
    """What enters ``real_deepseek_rotary`` while torch.export traces a DeepSeek-V2 model, and
    nothing otherwise (eager runs keep transformers' code)."""
    return while_exporting(model, "DeepseekV2RotaryEmbedding", real_deepseek_rotary)
