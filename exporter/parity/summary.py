"""The failures a refusal's one line names (``kiln export``'s and ``kiln check``'s ``ParityError``).

``ParityResult.failures`` lists every failed check, tensors before generation runs, so a fault that
fails many tensors of one graph would fill a plain cut with them alone, and leave out the other
graphs it reaches and the step where generation first diverged. The cut keeps, in the failures'
own order, the first one (the line a reader and the tests read first), the first of each graph
(``decode``, ``model (empty cache)``, ``prefill.ort``) and of each generation path, and fills up
to ``limit`` with the rest.
"""

from __future__ import annotations

import re

__all__ = ["shown_failures"]

LIMIT = 5
# the prefixes naming a line's reference: the quantized model, or the checkpoint's model beside it
_REFERENCE = re.compile(r"^(?:against [^:]*: |agreement with the checkpoint's model: )")
_GENERATION = "generation via "


def shown_failures(failures: list[str], limit: int = LIMIT) -> list[str]:
    """At most ``limit`` failures, more only where graphs or generation paths outnumber it: the first,
    the first of each graph and generation path, then the others in order."""
    firsts: dict[str, int] = {}
    for index, line in enumerate(failures):
        firsts.setdefault(_subject(line), index)
    kept = {0, *firsts.values()} if failures else set()
    for index in range(len(failures)):
        if len(kept) >= limit:
            break
        kept.add(index)
    return [failures[index] for index in sorted(kept)]


def _subject(line: str) -> str:
    """What a failure line is about: its reference and generation path (``generation via
    ort:prefill+decode``, before the batch) or graph call (``decode``, ``model (empty cache)``,
    ``prefill.ort``, before the batch and the output)."""
    reference = _REFERENCE.match(line)
    prefix = reference.group(0) if reference is not None else ""
    rest = line[len(prefix) :]
    if rest.startswith(_GENERATION):
        return prefix + rest.split(",", 1)[0]
    return prefix + re.sub(r" \(batch \d+\)$", "", rest.split(":", 1)[0])
