"""Quantization quality (issue 40 item 3): the quantized graphs against the checkpoint's model,
teacher-forced on real text (the demo's held-out text), reported in parity.json/md, the manifest,
``kiln check`` and the export's last line; gating only on real text (a gate set impossibly high
refuses, naming the quantization and keeping the reports; random tokens record, never judge); a
bad ``--eval-data`` refused in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.exporter.artifacts.manifest import read
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.parity.quality import UNQUANTIZED
from kiln.exporter.pipeline import export
from kiln.exporter.precision.kinds import Int4
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln.exporter.quality_gate import QualityError
from kiln.plugins import resolve_checkpoint
from kiln_testing import tiny_config, write_checkpoint

RTN = Precision.of(Int4(method=Int4Method.RTN))


@pytest.fixture(scope="module")
def demo_int4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("quality") / "int4"
    result = CliRunner().invoke(
        main, ["export", "--model", "demo", "--out", str(out), "--int4", "--int4-method", "rtn"]
    )
    assert result.exit_code == 0, result.output
    assert (
        "quality (gating: top-1 agreement at least 0.85): top-1 agreement 0." in result.output
    )  # the export's last line
    return out


def test_quality_on_real_text_is_reported(demo_int4: Path) -> None:
    data = json.loads((demo_int4 / "reports" / "parity.json").read_text())["quality"]
    assert data["source"] == "demo/checkpoint/heldout.txt (its last tokens)" and data["real"] and data["tokens"] == 2048
    assert 0.85 <= data["agreement"] < 1 and data["kl"] > 0 and data["threshold"] == 0.85 and data["passed"]
    assert (
        data["perplexity_checkpoint"] > 1 and data["perplexity_graphs"] > data["perplexity_checkpoint"]
    )  # int4 costs the text something
    quality = read(demo_int4).parity.quality
    assert (
        quality is not None
        and quality.agreement == data["agreement"]
        and quality.judged == "gating: top-1 agreement at least 0.85"
    )
    text = (demo_int4 / "reports" / "parity.md").read_text()
    assert "# Quality: what the quantization costs" in text and "# Proof: each graph computes its model" in text
    assert f"| demo/checkpoint/heldout.txt (its last tokens) | yes | 2048 | {data['agreement']:.4f} | 0.85 |" in text


def test_kiln_check_measures_quality_again(demo_int4: Path) -> None:
    result = CliRunner().invoke(main, ["check", str(demo_int4)])
    assert result.exit_code == 0, result.output
    recorded = read(demo_int4).parity.quality
    assert recorded is not None
    assert f"quality (gating: top-1 agreement at least 0.85): top-1 agreement {recorded.agreement:.3f}" in result.output


def test_an_impossible_gate_refuses_the_quantization_and_keeps_the_reports(tmp_path: Path) -> None:
    out = tmp_path / "int4"
    with pytest.raises(QualityError) as refused:
        export(resolve_checkpoint("demo"), out, ExportOptions.from_flags(precision=RTN, quality_gate="0.999"))
    message = str(refused.value)
    assert message.startswith(
        f"quality: {out}: the int4 quantization fell short (its graphs compute the quantized model: parity "
        "passed): top-1 agreement 0."
    )
    assert (
        "is below 0.999. Ways out: --int4-method gptq (with --calib-data)" in message
        and "--int4-block, --fp16; or --quality-gate lower or off" in message
    )
    kept = Path(message.rsplit("Reports kept in ", 1)[1])
    assert kept.parent.name.startswith("int4.refused-") and kept.parent.parent == tmp_path
    assert (
        json.loads((kept / "parity.json").read_text())["quality"]["passed"] is False and (kept / "parity.png").is_file()
    )
    assert not out.exists()


def test_random_tokens_record_quality_and_never_judge(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    result = export(
        ckpt,
        tmp_path / "out",
        ExportOptions.from_flags(precision=RTN, parity_tokens=2, parity_agreement="record", quality_gate="1"),
    )
    quality = result.parity.quality
    assert quality is not None and not quality.real and quality.threshold is None and quality.passed
    assert quality.source == "random tokens (no real text)" and quality.judged == "recorded: no real text"
    assert 0 <= quality.agreement <= 1 and quality.kl >= 0 and quality.perplexity_graphs > 0
    manifest = read(tmp_path / "out").parity.quality
    assert manifest is not None and manifest.threshold is None and not manifest.real


def _refusal(tmp_path: Path, data: Path) -> str:
    result = CliRunner().invoke(
        main,
        [
            "export",
            "--model",
            "demo",
            "--out",
            str(tmp_path / "out"),
            "--int4",
            "--int4-method",
            "rtn",
            "--eval-data",
            str(data),
            "--json",
        ],
    )
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "out").exists()
    return result.stderr.strip()


def test_bad_eval_data_is_refused_in_one_line(tmp_path: Path) -> None:
    assert (
        _refusal(tmp_path, tmp_path / "nope.txt")
        == f"error: config: --eval-data {tmp_path / 'nope.txt'}: file not found"
    )
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 4)
    assert "blob.bin: not UTF-8 text (a binary file?)" in _refusal(tmp_path, tmp_path / "blob.bin")
    (tmp_path / "nul.txt").write_bytes(b"abc\x00def")
    assert "nul.txt: holds NUL bytes, not text" in _refusal(tmp_path, tmp_path / "nul.txt")
    (tmp_path / "empty.txt").write_text(" \n")
    assert "empty.txt: holds no text" in _refusal(tmp_path, tmp_path / "empty.txt")
    os.mkfifo(tmp_path / "fifo.txt")
    assert "fifo.txt: a FIFO, not a regular file" in _refusal(tmp_path, tmp_path / "fifo.txt")


def test_fp32_graphs_are_measured_only_when_eval_data_names_a_text(tmp_path: Path) -> None:
    """fp32 graphs are the checkpoint's model (parity proves them): the export's last line says why
    quality is not measured, and the manifest has none, unless --eval-data asks for it."""
    plain = CliRunner().invoke(
        main, ["export", "--model", "demo", "--out", str(tmp_path / "a"), "--parity-tokens", "2"]
    )
    assert plain.exit_code == 0, plain.output
    assert f"quality {UNQUANTIZED};" in plain.output, plain.output
    assert read(tmp_path / "a").parity.quality is None  # the manifest records quality where it was measured
    text = resolve_checkpoint("demo") / "heldout.txt"
    asked = export("demo", tmp_path / "b", ExportOptions.from_flags(parity_tokens=2, eval_data=text))
    quality = asked.parity.quality
    assert quality is not None and quality.note is None and quality.tokens > 0 and quality.real, quality
    assert quality.agreement > 0.99 and quality.kl < 1e-4 and quality.threshold is None, quality
