"""Progress where stderr is not a terminal: plain lines that neither wrap nor redraw, each stage's
count and seconds, a line with an ETA inside a long stage, notes whole."""

from __future__ import annotations

import io
import re

import pytest

from kiln.exporter.progress import LineProgress, RichProgress

NOTE = "checkpoint: " + "x" * 150 + " (a note longer than any terminal)"


def test_a_stage_is_one_line_with_its_count_and_seconds() -> None:
    stream = io.StringIO()
    progress = LineProgress(stream, every=3600.0)
    with progress.stage("trace", total=3) as stage:
        for _ in range(3):
            stage.advance()
    progress.note(NOTE)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and re.fullmatch(r"trace: 3/3 in \d+\.\d s \(run 0:00:0\d\)", lines[0]) and lines[1] == NOTE


def test_a_long_stage_reports_its_count_and_eta() -> None:
    stream = io.StringIO()
    progress = LineProgress(stream, every=0.0)
    with progress.stage("outer"):
        with progress.stage("GPTQ: windows", total=4) as stage:
            for _ in range(4):
                stage.advance()
    lines = stream.getvalue().splitlines()
    assert [line.split(":")[0] for line in lines] == ["  GPTQ"] * 4 + [
        "outer"
    ]  # nested stages indented; the 4th is the stage's end
    assert re.fullmatch(r"  GPTQ: windows: 1/4, \d+ s, eta 0:00:\d\d \(run 0:00:\d\d\)", lines[0])
    assert lines[3].startswith("  GPTQ: windows: 4/4 in ")


def test_notes_only() -> None:
    stream = io.StringIO()
    progress = LineProgress(stream, stages=False)
    with progress.stage("trace", total=2) as stage:
        stage.advance(2)
    progress.note("removed .out.tmp-1: ...")
    assert stream.getvalue() == "removed .out.tmp-1: ...\n"


def test_rich_notes_do_not_wrap(capsys: pytest.CaptureFixture[str]) -> None:
    RichProgress().note(NOTE + " [bold]not markup[/bold]")
    assert capsys.readouterr().err == NOTE + " [bold]not markup[/bold]\n"


def _rendered_rows(width: int) -> list[str]:
    from rich.console import Console

    buffer = io.StringIO()
    progress = RichProgress(Console(file=buffer, width=width, force_terminal=True, color_system=None))
    with progress.stage("prefill.onnx: graph passes of a long name", total=345) as outer:
        outer.advance(12)
        with progress.stage("parity: PyTorch reference", total=5) as inner:
            inner.advance(2)
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buffer.getvalue()).replace("\r", "\n")
    return [line for line in plain.splitlines() if line.strip()][-2:]


@pytest.mark.parametrize("width", [120, 80, 60, 40])
def test_rich_rows_fit_the_terminal_and_keep_every_figure(width: int) -> None:
    """At 80 columns the rows were cut to ``0:00... eta -:--``: the description is cut (with an ellipsis)
    and the bar, then the run's clock, dropped before any figure is."""
    rows = _rendered_rows(width)
    assert all(len(row) <= width for row in rows), rows
    clock = r"\d+:\d\d:\d\d"
    run = rf" run {clock}" if width >= 60 else ""
    assert re.fullmatch(rf"prefill\.\S*[^…]*… +(━+ +)?345/345 {clock} eta {clock}{run}", rows[0]), rows
    assert re.fullmatch(rf"  parity\S* [^…]*…? +(━+ +)?5/5 {clock} eta {clock}{run}", rows[1]), rows
    assert ("━" in rows[0]) is (width >= 91)
