"""The fold stage: every PLE sub-layer becomes two constant tables (docs/how-it-works.md, fold), through
the family's folding hook (``plugins.base.PLEFolding``: the exporter never looks inside a
family), checked against the unfolded sub-layers at every table position before tracing."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch
from torch import Tensor, nn

from kiln.errors import ExportError
from kiln.exporter.contract.io import ple_table_names
from kiln.plugins.base import PLEFolding

__all__ = ["Folded", "FoldCheck", "fold", "check_folding", "table_feeds"]


@dataclasses.dataclass(frozen=True)
class FoldCheck:
    name: str
    positions: int
    max_abs_error: float


@dataclasses.dataclass(frozen=True)
class Folded:
    """The module that is traced, and its folded tables (empty for a family without PLE)."""

    module: nn.Module
    checks: tuple[FoldCheck, ...]
    tables: tuple[tuple[Tensor, Tensor], ...]  # per PLE sub-layer: (scale, shift), [rows, d_model] each

    @property
    def table_shapes(self) -> tuple[tuple[int, int], ...]:
        return tuple((int(s.shape[0]), int(s.shape[1])) for s, _ in self.tables)


def fold(module: nn.Module, ple: PLEFolding | None) -> Folded:
    """``module`` with its PLE sub-layers folded (weights shared, not copied) and checked."""
    if ple is None:
        return Folded(module, (), ())
    folded = ple.fold(module)
    return Folded(folded, tuple(check_folding(ple, module, folded)), tuple(ple.tables(folded)))


@torch.no_grad()
def check_folding(
    ple: PLEFolding, reference: nn.Module, folded: nn.Module, seed: int = 0, tolerance: float = 1e-5
) -> list[FoldCheck]:
    """Folded against unfolded sub-layers at every position of the table, on random states."""
    gen = torch.Generator().manual_seed(seed)
    ref_subs, fold_subs = ple.sublayers(reference), ple.sublayers(folded)
    checks: list[FoldCheck] = []
    tables = ple.tables(folded)
    for (name, ref), (_, sub) in zip(ref_subs, fold_subs, strict=True):
        rows, d = (int(n) for n in tables[len(checks)][0].shape)
        x = 2.0 * torch.randn(2, rows, d, generator=gen)  # [2, rows, d]
        positions = torch.arange(rows).expand(2, rows)
        want, got = (
            copy.deepcopy(ref).float()(x, positions),
            copy.deepcopy(sub).float()(x, positions),
        )  # in fp32, as the graphs compute
        err = float((want - got).abs().max())
        scale = float(want.abs().max()) or 1.0
        checks.append(FoldCheck(name, rows, err))
        if not err <= tolerance * max(1.0, scale):
            raise ExportError(
                f"PLE folding of {name} differs from the unfolded sub-layer by {err:.3g} (tolerance {tolerance:g})"
            )
    return checks


def table_feeds(tables: list[tuple[torch.Tensor, torch.Tensor]], dtype: str = "float32") -> dict[str, np.ndarray]:
    """The folded PLE tables as feeds, for graphs exported with ``--ple-tables input``."""
    return {
        name: t.detach().numpy().astype(dtype)
        for i, pair in enumerate(tables)
        for name, t in zip(ple_table_names(i), pair, strict=True)
    }
