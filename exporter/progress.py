"""Progress of long work: one bar with an ETA per stage (rich, on stderr), or nothing."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Protocol

__all__ = ["Progress", "Stage", "NullProgress", "RichProgress", "Timed"]


class Stage(Protocol):
    def advance(self, steps: int = 1) -> None: ...


class Progress(Protocol):
    def stage(self, description: str, total: int = 1) -> contextlib.AbstractContextManager[Stage]: ...

    def note(self, message: str) -> None: ...


class _NullStage:
    def advance(self, steps: int = 1) -> None:
        return None


class NullProgress:
    """Reports nothing (``--json``, library use, tests)."""

    @contextlib.contextmanager
    def stage(self, description: str, total: int = 1) -> Iterator[Stage]:
        yield _NullStage()

    def note(self, message: str) -> None:
        return None


class RichProgress:
    """A bar per stage on stderr, left on screen when the stage completes."""

    def __init__(self) -> None:
        from rich.console import Console

        self._console = Console(stderr=True)

    @contextlib.contextmanager
    def stage(self, description: str, total: int = 1) -> Iterator[Stage]:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as _Progress

        columns = (TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
        with _Progress(*columns, console=self._console, transient=False) as bar:
            task = bar.add_task(description, total=total)

            class _Stage:
                def advance(self, steps: int = 1) -> None:
                    bar.advance(task, steps)

            yield _Stage()
            bar.update(task, completed=total)

    def note(self, message: str) -> None:
        self._console.print(message)


class Timed:
    """Any ``Progress``, recording how long each stage took (``kiln export --json`` reports it);
    a description seen twice adds up."""

    def __init__(self, inner: Progress) -> None:
        self._inner = inner
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, description: str, total: int = 1) -> Iterator[Stage]:
        start = time.perf_counter()
        try:
            with self._inner.stage(description, total) as stage:
                yield stage
        finally:
            self.seconds[description] = self.seconds.get(description, 0.0) + time.perf_counter() - start

    def note(self, message: str) -> None:
        self._inner.note(message)
