"""What ``kiln plugins`` prints: each model family, its table, and what each row exports per
precision and target (``exporter.support``, asked of the export's own refusals), fitted to the
terminal; ``--json`` gives the same entries whole.

A family's table and specs are optional (``plugins.base.ModelFamily``): ``table()`` is a header
row and rows of strings; ``specs()`` one ``DecoderSpec`` per row, whose precision columns
(``fp32`` and each kind: a letter per target, ``exporter.support.Support.marks``) follow the
row's first cell, with a legend under the table.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

__all__ = ["MIN_WIDTH", "entry", "fit", "render"]

MIN_WIDTH = 40  # narrower terminals get 40-column lines (a table has no useful layout below it)
_GAP = "  "  # between columns
_INDENT = 2  # a table's rows and legend under its family's line
_NAME = 10  # a family's name column


def entry(family: Any) -> dict[str, Any]:
    """A family as ``kiln plugins --json`` prints it: its table with the precision columns, what
    each row's cells are (taken, on which condition, refused with which message) and the legend."""
    from kiln.exporter.support import legend, precisions, support

    table: list[list[str]] = getattr(family, "table", list)()
    specs: list[Any] = getattr(family, "specs", list)() if table else []  # DecoderSpec, one per row
    supports = [support(spec) for spec in specs]
    if supports:
        if len(supports) != len(table) - 1:
            rows = len(table) - 1
            raise ValueError(f"family {family.name!r}: specs() gives {len(supports)} specs for {rows} table rows")
        marks = [list(precisions()), *(s.marks() for s in supports)]
        table = [[row[0], *extra, *row[1:]] for row, extra in zip(table, marks, strict=True)]
    return {
        "name": family.name, "description": family.description, "module": type(family).__module__, "table": table,
        "support": [s.to_dict() for s in supports], "legend": legend(supports) if supports else [],
        "unavailable": getattr(family, "unavailable", lambda: None)(),
    }  # fmt: skip


def render(entries: Sequence[dict[str, Any]], width: int) -> list[str]:
    """The entries as lines of at most ``width`` columns (``MIN_WIDTH`` at least), a blank line between families."""
    width = max(width, MIN_WIDTH)
    lines: list[str] = []
    for i, family in enumerate(entries):
        lines += [""] if i else []
        head = f"{family['name']:<{_NAME}} "
        lines += _wrapped(f"{head}{family['description']}  [{family['module']}]", width, len(head))
        if family["unavailable"]:
            lines += _wrapped(" " * len(head) + family["unavailable"], width, len(head))
        lines += fit(family["table"], width) if family["table"] else []
        for line in family["legend"]:
            lines += _wrapped(" " * _INDENT + line, width, _INDENT + 4)
    return lines


def fit(table: Sequence[Sequence[str]], width: int, indent: int = _INDENT) -> list[str]:
    """``table`` (header first) in lines of at most ``width``: as many leading columns as fit side
    by side, padded to their widest cell; a row's other cells under it, one ``header: cell`` a
    line, wrapped (a first cell wider than the line itself is wrapped too)."""
    header = table[0]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    shown = _fitting(widths, width - indent)
    lines = []
    for n, row in enumerate(table):
        cells = _GAP.join(cell.ljust(w) for cell, w in zip(row[:shown], widths[:shown], strict=True)).rstrip()
        lines += _wrapped(" " * indent + cells, width, indent + 4)
        if n:
            for head, cell in zip(header[shown:], row[shown:], strict=True):
                lines += _wrapped(f"{' ' * (indent + 4)}{head}: {cell}", width, indent + 6) if cell else []
    return lines


def _fitting(widths: Sequence[int], room: int) -> int:
    """How many leading columns of these widths fit side by side in ``room`` (one at least)."""
    used = widths[0]
    for shown, w in enumerate(widths[1:], start=1):
        used += len(_GAP) + w
        if used > room:
            return shown
    return len(widths)


def _wrapped(line: str, width: int, indent: int) -> list[str]:
    """``line`` as it is when it fits, else wrapped to ``width``, its further lines indented by ``indent``."""
    if len(line) <= width:
        return [line]
    lead = len(line) - len(line.lstrip(" "))
    first, rest = " " * lead, " " * indent
    return textwrap.wrap(line.lstrip(" "), width, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)
