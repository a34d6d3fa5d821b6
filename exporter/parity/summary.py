"""The failures a refusal's one line names (``kiln export``'s and ``kiln check``'s ``ParityError``).

``ParityResult.failure_records`` lists every failed check, tensors before generation runs, so a fault
that fails many tensors of one graph would fill a plain cut with them alone, and leave out the other
graphs it reaches and the step where generation first diverged. The cut keeps, in the failures'
own order, the first one (the line a reader and the tests read first), the first of each graph
call (``decode``, ``model (empty cache)``, ``prefill.ort``) and of each generation path under each
reference (``ParityFailure.group``), and fills up to ``limit`` with the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.exporter.parity.failure import ParityFailure

__all__ = ["shown_failures"]

LIMIT = 5


def shown_failures(failures: Sequence[ParityFailure], limit: int = LIMIT) -> list[str]:
    """The lines of at most ``limit`` failures, more only where graphs or generation paths outnumber it:
    the first, the first of each graph and generation path, then the others in order."""
    firsts: dict[tuple[str, str, str], int] = {}
    for index, failure in enumerate(failures):
        firsts.setdefault(failure.group, index)
    kept = {0, *firsts.values()} if failures else set()
    for index in range(len(failures)):
        if len(kept) >= limit:
            break
        kept.add(index)
    return [failures[index].text for index in sorted(kept)]
