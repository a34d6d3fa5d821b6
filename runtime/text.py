"""Text of the tokens ``kiln generate`` produces, as they come: decoded incrementally for the
terminal, and cut where a ``--stop`` string first appears."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TextStream"]

_INCOMPLETE = "\ufffd"  # what a byte-level tokenizer decodes a partial UTF-8 character to


class TextStream:
    """The decoded text of the tokens added so far, handed out in final pieces. A piece is held
    back while the text ends in a partial character or in what may be the start of a stop string;
    the text ends right before the first stop string (which is not part of it), and
    ``stopped`` says that one was reached."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(s for s in stops if s)
        self._tokens: list[int] = []
        self._released = 0  # characters of ``text`` handed out
        self.text = ""
        self.stopped = False

    def add(self, token: int) -> str:
        """Take the next token; return the text that became final with it ('' if none did)."""
        self._tokens.append(token)
        full: str = self._tokenizer.decode(self._tokens)
        cuts = [i for i in (full.find(s) for s in self._stops) if i >= 0]
        if cuts:
            self.stopped, full = True, full[: min(cuts)]
            safe = len(full)
        else:
            safe = len(full.rstrip(_INCOMPLETE))
            safe -= max(
                (n for s in self._stops for n in range(len(s) - 1, 0, -1) if full[:safe].endswith(s[:n])), default=0
            )
        self.text = full
        piece = full[self._released : max(safe, self._released)]
        self._released += len(piece)
        return piece

    def rest(self) -> str:
        """What is still held back, once no token will follow."""
        piece = self.text[self._released :]
        self._released = len(self.text)
        return piece
