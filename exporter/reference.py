"""The PyTorch side of an export: the context limit it may use and the reference module that
parity is measured against (shared by ``export`` and ``check``)."""

from __future__ import annotations

import numpy as np
import torch

from kiln.errors import ExportError
from kiln.exporter.io_contract import ple_table_names
from kiln.exporter.options import ExportOptions
from kiln.exporter.ple import extend_ple
from kiln.plugins import LoadedModel

__all__ = ["resolve_limits", "prepare_reference", "table_feeds"]


def resolve_limits(loaded: LoadedModel, options: ExportOptions) -> int:
    """The exported context length; refuses one longer than the model or its PLE table."""
    spec = loaded.spec
    table = options.ple_extend or spec.ple_positions
    default = min(spec.max_context, table) if table else spec.max_context
    context = options.max_context or default
    if context > spec.max_context:
        raise ExportError(f"--max-context {context} exceeds the model's max_context {spec.max_context}")
    if spec.ple_positions is not None and context > (options.ple_extend or spec.ple_positions):
        rows = options.ple_extend or spec.ple_positions
        raise ExportError(
            f"--max-context {context} is longer than the PLE table ({rows} rows): positions past it would "
            f"gather out of bounds; pass --ple-extend {context} (with --ple-extend-mode clamp|interpolate) or a smaller --max-context"
        )
    if options.ple_extend is not None and spec.ple_positions is None:
        raise ExportError("--ple-extend was given but the model has no PLE tables")
    return context


def table_feeds(tables: list[tuple[torch.Tensor, torch.Tensor]], dtype: str = "float32") -> dict[str, np.ndarray]:
    """The folded PLE tables as feeds, for graphs exported with ``--ple-tables input``."""
    return {
        name: t.detach().numpy().astype(dtype)
        for i, pair in enumerate(tables)
        for name, t in zip(ple_table_names(i), pair, strict=True)
    }


def prepare_reference(loaded: LoadedModel, options: ExportOptions) -> torch.nn.Module:
    """The PyTorch module parity is measured against: the checkpoint's, with its PLE tables
    extended when ``--ple-extend`` asks for it (the extended model is what is deployed)."""
    if options.ple_extend is not None:
        extend_ple(loaded.module, options.ple_extend, options.ple_extend_mode)
    return loaded.module
