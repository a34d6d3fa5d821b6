"""The native family's PLE folding hook (docs/how-it-works.md, fold): every PLE sub-layer becomes two constant tables.

Pre-norm, for position p (``gamma``, ``beta`` the norm's affine weights, beta = 0 for RMSNorm)::

    x + ple(norm(x), p) = x + normalize(x) * S[p] + B[p]
    S[p] = gamma * (1 + g(a_p))        B[p] = beta * (1 + g(a_p)) + b_p

Post-norm, ``norm(x + ple(x, p)) = norm(x * S[p] + B[p])`` with ``S[p] = 2 + g(a_p)``,
``B[p] = b_p`` (the norm after the residual keeps its affine weights).

The projection ``E[p] @ W + c``, the split, the tanh and the norm's affine weights disappear:
what is traced is Gather + Mul + Add.
"""

from __future__ import annotations

import copy
import typing

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.errors import ExportError
from kiln.plugins.base import PLEExtendMode
from kiln.plugins.native.model import Norm, PLESubLayer

__all__ = ["FoldedPLE", "NativePLE", "NATIVE_PLE", "fold_ple", "extend_ple", "ple_sublayers", "folded_tables"]


class FoldedPLE(nn.Module):
    """A PLE sub-layer as two ``[positions, d_model]`` tables gathered by position."""

    def __init__(self, pre: bool, norm: Norm, scale: Tensor, shift: Tensor) -> None:
        super().__init__()
        self.pre, self.norm = pre, norm
        self.register_buffer("scale", scale.contiguous())
        self.register_buffer("shift", shift.contiguous())

    def forward(self, x: Tensor, positions: Tensor, tables: tuple[Tensor, Tensor] | None = None) -> Tensor:
        scale, shift = tables if tables is not None else self.tables()
        s, b = F.embedding(positions, scale), F.embedding(positions, shift)  # Gather: [B, S, d] each
        out: Tensor = x + self.norm.normalize(x) * s + b if self.pre else self.norm(x * s + b)
        return out

    def tables(self) -> tuple[Tensor, Tensor]:
        return typing.cast(Tensor, self.scale), typing.cast(Tensor, self.shift)  # buffers


def ple_sublayers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every PLE sub-layer (folded or not), in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (PLESubLayer, FoldedPLE))]


@torch.no_grad()
def _tables(sub: PLESubLayer) -> tuple[Tensor, Tensor]:
    """The folded tables, computed in fp32 whatever the checkpoint's dtype (the graphs compute in
    fp32 or in fp16 from fp32 values: a table rounded through bf16 would be a different model)."""
    sub = copy.deepcopy(sub).float()  # one small sub-layer: a norm and a position table
    rows = sub.ple.table.num_embeddings
    scale, shift = sub.ple.scale_shift(torch.arange(rows))  # (1 + g(a)), b: [rows, d]
    if not sub.pre:
        return scale + 1.0, shift
    gamma = sub.norm.weight
    beta = sub.norm.bias if sub.norm.bias is not None else torch.zeros_like(gamma)
    return gamma * scale, beta * scale + shift


@torch.no_grad()
def fold_ple(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every PLE sub-layer folded. Parameters are shared with
    ``model``, not copied, so folding a large model does not double its memory."""
    shared = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    folded = copy.deepcopy(model, memo=shared)
    for name, sub in ple_sublayers(folded):
        if isinstance(sub, PLESubLayer):
            scale, shift = _tables(sub)
            parent_name, _, attr = name.rpartition(".")
            setattr(folded.get_submodule(parent_name), attr, FoldedPLE(sub.pre, sub.norm, scale, shift))
    return folded.eval()


@torch.no_grad()
def extend_ple(model: nn.Module, rows: int, mode: PLEExtendMode) -> None:
    """Replace every PLE position table of ``model`` (unfolded) by a ``rows``-row table, in place.

    clamp: row p is the trained row min(p, M-1). interpolate: row p samples the trained table
    linearly at p * (M-1) / (rows-1) (position interpolation).
    """
    for _, sub in ple_sublayers(model):
        if not isinstance(sub, PLESubLayer):
            raise ExportError("extend the PLE tables before folding them")
        old = sub.ple.table.weight  # [M, e]
        m = old.shape[0]
        if mode is PLEExtendMode.CLAMP:
            new = old[torch.arange(rows).clamp(max=m - 1)]
        else:
            where = torch.arange(rows, dtype=torch.float64) * (m - 1) / (rows - 1)
            lo = where.floor().long().clamp(max=m - 1)
            hi = (lo + 1).clamp(max=m - 1)
            frac = (where - lo).to(old.dtype)[:, None]
            new = old[lo] * (1 - frac) + old[hi] * frac
        # untyped in torch
        sub.ple.table = nn.Embedding.from_pretrained(new.contiguous(), freeze=True)  # type: ignore[no-untyped-call]


def folded_tables(folded: nn.Module) -> list[tuple[Tensor, Tensor]]:
    """The ``(scale, shift)`` tables of every folded PLE sub-layer, in module order."""
    return [m.tables() for _, m in ple_sublayers(folded) if isinstance(m, FoldedPLE)]


class NativePLE:
    """``plugins.base.PLEFolding`` for the native decoder."""

    def fold(self, module: nn.Module) -> nn.Module:
        return fold_ple(module)

    def extend(self, module: nn.Module, rows: int, mode: PLEExtendMode) -> None:
        extend_ple(module, rows, mode)

    def sublayers(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        return ple_sublayers(module)

    def tables(self, folded: nn.Module) -> list[tuple[Tensor, Tensor]]:
        return folded_tables(folded)


NATIVE_PLE = NativePLE()
