"""Writes the Hugging Face architecture table of docs/architectures.md from ``kiln plugins``.

    python docs/architectures.py            # rewrites the table between the markers
    python docs/architectures.py --check    # exit 1 when the file's table differs

The table is the ``hf`` family's ``table()`` (``plugins/hf/__init__.py``, rows from
``plugins/hf/archs.py`` ``ARCHS`` and ``plugins/hf/seq2seq.py`` ``SEQ2SEQ``) with the precision
columns ``kiln plugins`` adds (asked of the export's refusals: ``exporter/support.py``), read from
what ``kiln plugins --json`` prints, rendered as Markdown (the class names and the marks as code),
then the legend of the marks. Nothing else in the file is touched. ``tests/unit/test_docs.py``
fails when the file and ``kiln plugins`` differ.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

__all__ = ["BEGIN", "END", "DOC", "markdown_table", "plugins_entry", "plugins_table", "rewritten", "section"]

DOC = Path(__file__).resolve().parent / "architectures.md"
BEGIN = "<!-- kiln plugins: begin -->"
END = "<!-- kiln plugins: end -->"
FAMILY = "hf"


def plugins_entry() -> dict[str, Any]:
    """The ``hf`` family as ``kiln plugins --json`` prints it (its table, header row first, its
    support cells and its legend)."""
    from click.testing import CliRunner

    from kiln.cli import main

    result = CliRunner().invoke(main, ["plugins", "--json"], catch_exceptions=False)
    if result.exit_code != 0:
        raise RuntimeError(f"kiln plugins --json exited {result.exit_code}: {result.output}")
    families = {family["name"]: family for family in json.loads(result.stdout)}
    entry: dict[str, Any] = families[FAMILY]
    return entry


def plugins_table() -> list[list[str]]:
    """The ``hf`` family's table as ``kiln plugins --json`` prints it (header row first)."""
    table: list[list[str]] = plugins_entry()["table"]
    return table


def markdown_table(table: list[list[str]], code: Collection[str] = ("class",)) -> str:
    """A Markdown table of ``table`` (header first), the columns headed by ``code`` as code, ``|`` escaped."""
    header, *rows = table

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    def coded(row: list[str]) -> list[str]:
        return [f"`{cell}`" if head in code else cell for head, cell in zip(header, row, strict=True)]

    body = [line(coded(row)) for row in rows]
    return "\n".join([line(header), "|" + "---|" * len(header), *body])


def section(entry: dict[str, Any]) -> str:
    """What goes between the markers: the table (class names and marks as code), then the legend's lines as a list."""
    marks = list(entry["support"][0]) if entry["support"] else []
    legend = "\n".join(f"- {line}" for line in entry["legend"])
    return markdown_table(entry["table"], ("class", *marks)) + "\n\n" + legend


def rewritten(text: str, table: str) -> str:
    """``text`` with ``table`` between its one BEGIN and one END marker line."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{DOC.name} must hold one {BEGIN!r} line and, after it, one {END!r} line")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    new = rewritten(text, section(plugins_entry()))
    if argv[1:] == ["--check"]:
        if new != text:
            print(
                f"{DOC}: the architecture table differs from kiln plugins; run: python docs/architectures.py",
                file=sys.stderr,
            )
            return 1
        return 0
    if argv[1:]:
        print("usage: python docs/architectures.py [--check]", file=sys.stderr)
        return 2
    if new != text:
        DOC.write_text(new)
        print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
