"""SIGINT and SIGTERM, handled alike: the work in progress is abandoned and nothing is written.

The handler raises ``Interrupted`` (a ``KeyboardInterrupt``) where the main thread is; it also
records the signal, because Python ignores an exception raised while a finalizer (``__del__``)
runs: ``raise_if_interrupted`` lets the last step before anything is committed (renaming a
staged directory into place) refuse even then.
"""

from __future__ import annotations

import signal
from types import FrameType

__all__ = ["Interrupted", "install", "raise_if_interrupted"]

_received: list[int] = []


class Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _handle(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)
    raise Interrupted(signum)


def install() -> None:
    """Handle SIGINT and SIGTERM (the CLI does this; a library caller keeps its own handlers)."""
    _received.clear()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _handle)


def raise_if_interrupted() -> None:
    if _received:
        raise Interrupted(_received[0])
