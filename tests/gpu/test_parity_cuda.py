"""GPU tier: a tiny export whose parity runs on CUDA (``--parity-device cuda``: PyTorch's
reference on the GPU, the graphs on ONNX Runtime's CUDA provider), then ``kiln check`` of it on
CUDA. Skipped with the reason where torch sees no GPU or onnxruntime offers no CUDA provider."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.exporter.runners.device import missing
from kiln_testing import tiny_config, write_checkpoint

LACKING = missing()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(LACKING), reason="; ".join(LACKING) or "")]


@pytest.mark.parametrize("precision", [[], ["--fp16"]], ids=["fp32", "fp16"])
def test_export_and_check_on_cuda(tmp_path: Path, precision: list[str]) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    out = tmp_path / "out"
    args = ["export", "--model", str(ckpt), "--out", str(out), "--parity-device", "cuda", "--parity-tokens", "8"]
    result = CliRunner().invoke(main, [*args, *precision, "--max-batch", "2", "--json"])
    assert result.exit_code == 0, result.stderr
    assert "parity on cuda" in result.stderr, f"the device is named in the progress: {result.stderr}"
    assert json.loads(result.stdout)["parity"]["passed"] is True, result.stdout
    checked = CliRunner().invoke(main, ["check", str(out), "--parity-device", "cuda", "--json"])
    assert checked.exit_code == 0, checked.stderr
    assert json.loads(checked.stdout)["passed"] is True, checked.stdout
