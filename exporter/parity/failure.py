"""One failed parity check as data (``ParityResult.failure_records``): what it belongs to, which check it
is and by how much it failed, kept apart so that the refusal's summary (``summary.shown_failures``) groups
failures by their fields rather than by parsing their text; ``text`` is the line people read."""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["ParityFailure"]

FailureKind = Literal["tensor", "generation"]


@dataclasses.dataclass(frozen=True)
class ParityFailure:
    """A failed check that gates. ``subject``: the graph call a tensor check belongs to (``decode``,
    ``model (empty cache)``, ``prefill.ort``) or a generation run's path (``prefill+decode``,
    ``ort:model``); ``check``: the check within it (``decode (batch 1):logits``, ``prefill+decode,
    batch 2``); ``message``: by how much it failed; ``reference``: what it was judged against where an
    export has two references (``against the int4 weights' model``), empty where it has one."""

    kind: FailureKind
    subject: str
    check: str
    message: str
    reference: str = ""

    @property
    def group(self) -> tuple[str, FailureKind, str]:
        """The graph call or generation path, under its reference: what the summary keeps one of."""
        return (self.reference, self.kind, self.subject)

    @property
    def text(self) -> str:
        """``decode (batch 1):logits max abs ...``, ``generation via prefill+decode, batch 2: token match ...``,
        after the reference's ``against the int4 weights' model: `` where there is one."""
        line = (
            f"{self.check} {self.message}" if self.kind == "tensor" else f"generation via {self.check}: {self.message}"
        )
        return f"{self.reference}: {line}" if self.reference else line

    def __str__(self) -> str:
        return self.text

    def against(self, reference: str) -> ParityFailure:
        """This failure judged against ``reference`` (named before any reference it already has)."""
        return dataclasses.replace(self, reference=f"{reference}: {self.reference}" if self.reference else reference)
