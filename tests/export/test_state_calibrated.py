"""--int8 and --fp8 on recurrent-state and conv-window caches: calibration carries each layer's own
cache tensors (``carried_cache``), so the teacher-forced decode feeds reach the state path.

Per tiny family (plugins/hf/tiny_lfm2.py, tiny_recurrent.py, tiny_qwen3_5.py, tiny_mamba.py): LFM2's
conv windows take both and pass parity with the Q/DQ-scales proof; Mamba2, Bamba and Qwen3.5 (Gated
DeltaNet) take --fp8, which quantizes constant weights only, and pass theirs; --int8 would also quantize
the mixers' state MatMuls (two activations, unproved), so it is refused by name on any cache with an
SSM state (Jamba's Mamba1 too). ``--target ort --ort-int8`` (weight-only, no calibration) passes on
Mamba2's state.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the tiny checkpoints are transformers models")

from click.testing import CliRunner

from kiln.cli import main
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.plugins.hf.build import tiny_transformers


def _export(root: Path, case: str, precision: Precision) -> Path:
    """``case``'s tiny checkpoint exported at ``precision``, calibrated on structured token ids; its parity passed."""
    tiny_transformers(case, seed=1).save_pretrained(root / "ckpt", safe_serialization=True)
    rng = np.random.default_rng(0)
    np.save(root / "calib.npy", (np.cumsum(rng.integers(1, 4, size=2000)) % 100).astype(np.int64))
    options = ExportOptions.from_flags(
        precision=precision,
        calib_data=str(root / "calib.npy"),
        calib_samples=8,
        calib_cache=root / "cache",
        max_batch=2,
    )
    result = export(root / "ckpt", root / "out", options)
    assert result.parity.passed, (case, precision, result.parity.failures())
    return root / "out"


def _proved_on_scales(out: Path) -> None:
    report = (out / "reports" / "parity.md").read_text()
    assert "Q/DQ scales" in report, f"{out}: the graphs were not compared with PyTorch on the calibrated scales"


@pytest.fixture(scope="module")
def lfm2_int8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export(tmp_path_factory.mktemp("lfm2_int8"), "lfm2", Precision.INT8)


def test_lfm2_int8_passes_its_parity_on_the_calibrated_scales(lfm2_int8: Path) -> None:
    _proved_on_scales(lfm2_int8)


@pytest.mark.parametrize(
    "case",
    [
        "lfm2",
        "mamba2",
        pytest.param("bamba", marks=pytest.mark.slow),
        pytest.param("qwen3_5", marks=pytest.mark.slow),
        pytest.param("jamba", marks=pytest.mark.slow),
    ],
)
def test_fp8_passes_its_parity_on_the_calibrated_scales(case: str, tmp_path: Path) -> None:
    _proved_on_scales(_export(tmp_path, case, Precision.FP8))


@pytest.mark.parametrize(
    "case, kind", [("mamba2", "state"), ("bamba", "hybrid"), ("qwen3_5", "hybrid"), ("jamba", "hybrid")]
)
def test_int8_is_refused_by_name_on_a_recurrent_state(case: str, kind: str, tmp_path: Path) -> None:
    tiny_transformers(case, seed=1).save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    args = ["export", "--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--int8"]
    result = CliRunner().invoke(main, [*args, "--calib-data", "synthetic"])
    want = f"--int8 is not proved on recurrent-state ({kind}) caches"
    assert result.exit_code in (1, 2) and want in result.output, (case, result.exit_code, result.output)
    assert "Traceback" not in result.output and not (tmp_path / "out").exists(), (case, result.output)


@pytest.mark.slow
def test_the_ort_targets_weight_only_int8_passes_its_parity_on_a_recurrent_state(tmp_path: Path) -> None:
    tiny_transformers("mamba2", seed=1).save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    args = ["export", "--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--max-batch", "2"]
    result = CliRunner().invoke(main, [*args, "--target", "ort", "--ort-int8"])
    assert result.exit_code == 0 and "parity passed" in result.output, (result.exit_code, result.output[-2000:])
    assert (tmp_path / "out" / "onnx" / "decode.ort.onnx").is_file(), sorted((tmp_path / "out" / "onnx").iterdir())
