"""SIGINT and SIGTERM, handled alike: the work in progress is abandoned and nothing is written.

The handler raises ``Interrupted`` (a ``KeyboardInterrupt``) where the main thread is; it also
records the signal, because Python ignores an exception raised while a finalizer (``__del__``)
runs: ``raise_if_interrupted`` lets the last step before anything is committed (renaming a
staged directory into place) refuse even then. The commit itself runs ``deferred``: a signal
that arrives during it lands after it, so an output is never left half renamed.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

__all__ = ["Interrupted", "deferred", "install", "raise_if_interrupted"]

_received: list[int] = []
_deferring: list[bool] = []  # non-empty inside ``deferred()``


class Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _handle(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)
    if not _deferring:
        raise Interrupted(signum)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A signal received inside is recorded, not raised: what runs inside (renaming a staged
    directory into place and the manifest naming it) completes whole. The command then ends as
    it would have (its work is committed); a later ``raise_if_interrupted`` still sees it."""
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()


def install() -> None:
    """Handle SIGINT and SIGTERM (the CLI does this; a library caller keeps its own handlers)."""
    _received.clear()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _handle)


def raise_if_interrupted() -> None:
    if _received:
        raise Interrupted(_received[0])
