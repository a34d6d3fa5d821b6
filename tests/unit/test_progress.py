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
    assert [line.split(":")[0] for line in lines] == ["  GPTQ"] * 4 + ["outer"]  # nested stages indented; the 4th is the stage's end
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
