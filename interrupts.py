"""SIGINT and SIGTERM, handled alike: the work in progress is abandoned and nothing is written.

The handler raises ``Interrupted`` (a ``KeyboardInterrupt``) where the main thread is; it also
records the signal, because the exception may be swallowed (a library's ``except BaseException``,
a finalizer): ``raise_if_interrupted`` lets the last step before anything is committed (renaming a
staged directory into place) refuse even then. The commit itself runs ``deferred``: a signal
that arrives during it lands after it, so an output is never left half renamed.

Where an exception must not be raised, the signal is recorded and raised later (issue 38):

- inside an import: a ``KeyboardInterrupt`` there leaves a module half initialised (numpy's, ONNX
  Runtime's: an ``ImportError`` later; torch's: a pybind11 abort). The signal is raised when the
  import ends (asked again every ``_RETRY_S`` on SIGALRM); likewise inside a finalizer;
- before the command starts: the CLI process ``hold``s both signals before its own imports (a
  Ctrl-C there gave a traceback); ``install`` raises what arrived meanwhile;
- after the command: ``finish`` makes the CLI process record signals only, so its interpreter's
  shutdown (ONNX Runtime's and PyTorch's teardown) is never interrupted; a test or a library
  caller gets its own handlers back instead.

``wrote`` records what a command committed, so that a signal after the commit says so
(``message``) instead of claiming that nothing was written.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI holds signals once this module is loaded: the less it imports, the sooner
    from collections.abc import Iterator
    from pathlib import Path
    from types import FrameType

__all__ = [
    "Interrupted",
    "deferred",
    "finish",
    "hold",
    "hold_if_program",
    "is_program",
    "install",
    "message",
    "raise_if_interrupted",
    "received",
    "wrote",
]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_RETRY_S = 0.02  # how soon a signal that landed in an import (``_unsafe``) is raised again, from SIGALRM
_received: list[int] = []
_deferring: list[bool] = []  # non-empty inside ``deferred()``
_written: list[str] = []  # what the command committed whole (``wrote``), for ``message``


class _State:
    def __init__(self) -> None:
        self.raising = False  # between ``install`` and ``finish``: a signal raises where the main thread is
        self.program = False  # ``hold`` was called: this process runs the CLI, whose handlers stay to its end
        self.previous: dict[int, Any] = {}  # the handlers that ``finish`` puts back (not in the CLI)


_state = _State()


class Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _unsafe(frame: FrameType | None) -> bool:
    """Whether an exception raised where the main thread is would do harm: inside an import
    (importlib's frames are on its stack) or a finalizer (``__del__``: Python prints the
    exception, "Exception ignored in", and goes on)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib") or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _raise_when_safe(signum: int, frame: FrameType | None) -> None:
    """Raise ``Interrupted`` now unless held, deferred, or unsafe (``_unsafe``: SIGALRM asks again soon)."""
    if not _state.raising or _deferring:
        return
    if _unsafe(frame):
        if signal.getsignal(signal.SIGALRM) is not _on_alarm:
            _state.previous.setdefault(signal.SIGALRM, signal.getsignal(signal.SIGALRM))
            signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, _RETRY_S)
        return
    raise Interrupted(signum)


def _handle(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)
    _raise_when_safe(signum, frame)


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    if _received:
        _raise_when_safe(_received[0], frame)


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


def hold() -> None:
    """Record SIGINT and SIGTERM from now on, raising nothing until ``install``: the CLI process
    calls this before its imports, which an exception would leave half done."""
    _state.program = True
    for sig in _SIGNALS:
        signal.signal(sig, _handle)


def is_program() -> bool:
    """Whether this process runs the CLI as its program (``hold`` was called), not a test or a library."""
    return _state.program


def hold_if_program(module: str) -> None:
    """``hold`` when this process runs the CLI as its program (``python -m kiln.cli``: ``module``
    is ``__main__``; the ``kiln`` console script), not when a test or a library imports it."""
    if module == "__main__" or os.path.basename(getattr(sys, "argv", [""])[0] or "") == "kiln":
        hold()


def install() -> None:
    """Handle SIGINT and SIGTERM by raising ``Interrupted`` (the CLI does this when a command
    starts; a library caller keeps its own handlers); a signal held since ``hold`` is raised now."""
    if not _state.program:  # a test process runs one command after another: each starts afresh
        _received.clear()
        _state.previous = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    _written.clear()
    for sig in _SIGNALS:
        signal.signal(sig, _handle)
    _state.raising = True
    raise_if_interrupted()


def finish() -> None:
    """The command is over (its last line printed or its error about to be): the CLI process
    ignores signals from here, a test or a library caller gets its own handlers back. Ignored, not
    recorded: Python's finalization puts every handler written in Python back to the default, so a
    signal during the interpreter's shutdown killed a command that had finished (exit -2 or -15
    after its last line, found by tests/export/test_fuzz_signals.py); an ignored one stays ignored."""
    _state.raising = False
    if signal.getsignal(signal.SIGALRM) is _on_alarm:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if _state.program:
        for ignored in _SIGNALS:
            signal.signal(ignored, signal.SIG_IGN)
        return
    for sig, handler in _state.previous.items():
        if handler is not None:
            signal.signal(sig, handler)
    _state.previous = {}


def raise_if_interrupted() -> None:
    if _received:
        raise Interrupted(_received[0])


def received() -> int | None:
    """The first signal received since the command started, if any."""
    return _received[0] if _received else None


def wrote(path: Path) -> None:
    """Record that ``path`` (an export, or a part of one) was committed whole: a signal from now on
    must say so, not that nothing was written."""
    _written.append(str(path))


def message(signum: int) -> str:
    """The one line a command interrupted by ``signum`` ends with: true before a commit and after."""
    name = signal.Signals(signum).name
    if not _written:
        return f"interrupted ({name}): nothing was written"
    verb = "was" if len(_written) == 1 else "were"
    return f"interrupted ({name}) after {' and '.join(_written)} {verb} written: the export is whole"
