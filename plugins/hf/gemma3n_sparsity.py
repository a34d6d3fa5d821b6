"""Gemma 3n's activation-sparsity threshold with its ``Normal.icdf`` folded to a constant while a
graph is traced (issue 43).

transformers 5.25's ``Gemma3nTextMLP._gaussian_topk`` keeps the gate activations above ``mean +
std * icdf(sparsity)`` of each token, computing ``icdf`` (``erfinv``) of the layer's constant
sparsity at every call; ONNX has no ``erfinv``, so the trace fails ("No ONNX function found for
prims.erf_inv"). The multiplier depends on the config alone: it is computed once, eagerly, by
transformers' own expression (``gemma3n_rewrites_for``, when the decoder is wrapped), and while
``torch.compiler.is_exporting()`` the method reads it as a number. Eager runs (kiln's PyTorch
reference) keep transformers' code.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.plugins.hf.trace_rewrites import Rewrite, while_exporting

__all__ = ["gemma3n_rewrites_for", "std_multipliers"]

_MODULE = "transformers.models.gemma3n.modeling_gemma3n"
_MLP = "Gemma3nTextMLP"


def std_multipliers(model: nn.Module) -> dict[float, float]:
    """Each sparsity the model's MLPs use -> ``Normal(0, 1).icdf(sparsity)`` as transformers computes it
    (float32), as a number."""
    found = {float(getattr(m, "activation_sparsity", 0.0)) for m in model.modules() if type(m).__name__ == _MLP}
    normal: Any = torch.distributions.normal.Normal(0, 1)  # torch.distributions is untyped
    return {s: float(normal.icdf(torch.tensor(s, dtype=torch.float32))) for s in sorted(found) if s > 0.0}


@contextlib.contextmanager
def _folded(multipliers: Mapping[float, float]) -> Iterator[None]:
    """``Gemma3nTextMLP._gaussian_topk`` reading its multiplier from ``multipliers`` while inside."""
    mlp: Any = getattr(importlib.import_module(_MODULE), _MLP)
    original = mlp._gaussian_topk

    def gaussian_topk(self: Any, inputs: Tensor) -> Tensor:
        mean = torch.mean(inputs, dim=-1, keepdim=True)
        std = torch.std(inputs, dim=-1, keepdim=True, unbiased=False)
        return F.relu(inputs - (mean + std * multipliers[float(self.activation_sparsity)]))

    mlp._gaussian_topk = gaussian_topk
    try:
        yield
    finally:
        mlp._gaussian_topk = original


def gemma3n_rewrites_for(model: nn.Module) -> Rewrite:
    """What folds the threshold while torch.export traces a Gemma 3n text decoder, and nothing otherwise."""
    multipliers = std_multipliers(model)
    return while_exporting(model, _MLP, lambda: _folded(multipliers))
