"""TensorRT's int4 rule (issue 39, item 9): TensorRT builds int4 weight-only blocks of 64 and 128 only.
An export with other blocks (``--int4-block 32``, or a smaller block for a K the asked one does not
divide) says its graphs are for ONNX Runtime only and records why; ``kiln build`` reads the graphs'
DequantizeLinear ``block_size`` and refuses them in one line before it writes engines/trtexec.sh."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.errors import EngineError
from kiln.exporter.engine import BuildOptions, build_command
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.exporter.precision.kinds import Int4
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln_testing import RecordedProgress, tiny_config, write_checkpoint

REASON = (
    "int4 DequantizeLinear block_size 32, outside TensorRT's int4 block sizes (64, 128): "
    "for ONNX Runtime only, not TensorRT"
)
NOTE = f"onnx/*.onnx: {REASON} (kiln build refuses them)"
REFUSAL = (
    f"engine: onnx/prefill.onnx: {REASON}; for engines, re-export with --int4-block 64 or 128"
    " (and --int4-float for a weight whose K 64 does not divide)"
)


def _export(root: Path, block: int) -> tuple[Path, RecordedProgress]:
    """An --int4 --int4-method rtn export of a tiny model whose every K (64, 128) 64 divides."""
    ckpt = root / "ckpt"
    if not ckpt.exists():
        write_checkpoint(ckpt, tiny_config(d_model=64, d_ff=128))
    progress = RecordedProgress()
    options = ExportOptions.from_flags(
        precision=Precision.of(Int4(method=Int4Method.RTN, block=block)), parity_tokens=16
    )
    export(ckpt, root / f"block{block}", options, progress)
    return root / f"block{block}", progress


Exports = dict[int, tuple[Path, RecordedProgress]]


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Exports:
    root = tmp_path_factory.mktemp("int4-trt")
    return {block: _export(root, block) for block in (32, 128)}


def _quantization(out: Path) -> dict[str, object]:
    quantization: dict[str, object] = json.loads((out / "manifest.json").read_text())["export"]["quantization"]
    return quantization


def test_block_32_is_noted_recorded_and_refused(exports: Exports, monkeypatch: pytest.MonkeyPatch) -> None:
    out, progress = exports[32]
    assert progress.notes == [NOTE]
    assert _quantization(out)["tensorrt"] == REASON
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # refused before TensorRT is looked for, installed or not
    before = (out / "manifest.json").read_text()
    with pytest.raises(EngineError) as info:
        build_command(out, BuildOptions())
    assert str(info.value) == REFUSAL
    assert not (out / "engines" / "trtexec.sh").exists()
    assert (out / "manifest.json").read_text() == before  # nothing recorded
    result = CliRunner().invoke(main, ["build", str(out)])
    assert result.exit_code == 1 and result.stderr == f"error: {REFUSAL}\n"
    assert not (out / "engines" / "trtexec.sh").exists()


def test_block_128_gets_trtexec_sh(exports: Exports, monkeypatch: pytest.MonkeyPatch) -> None:
    """K=64 falls back to 64, a block TensorRT builds: no note, and kiln build goes on (to the missing TensorRT)."""
    out, progress = exports[128]
    assert progress.notes == []
    assert _quantization(out)["tensorrt"] is None
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(EngineError, match="TensorRT is not installed"):
        build_command(out, BuildOptions())
    assert "--onnx=onnx/prefill.onnx" in (out / "engines" / "trtexec.sh").read_text()


def test_a_fallback_below_64_is_noted_and_refused(
    tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny model's K=32 weights (q/k/v, gate, fc1) fall back from the default 128 to 32, its fc2
    (K=64) to 64: the CLI export says, in one line, the graphs are ONNX Runtime's; kiln build refuses them."""
    out = tmp_path / "out"
    args = ["export", "--model", str(tiny_ckpt), "--out", str(out), "--int4", "--int4-method", "rtn"]
    args += ["--parity-tokens", "16"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines().count(NOTE) == 1
    assert _quantization(out)["tensorrt"] == REASON
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    result = CliRunner().invoke(main, ["build", str(out)])
    assert result.exit_code == 1 and result.stderr == f"error: {REFUSAL}\n"
    assert not (out / "engines" / "trtexec.sh").exists()
