"""The context an export is written for: ``--max-context``, else the model's own limit (its PLE
table's rows where it has one), and the refusals of it, a plan-stage refusal (``exporter.plan``)
asked once the model's structure is known (a config's will do, before any weight is read)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.exporter.contract.limits import MAX_CONTEXT, MIN_CONTEXT

if TYPE_CHECKING:
    from kiln.exporter.options import ExportOptions
    from kiln.plugins.base import DecoderSpec

__all__ = ["context_reasons", "exported_context"]


def exported_context(spec: DecoderSpec, options: ExportOptions) -> int | None:
    """The exported context length (None: neither the options nor the model give one)."""
    table = options.ple.extend or spec.ple_positions
    limit = spec.max_context
    return options.graphs.max_context or (min(limit, table) if table and limit else limit or table)


def context_reasons(spec: DecoderSpec | None, options: ExportOptions) -> list[str]:
    """Why the exported context cannot be written: none, one longer than the model or its PLE
    table, or one outside what an export may declare (the first of these, one line)."""
    if spec is None:
        return []
    context = exported_context(spec, options)
    if context is None:
        return [f"{spec.max_context_why or 'the model has no context limit'}: pass --max-context N"]
    if not MIN_CONTEXT <= context <= MAX_CONTEXT:  # a config's limit (--max-context is ranged at the command line)
        return [
            f"the model's max_context {context} is outside what an export can declare ({MIN_CONTEXT} to {MAX_CONTEXT})"
            + ("; pass --max-context N" if context > MAX_CONTEXT else "")
        ]
    limit = spec.max_context
    if limit is not None and context > limit:
        why = f" ({spec.max_context_why})" if spec.max_context_why else ""
        return [f"--max-context {context} exceeds the model's max_context {limit}{why}"]
    rows = options.ple.extend or spec.ple_positions
    if spec.ple_positions is not None and rows is not None and context > rows:
        return [
            f"--max-context {context} is longer than the PLE table ({rows} rows): positions past it would "
            f"gather out of bounds; pass --ple-extend {context} (with --ple-extend-mode clamp|interpolate) or a "
            "smaller --max-context"
        ]
    if options.ple.extend is not None and spec.ple_positions is None:
        return ["--ple-extend was given but the model has no PLE tables"]
    return []
