"""The parity report of an export with two graph sets (portable fp32, ``--target ort`` int8):
every set shown with its own precision's tolerances (the rule atol + rtol x max|row| and its
figures) in parity.md's tables, the plot's lines and its verdict; overlapping lines kept apart;
extras as tables; parity.json only extended."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.exporter.parity import GenerationCheck, ParityResult, TensorCheck
from kiln.exporter.parity.plot import figure, limit_labels, plot_lines, run_rules, write_plot
from kiln.exporter.parity.quality import QualityResult
from kiln.exporter.parity.report import markdown, summary_table, verdict, write_parity_reports
from kiln.exporter.precision import TOLERANCES

Run = tuple[str, int, tuple[float, ...]]


def _result(
    precision: str, logits: float, steps: list[Run], match: float = 1.0, padded: tuple[int, int] | None = None
) -> ParityResult:
    """Checks at a scale of 10 (every row's max |reference|); a logits error of ``logits``."""
    tol = TOLERANCES[precision]
    result = ParityResult("onnxruntime", precision, tol)
    ok = logits <= tol.logits.limit(10.0)
    result.tensors = [
        TensorCheck(
            "decode", "logits", logits * 1.5, 0.01, 0.9999999, 1.0, tol.logits_atol, tol.logits_rtol, logits, 10.0, ok
        ),
        TensorCheck(
            "decode",
            "present.0.key",
            logits / 10,
            0.01,
            0.9999999,
            None,
            tol.kv_atol,
            tol.kv_rtol,
            logits / 10,
            10.0,
            True,
        ),
    ]
    lengths = (padded[0],) if padded else None
    result.generation = [
        GenerationCheck(
            path,
            batch,
            lengths or (5,) * batch,
            padded[1] if padded else 5,
            len(errors),
            match,
            None,
            0,
            errors,
            (10.0,) * len(errors),
            (match,) * len(errors),
            True,
        )
        for path, batch, errors in steps
    ]
    return result


def _two_sets() -> ParityResult:
    portable = _result(
        "fp32",
        2e-5,
        [("prefill+decode", 1, (1e-5, 3e-5)), ("model", 1, (1e-5, 3e-5)), ("prefill+decode", 3, (2e-5, 0.0))],
    )
    ort = _result(
        "int8",
        0.2,
        [("prefill+decode", 1, (0.1, 0.3)), ("model", 1, (0.10002, 0.30001)), ("model", 3, (0.5, 0.4))],
        match=0.95,
    )
    return portable.merge("ort", ort)


EXTRAS = {
    "ple_folding": [{"name": "layers.0.ple", "positions": 256, "max_abs_error": 9.5367431640625e-07}],
    "kept_fp32": {"decode": {"nodes": ["a"], "tables": []}},
}


def test_every_set_has_its_own_tolerances_in_the_tables() -> None:
    text = markdown(_two_sets(), EXTRAS)
    assert text.startswith("# Parity: onnxruntime vs PyTorch (portable fp32, ort int8): PASSED\n")
    assert "by |a - b| <= atol + rtol * max|b| of each row; and by cosine." in text
    assert summary_table(_two_sets())[2:] == [
        "| portable | fp32 | 2e-05 | 1e-05 + 0.0001 x 10 = 0.00101 | 2e-06 | 1e-05 + 0.0001 x 10 = 0.00101 | "
        "0.999999 | 100.00% | 100% | yes |",
        "| ort | int8 | 0.2 | 1.5 + 0.05 x 10 = 2 | 0.02 | 1 + 0.05 x 10 = 1.5 | 0.99 | 95.00% | 90% | yes |",
    ]
    assert (
        "| decode | 2 | logits | 3e-05 | 2e-05 | 1e-05 + 0.0001 x 10 = 0.00101 | 0.01 | 0.99999990 | 0.999999 | "
        "1.0000 | yes |" in text
    )
    assert (
        "| decode.ort | 2 | logits | 0.3 | 0.2 | 1.5 + 0.05 x 10 = 2 | 0.01 | 0.99999990 | 0.99 | 1.0000 | yes |"
        in text
    )
    assert "| model | 1 | 5 | 2 | 1.0000 | 1 | - | 0 | 3e-05 | 10 | yes |" in text
    assert "| ort:model | 3 | 5, 5, 5 | 2 | 0.9500 | 0.9 | - | 0 | 0.5 | 10 | yes |" in text


def test_a_failed_row_says_by_how_much() -> None:
    failed = _result("fp32", 0.002, [("model", 1, (1e-5,))])
    assert summary_table(failed)[2].startswith(
        "| portable | fp32 | 0.002 | 1e-05 + 0.0001 x 10 = 0.00101 | "
    ) and summary_table(failed)[2].endswith(" | NO |")
    assert failed.failures() == [
        "decode:logits max abs 0.002 (tolerance 1e-05 + 0.0001 x max|row| = 0.00101 at max|row| 10), cosine "
        "1.000000 (at least 0.999999)"
    ]


def test_a_set_passed_below_its_token_floor_says_the_ties() -> None:
    """A row read "98.96% | 100% | yes" with nothing saying why (issue 39's newcomer): its near-ties."""
    result = _result("fp32", 2e-5, [("prefill+decode", 2, (1e-5, 2e-5))], match=0.75)
    result.generation = [dataclasses.replace(g, ties=1) for g in result.generation]
    assert summary_table(result)[2].endswith(" | 75.00% | 100% (1 near-tie excepted) | yes |")
    assert summary_table(_two_sets())[3].endswith(" | 95.00% | 90% | yes |")  # above its floor: nothing to explain


def test_a_padded_batch_of_one_says_so() -> None:
    result = _result("fp32", 2e-5, [("prefill+decode", 1, (1e-5,))], padded=(8, 12))
    (run,) = result.generation
    assert run.label == "prefill+decode, batch 1, 8 (padded to 12)"
    assert "| prefill+decode | 1 | 8 (padded to 12) | 1 | 1.0000 | 1 | - | 0 | 1e-05 | 10 | yes |" in markdown(result)
    assert [line.label for line in plot_lines(result)] == ["prefill+decode, batch 1, 8 (padded to 12)"]


def test_extras_and_targets_are_tables_not_json() -> None:
    text = markdown(_two_sets(), EXTRAS)
    section = text.split("## ple_folding\n\n", 1)[1].split("\n\n", 1)[0]
    assert section.splitlines() == [
        "| name | positions | max_abs_error |",
        "|---|---|---|",
        "| layers.0.ple | 256 | 9.54e-07 |",
    ]
    assert "## targets" not in text and '"precision"' not in text  # the graph sets table says it
    assert text.count("```") == 2  # only kept_fp32 (nested lists per graph) stays JSON


def test_plot_lines_keep_near_ones_apart() -> None:
    lines = plot_lines(_two_sets())
    assert [(line.label, line.graph_set, line.model) for line in lines] == [
        ("prefill+decode, batch 1 = model, batch 1 (identical: one line)", "portable", False),
        ("prefill+decode, batch 3", "portable", False),
        ("ort:prefill+decode, batch 1", "ort", False),
        ("ort:model, batch 1", "ort", True),  # within 0.1% of the line above: its own line, its own marker and dashes
        ("ort:model, batch 3", "ort", True),
    ]
    assert lines[0].error == pytest.approx((1e-5, 3e-5)) and lines[1].error == pytest.approx(
        (2e-5, 1e-12)
    )  # a zero at 1e-12
    assert lines[0].limit == pytest.approx((1e-5 + 1e-4 * 10,) * 2) and lines[2].limit == pytest.approx(
        (1.5 + 0.05 * 10,) * 2
    )  # atol + rtol x the step's max |logit|
    assert lines[2].match == (0.95, 0.95) and lines[2].run_match == pytest.approx((0.95, 0.95))
    assert limit_labels(_two_sets()) == {
        "portable": "limit 1e-05 + 0.0001 x step's max|logit| (portable fp32)",
        "ort": "limit 1.5 + 0.05 x step's max|logit| (ort int8)",
    }
    same = _result("int8", 0.2, [("model", 1, (0.1,))]).merge("ort", _result("int8", 0.2, [("model", 1, (0.2,))]))
    assert run_rules(same) == [
        ("whole run: token match at least 90%, ties excepted (portable int8, ort int8)", 0.9)
    ]  # one per distinct floor


def test_the_plot_has_two_panels_and_its_legend_clear_of_them() -> None:
    fig = figure(_two_sets())
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    error, tokens = fig.axes  # no quality measured: no third panel
    assert error.get_yscale() == "log" and tokens.get_ylabel() == "run's token match so far (%)"
    runs, limits = error.get_lines()[0::2], error.get_lines()[1::2]  # each run, then its limit
    assert [line.get_marker() for line in runs] == ["o", "o", "x", "x", "x"]
    assert [line.get_linestyle() for line in runs] == ["-", "-", "-", "--", "--"]
    assert [line.get_linestyle() for line in limits] == [":"] * 5 and [line.get_color() for line in limits] == [
        line.get_color() for line in runs
    ]
    assert list(limits[0].get_ydata()) == pytest.approx([1e-5 + 1e-4 * 10] * 2) and list(
        limits[2].get_ydata()
    ) == pytest.approx([1.5 + 0.05 * 10] * 2)
    (floor,) = [
        line for line in tokens.get_lines() if line.get_label().startswith("whole run: token match at least 90%")
    ]
    assert list(floor.get_xdata()) == [0.9, 1.0] and list(floor.get_ydata()) == [
        90,
        90,
    ]  # at the run's end, not across the steps
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    for ax in (error, tokens):  # the axes with their labels and ticks
        assert not box.overlaps(ax.get_tightbbox(renderer))
    texts = [t.get_text() for t in legend.get_texts()]
    assert "ort:model, batch 1" in texts and "whole run: token match at least 90%, ties excepted (ort int8)" in texts
    assert "limit 1.5 + 0.05 x step's max|logit| (ort int8)" in texts


def _pyplot_png(result: ParityResult, path: Path) -> None:
    """The plot as ``figure`` drew it through ``pyplot.subplots`` before it took a bare Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kiln.exporter.parity import plot

    lines = plot.plot_lines(result)
    quality = result.quality is not None and result.quality.note is None
    ratios = (3, 2, 1.4) if quality else (3, 2)
    size = (8, 6.5 + 1.2 * quality + 0.18 * len(lines))
    fig, axes = plt.subplots(len(ratios), 1, figsize=size, dpi=100, layout="constrained", height_ratios=ratios)
    axes[1].sharex(axes[0])
    plot._proof(result, lines, axes[0], axes[1], plt.rcParams["axes.prop_cycle"].by_key()["color"])
    if quality:
        plot._quality(result, axes[2])
    handles = [h for ax in axes[:2] for h in ax.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=7)
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


@pytest.mark.parametrize("quality", [False, True])
def test_the_plot_is_pyplots_png(tmp_path: Path, quality: bool) -> None:
    """The bare Figure on the Agg canvas (no pyplot state) writes pyplot's PNG, byte for byte."""
    result = _two_sets()
    if quality:
        result.quality = QualityResult("heldout", True, 2048, 0.891, 0.028, 9.6, 9.8, 0.85)
    write_plot(result, tmp_path / "kiln.png")
    _pyplot_png(result, tmp_path / "pyplot.png")
    assert (tmp_path / "kiln.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "kiln.png").read_bytes() == (tmp_path / "pyplot.png").read_bytes()


def test_the_plot_imports_no_pyplot(tmp_path: Path) -> None:
    """An export's plot leaves pyplot unimported: no global figure list or backend choice (the Agg canvas
    is the figure's own)."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from kiln.exporter.parity import ParityResult\n"
        "from kiln.exporter.parity.plot import write_plot\n"
        "from kiln.exporter.precision import TOLERANCES\n"
        f"write_plot(ParityResult('onnxruntime', 'fp32', TOLERANCES['fp32']), Path({str(tmp_path / 'p.png')!r}))\n"
        "print(sorted(m for m in sys.modules if m.startswith('matplotlib.pyplot') or m.endswith('.backend_agg')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['matplotlib.backends.backend_agg']"
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_verdict_names_each_set_against_its_tolerance() -> None:
    assert verdict(_two_sets()) == (
        "parity passed: portable (fp32): logits error 2e-05 (limit 0.00101), KV error 2e-06 (limit 0.00101), "
        "tokens 100% equal over 6 steps; "
        "ort (int8): logits error 0.2 (limit 2), KV error 0.02 (limit 1.5), tokens 95% equal over 6 steps"
    )
    single = _result("fp32", 2e-3, [("model", 1, (1e-5,))])
    assert (
        verdict(single)
        == "parity FAILED: logits error 0.002 (limit 0.00101), KV error 0.0002 (limit 0.00101), tokens 100% equal "
        "over 1 steps"
    )


def test_json_is_extended_only(tmp_path: Path) -> None:
    paths = write_parity_reports(_two_sets(), tmp_path, EXTRAS)
    data = json.loads(paths[0].read_text())
    assert list(data) == [
        "backend",
        "precision",
        "passed",
        "rule",
        "tolerance",
        "tensors",
        "generation",
        "targets",
        "ple_folding",
        "kept_fp32",
    ]
    assert data["rule"] == "|a - b| <= atol + rtol * max|b| of each row"
    assert [t["target"] for t in data["tensors"]] == [None, None, "ort", "ort"]
    assert data["targets"]["ort"]["tolerance"]["logits_atol"] == 1.5 and data["tensors"][2]["graph"] == "decode.ort"
    assert data["tolerance"] == {
        "logits_atol": 1e-5,
        "logits_rtol": 1e-4,
        "kv_atol": 1e-5,
        "kv_rtol": 1e-4,
        "min_cosine": 0.999999,
        "min_token_match": 1.0,
    }
    assert {k: data["tensors"][0][k] for k in ("max_abs", "atol", "rtol", "error", "scale")} == pytest.approx(
        {"max_abs": 3e-5, "atol": 1e-5, "rtol": 1e-4, "error": 2e-5, "scale": 10.0}
    )
    assert data["generation"][2]["padded_to"] == 5 and data["generation"][2]["per_step_match"] == [1.0, 1.0]
    assert paths[2].read_bytes()[:4] == b"\x89PNG"
    assert paths[1].read_text() == markdown(_two_sets(), EXTRAS)
