"""Progress of long work: one bar with an ETA per stage (rich, on a terminal's stderr), plain lines
(stderr that is a log file or a pipe: nothing redraws or wraps), or nothing."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any, Protocol, TextIO

__all__ = ["Progress", "Stage", "NullProgress", "LineProgress", "RichProgress", "Timed"]


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


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class LineProgress:
    """Plain lines on ``stream``: one per finished stage (its count, seconds and the run's time),
    one every ``every`` seconds inside a long stage (its count and ETA), and each note as it
    comes; with ``stages=False`` the notes only (``--json``: stdout is the JSON)."""

    def __init__(self, stream: TextIO | None = None, every: float = 30.0, stages: bool = True) -> None:
        self._stream = stream or sys.stderr
        self._every, self._stages = every, stages
        self._began = time.monotonic()
        self._depth = 0

    def _line(self, text: str) -> None:
        print(text, file=self._stream, flush=True)

    @contextlib.contextmanager
    def stage(self, description: str, total: int = 1) -> Iterator[Stage]:
        label = "  " * self._depth + description
        stage = _LineStage(label, total, self._every, self._line if self._stages else lambda text: None, self._began)
        self._depth += 1
        try:
            yield stage
        finally:
            self._depth -= 1
        if self._stages:
            self._line(
                f"{label}: {total}/{total} in {time.monotonic() - stage.start:.1f} s (run "
                f"{_clock(time.monotonic() - self._began)})"
            )

    def note(self, message: str) -> None:
        self._line(message)


class _LineStage:
    def __init__(self, label: str, total: int, every: float, line: Any, began: float) -> None:
        self._label, self._total, self._every, self._print, self._began = label, total, every, line, began
        self.start = self._last = time.monotonic()
        self._done = 0

    def advance(self, steps: int = 1) -> None:
        self._done += steps
        now = time.monotonic()
        if now - self._last >= self._every and 0 < self._done < self._total:
            self._last = now
            eta = (now - self.start) / self._done * (self._total - self._done)
            self._print(
                f"{self._label}: {self._done}/{self._total}, {now - self.start:.0f} s, eta {_clock(eta)} (run "
                f"{_clock(now - self._began)})"
            )


class RichProgress:
    """A bar per stage on stderr (left on screen when the stage completes), each row with the
    stage's count, elapsed time and ETA, and the time since the run began. A stage may open
    inside another (int8 calibration inside a graph's passes): it gets its own row in the same
    display."""

    def __init__(self, console: Any = None) -> None:
        from rich.console import Console

        self._console = console if console is not None else Console(stderr=True)
        self._began = time.monotonic()
        self._live: Any = None  # the rich Progress of the outermost open stage
        self._depth = 0

    def _display(self) -> Any:
        if self._live is None:
            from rich.progress import Progress as _Progress

            columns = _columns(self._console.width, self._began)
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
        self._console.print(message, soft_wrap=True, markup=False, highlight=False)


# The columns' widths beside the description (rich puts one space between columns): "12/345" counts,
# "0:01:02" elapsed, "eta", "0:00:10" remaining, "run 0:01:02"; the bar when there is room.
_COUNTS, _CLOCK, _ETA, _RUN, _BAR, _DESCRIPTION = 9, 7, 3, 11, 16, 30


def _columns(width: int, began: float) -> tuple[Any, ...]:
    """The rows' columns fitted to ``width`` (at 80 columns every figure was cut to ``0:00...``): the
    bar goes first, then the run's clock, and the description is cut with an ellipsis, never the figures."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.table import Column

    figures = [_COUNTS, _CLOCK, _ETA, _CLOCK]
    with_run = sum(figures) + len(figures) + _RUN + 1 + 12 <= width  # room for 12 characters of description
    used = sum(figures) + len(figures) + (_RUN + 1 if with_run else 0)
    with_bar = _DESCRIPTION + used + _BAR + 1 <= width
    description = max(8, min(_DESCRIPTION, width - used - (_BAR + 1 if with_bar else 0) - 1))
    counts = Column(width=_COUNTS, no_wrap=True, justify="right")
    return (
        TextColumn("{task.description}", table_column=Column(width=description, no_wrap=True, overflow="ellipsis")),
        *((BarColumn(bar_width=_BAR),) if with_bar else ()),
        MofNCompleteColumn(table_column=counts),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        *((_since_column(began),) if with_run else ()),
    )


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
