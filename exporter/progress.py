"""Progress of long work: one bar with an ETA per stage (rich, on stderr), or nothing."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Protocol

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
    """A bar per stage on stderr (left on screen when the stage completes), each row with the
    stage's count, elapsed time and ETA, and the time since the run began. A stage may open
    inside another (int8 calibration inside a graph's passes): it gets its own row in the same
    display."""

    def __init__(self) -> None:
        from rich.console import Console

        self._console = Console(stderr=True)
        self._began = time.monotonic()
        self._live: Any = None  # the rich Progress of the outermost open stage
        self._depth = 0

    def _display(self) -> Any:
        if self._live is None:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as _Progress

            columns = (
                TextColumn("{task.description:<30}"), BarColumn(bar_width=16), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                _since_column(self._began),
            )
            self._live = _Progress(*columns, console=self._console, transient=False)
            self._live.start()
        return self._live

    @contextlib.contextmanager
    def stage(self, description: str, total: int = 1) -> Iterator[Stage]:
        live = self._display()
        task = live.add_task(("  " * self._depth) + description, total=total)
        self._depth += 1
        try:
            yield _RichStage(live, task)
            live.update(task, completed=total)
        finally:
            self._depth -= 1
            if self._depth == 0:
                live.stop()
                self._live = None

    def note(self, message: str) -> None:
        self._console.print(message)


class _RichStage:
    def __init__(self, live: Any, task: Any) -> None:
        self._live, self._task = live, task

    def advance(self, steps: int = 1) -> None:
        self._live.advance(self._task, steps)


def _since_column(began: float) -> Any:
    from rich.progress import ProgressColumn
    from rich.text import Text

    class SinceColumn(ProgressColumn):
        """The whole run's elapsed time (every stage's row shows it)."""

        def render(self, task: Any) -> Text:
            seconds = int(time.monotonic() - began)
            return Text(f"run {seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}", style="progress.elapsed")

    return SinceColumn()


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
