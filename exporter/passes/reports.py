"""One channel for what passes did.

A pass with something to say implements ``Reports``: a stable ``report_name`` (``"int8"``,
``"attention"``: the manifest's key, not a class name) and a JSON-able ``report`` (None while it has
nothing to say). A graph set records ``pass_reports(passes)`` for each graph it writes, and the
manifest carries them as ``graphs.<kind>.passes`` and ``targets.<target>.graphs.<kind>.passes``;
a stage that needs a figure of one (the int4 record, the fp16 islands of the parity report) reads
it there, through the pass's own reader, never through attributes named three ways.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

__all__ = ["Report", "Reports", "pass_reports"]

Report = dict[str, Any]  # JSON-able: str/int/float/bool/None, lists and dicts of them


@runtime_checkable
class Reports(Protocol):
    """A pass whose result the manifest records."""

    report_name: str

    @property
    def report(self) -> Report | None: ...


def pass_reports(passes: Iterable[object]) -> dict[str, Report]:
    """``{report_name: report}`` of the passes that report, in pass order; two passes of one graph
    under one name are a programming error."""
    out: dict[str, Report] = {}
    for pass_ in passes:
        if not isinstance(pass_, Reports) or (report := pass_.report) is None:
            continue
        if pass_.report_name in out:
            raise ValueError(f"two passes of one graph report as {pass_.report_name!r}")
        out[pass_.report_name] = report
    return out
