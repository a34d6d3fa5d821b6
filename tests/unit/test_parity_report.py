"""The parity report of an export with two graph sets (portable fp32, ``--target ort`` int8):
every set shown with its own precision's tolerances in parity.md's tables, the plot's lines and
its verdict; overlapping lines said so; extras as tables; parity.json only extended."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.exporter.parity import TOLERANCES, GenerationCheck, ParityResult, TensorCheck
from kiln.exporter.parity.report import markdown, plot_lines, summary_table, tolerance_lines, verdict, write_parity_reports


def _result(precision: str, logits: float, steps: list[tuple[str, int, tuple[float, ...]]], match: float = 1.0) -> ParityResult:
    tol = TOLERANCES[precision]
    result = ParityResult("onnxruntime", precision, tol)
    result.tensors = [
        TensorCheck("decode", "logits", logits, 0.01, 0.9999999, 1.0, tol.logits_atol, logits <= tol.logits_atol),
        TensorCheck("decode", "present.0.key", logits / 10, 0.01, 0.9999999, None, tol.kv_atol, True),
    ]
    result.generation = [GenerationCheck(path, batch, (5,) * batch, len(errors), match, None, 0, errors, True) for path, batch, errors in steps]
    return result


def _two_sets() -> ParityResult:
    portable = _result("fp32", 2e-5, [("prefill+decode", 1, (1e-5, 3e-5)), ("model", 1, (1e-5, 3e-5)), ("prefill+decode", 3, (2e-5, 0.0))])
    ort = _result("int8", 0.2, [("prefill+decode", 1, (0.1, 0.3)), ("model", 1, (0.10002, 0.30001)), ("model", 3, (0.5, 0.4))], match=0.95)
    return portable.merge("ort", ort)


EXTRAS = {"ple_folding": [{"name": "layers.0.ple", "positions": 256, "max_abs_error": 9.5367431640625e-07}], "kept_fp32": {"decode": {"nodes": ["a"], "tables": []}}}


def test_every_set_has_its_own_tolerances_in_the_tables() -> None:
    text = markdown(_two_sets(), EXTRAS)
    assert text.startswith("# Parity: onnxruntime vs PyTorch (portable fp32, ort int8): PASSED\n")
    assert summary_table(_two_sets())[2:] == [
        "| portable | fp32 | 3e-05 | 0.0001 | 0.0001 | 0.999999 | 100.00% | 100% | yes |",
        "| ort | int8 | 0.5 | 1.5 | 1 | 0.99 | 95.00% | 90% | yes |",
    ]
    assert "| decode | logits | 2e-05 | 0.0001 | 0.01 | 0.99999990 | 0.999999 | 1.0000 | yes |" in text
    assert "| decode.ort | logits | 0.2 | 1.5 | 0.01 | 0.99999990 | 0.99 | 1.0000 | yes |" in text
    assert "| model | 1 | 5 | 2 | 1.0000 | 1 | - | 0 | 3e-05 | 0.0001 | yes |" in text
    assert "| ort:model | 3 | 5, 5, 5 | 2 | 0.9500 | 0.9 | - | 0 | 0.5 | 1.5 | yes |" in text


def test_extras_and_targets_are_tables_not_json() -> None:
    text = markdown(_two_sets(), EXTRAS)
    section = text.split("## ple_folding\n\n", 1)[1].split("\n\n", 1)[0]
    assert section.splitlines() == ["| name | positions | max_abs_error |", "|---|---|---|", "| layers.0.ple | 256 | 9.54e-07 |"]
    assert "## targets" not in text and "\"precision\"" not in text  # the graph sets table says it
    assert text.count("```") == 2  # only kept_fp32 (nested lists per graph) stays JSON


def test_plot_lines_say_when_they_overlap() -> None:
    assert plot_lines(_two_sets()) == [
        ("prefill+decode, batch 1 = model, batch 1 (identical: one line)", (1e-5, 3e-5)),
        ("prefill+decode, batch 3", (2e-5, 1e-12)),  # a zero error, on the log axis
        ("ort:prefill+decode, batch 1 ≈ ort:model, batch 1 (within 0.1%: one line)", (0.1, 0.3)),
        ("ort:model, batch 3", (0.5, 0.4)),
    ]
    assert tolerance_lines(_two_sets()) == [("tolerance 0.0001 (portable fp32)", 1e-4), ("tolerance 1.5 (ort int8)", 1.5)]
    same = _result("int8", 0.2, [("model", 1, (0.1,))]).merge("ort", _result("int8", 0.2, [("model", 1, (0.2,))]))
    assert tolerance_lines(same) == [("tolerance 1.5 (portable int8, ort int8)", 1.5)]  # one dashed line per distinct tolerance


def test_verdict_names_each_set_against_its_tolerance() -> None:
    assert verdict(_two_sets()) == (
        "parity passed: portable (fp32): logits max abs error 3e-05 (tolerance 0.0001), tokens 100% equal over 6 steps in 3 runs; "
        "ort (int8): logits max abs error 0.5 (tolerance 1.5), tokens 95% equal over 6 steps in 3 runs"
    )
    single = _result("fp32", 2e-4, [("model", 1, (1e-5,))])
    assert verdict(single) == "parity FAILED: logits max abs error 0.0002 (tolerance 0.0001), tokens 100% equal over 1 steps in 1 runs"
    assert single.failures() == ["decode:logits max abs 0.0002 (tolerance 0.0001), cosine 1.000000 (at least 0.999999)"]


def test_json_is_extended_only(tmp_path: Path) -> None:
    paths = write_parity_reports(_two_sets(), tmp_path, EXTRAS)
    data = json.loads(paths[0].read_text())
    assert list(data) == ["backend", "precision", "passed", "tolerance", "tensors", "generation", "targets", "ple_folding", "kept_fp32"]
    assert [t["target"] for t in data["tensors"]] == [None, None, "ort", "ort"]
    assert data["targets"]["ort"]["tolerance"]["logits_atol"] == 1.5 and data["tensors"][2]["graph"] == "decode.ort"
    assert paths[2].read_bytes()[:4] == b"\x89PNG"
    assert paths[1].read_text() == markdown(_two_sets(), EXTRAS)
