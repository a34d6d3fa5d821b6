"""``kiln check`` on an int8 or fp8 export judges it against its calibration run again on the checkpoint
(issue 40): the Q/DQ scales made again from the recorded options (``exporter/qdq_rerun.py``) over the
data passed with ``--calib-data`` (never the path the manifest records: ``exporter/check_calibration.py``),
every graph's checked bit for bit against them, and the graphs against PyTorch with them; where the
calibration cannot run again, one line says why and the export is judged the old way."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from click.testing import CliRunner, Result
from onnx import numpy_helper

from kiln.calibration import load_calibration_data
from kiln.cli import main
from kiln.exporter.artifacts.hashing import hash_tree
from kiln.exporter.artifacts.verify import require_verified
from kiln.exporter.check_calibration import Recorded, Skip, rerun_source
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.parity.qdq_numbers import NUMBERS_FILE
from kiln.exporter.pipeline import export
from kiln.exporter.precision.kinds import Fp8, Int8
from kiln.exporter.precision.kinds.base import kind_options, with_kind_options
from kiln.plugins import DEMO, load_model, resolve_checkpoint
from kiln_testing import tiny_config, write_checkpoint

_STAGE = "Q/DQ scales against the calibration, run again"
_ROW = "| portable vs Q/DQ scales |"
_REFUSED = "Q/DQ differ from the calibration's numbers (run again on the checkpoint): portable prefill.onnx: "
_FC2 = "/layers.0.mlp.fc2/MatMul"


def _export(root: Path, precision: Precision, calib_data: str) -> Path:
    ckpt = write_checkpoint(root / "ckpt", tiny_config())
    options = ExportOptions.from_flags(precision=precision, calib_data=calib_data, calib_samples=2, parity_tokens=4)
    export(ckpt, root / "out", options)
    return root / "out"


@pytest.fixture(scope="module")
def int8_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, ``--int8`` calibrated on a file of token ids (kept beside the export)."""
    root = tmp_path_factory.mktemp("check_int8")
    rng = np.random.default_rng(0)
    np.save(root / "calib.npy", (np.cumsum(rng.integers(1, 4, size=400)) % 101).astype(np.int64))
    return _export(root, Precision.INT8, str(root / "calib.npy"))


@pytest.fixture
def export_dir(int8_export: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "export"
    shutil.copytree(int8_export, copy)
    return copy


@pytest.fixture
def calib(int8_export: Path) -> Path:
    """The file the int8 export was calibrated on."""
    return int8_export.parent / "calib.npy"


def _rehash(directory: Path, change: Callable[[dict[str, Any]], None] = lambda data: None) -> None:
    """The manifest changed, then every hash made true again (as a careful tamperer would)."""
    path = directory / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    data["files"] = hash_tree(directory, exclude=("manifest.json",))
    path.write_text(json.dumps(data))


def _check(directory: Path, *args: str) -> Result:
    result = CliRunner().invoke(main, ["check", str(directory), *args])
    assert "Traceback" not in result.stderr, result.stderr
    return result


def _passes_against_the_rerun(directory: Path, *args: str) -> None:
    result = _check(directory, *args)
    assert result.exit_code == 0, result.output
    assert _STAGE in result.stderr and "cannot run again" not in result.stderr, result.stderr
    assert _ROW in result.stdout, result.stdout
    assert not any(p.name == NUMBERS_FILE for p in directory.rglob("*"))


def test_a_pristine_int8_export_passes_against_its_calibration_run_again(int8_export: Path, calib: Path) -> None:
    """The calibration runs again over the file passed (its stage is there), every graph holds its
    scales, the graphs are judged against the Q/DQ model, and nothing is left in the export."""
    _passes_against_the_rerun(int8_export, "--calib-data", str(calib))


def test_a_pristine_fp8_export_passes_against_its_calibration_run_again(tmp_path: Path) -> None:
    """Synthetic calibration data is no file: it runs again without --calib-data."""
    _passes_against_the_rerun(_export(tmp_path, Precision.FP8, "synthetic"))


def _scaled(graph: Path, name: str) -> None:
    """The initializer ``name`` of ``graph`` (held in the graph file) 10% larger."""
    model = onnx.load(graph, load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.name == name)
    assert not tensor.external_data, name
    tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * np.float32(1.1), name))
    onnx.save(model, graph)


def _input_scale(graph: Path) -> str:
    """The scale of the Q/DQ pair fc2's MatMul reads (its QuantizeLinear's and DequantizeLinear's)."""
    model = onnx.load(graph, load_external_data=False)
    matmul = next(n for n in model.graph.node if n.name == _FC2)
    return next(n.input[1] for n in model.graph.node if n.output[0] == matmul.input[0])


@pytest.mark.parametrize(
    ("what", "tensor"),
    [("input", _input_scale), ("weight", lambda graph: "val_transposed.model.layers.0.mlp.fc2.weight_scale")],
    ids=["activation", "weight"],
)
def test_a_scale_changed_with_the_hashes_recomputed_fails_check(
    export_dir: Path, calib: Path, what: str, tensor: Callable[[Path], str]
) -> None:
    """One scale of the prefill graph 10% off, hashes recomputed: kiln verify sees nothing, kiln
    check with the export's --calib-data names the graph, the MatMul and the scale against the
    calibration made again."""
    graph = export_dir / "onnx" / "prefill.onnx"
    _scaled(graph, tensor(graph))
    _rehash(export_dir)
    require_verified(export_dir)  # the hashes hold: only the numbers can tell
    result = _check(export_dir, "--calib-data", str(calib))
    line = result.stderr.strip().splitlines()[-1]
    assert result.exit_code == 1 and line.startswith("error: "), (result.exit_code, result.stderr)
    assert f"{_REFUSED}{_FC2}: {what} scale " in line and " where the calibration made " in line, line


def _judged_the_old_way(directory: Path, reason: str, *args: str) -> None:
    result = _check(directory, *args)
    assert result.exit_code == 0, result.output
    said = f"int8: the calibration cannot run again: {reason}; judged against the checkpoint's model only"
    assert said in result.stderr, result.stderr
    assert _ROW not in result.stdout and "| portable | int8 |" in result.stdout, result.stdout


def test_a_manifest_without_the_kinds_options_is_checked_the_old_way(export_dir: Path, calib: Path) -> None:
    """An export of an earlier kiln records no kind options: the reason is said, the check goes on."""
    _rehash(export_dir, lambda data: data["export"].pop("quantization"))
    _judged_the_old_way(
        export_dir,
        "the manifest records no options of its int8 kind (export.quantization.options), which exports of an "
        "earlier kiln do not",
        "--calib-data",
        str(calib),
    )


def test_a_manifest_without_the_calibration_settings_is_checked_the_old_way(export_dir: Path, calib: Path) -> None:
    _rehash(export_dir, lambda data: data["export"]["calibration"].pop("settings"))
    _judged_the_old_way(
        export_dir, "the manifest records no calibration settings (export.calibration)", "--calib-data", str(calib)
    )


def test_settings_this_kiln_calibrates_with_otherwise_are_said(export_dir: Path, calib: Path) -> None:
    """An export calibrated with settings this kiln does not use (another kiln's decode steps)."""
    _rehash(export_dir, lambda data: data["export"]["calibration"]["settings"].update(decode_steps=3))
    _judged_the_old_way(
        export_dir,
        "this kiln calibrates with other settings (decode_steps) than the export's",
        "--calib-data",
        str(calib),
    )


def _no_data_said(source: str, sha256: str) -> str:
    return (
        "kiln check reads no calibration data from a path the manifest records: pass --calib-data FILE, the "
        f"export's calibration data (recorded as {source}; its token windows' sha256 {sha256}), to run it again"
    )


def test_without_calib_data_the_recorded_path_is_not_read(int8_export: Path, calib: Path) -> None:
    """Without --calib-data the calibration does not run again, though the recorded file is there
    and would give the same windows: the line says which data to pass, and check judges as before."""
    recorded = json.loads((int8_export / "manifest.json").read_text())["export"]["calibration"]
    assert recorded["source"] == str(calib) and calib.is_file(), recorded
    _judged_the_old_way(int8_export, _no_data_said(str(calib), recorded["data_sha256"]))


def test_calib_data_of_other_windows_is_refused_naming_both_hashes(export_dir: Path, tmp_path: Path) -> None:
    """A --calib-data file that is not the export's data (its token windows hash otherwise) is an
    error naming both sha256, not a check passed without its proof."""
    other = tmp_path / "other.npy"
    np.save(other, np.arange(400, dtype=np.int64) % 101)
    recorded = json.loads((export_dir / "manifest.json").read_text())["export"]["calibration"]
    settings = recorded["settings"]
    found = load_calibration_data(
        str(other), tokenizer=None, vocab_size=101, samples=settings["samples"], window=settings["window"]
    ).sha256
    assert found != recorded["data_sha256"]
    result = _check(export_dir, "--calib-data", str(other))
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: calibration: --calib-data {other}: its token windows' sha256 is {found}, the export's calibration "
        f"data's {recorded['data_sha256']} (recorded as {recorded['source']}): not the data the export was "
        "calibrated on; pass that file"
    ), result.stderr
    missing = _check(export_dir, "--calib-data", str(tmp_path / "missing.npy"))
    assert missing.exit_code == 1, missing.output
    assert f"{tmp_path / 'missing.npy'}: calibration data file not found" in missing.stderr, missing.stderr


def test_matmuls_the_qdq_model_does_not_model_are_checked_the_old_way(tmp_path: Path) -> None:
    """--int8-all-matmuls quantizes the attention MatMuls (two activations): its calibration runs
    again with that option (recorded), makes no numbers, as at export, and the reason is said."""
    out = _export(tmp_path, Precision.of(Int8(all_matmuls=True)), "synthetic")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["export"]["quantization"]["options"] == {"float_rules": [], "all_matmuls": True}, manifest
    _judged_the_old_way(
        out, "its quantized MatMuls are not all an activation times a constant weight, which no Q/DQ model models"
    )


def test_a_kinds_options_come_back_as_recorded() -> None:
    """What the manifest records of a kind makes the same kind again; an option it lacks is no kind."""
    kind = Int8(float_rules=("*.q_proj",), all_matmuls=True)
    recorded = json.loads(json.dumps(kind_options(kind)))
    assert recorded == {"float_rules": ["*.q_proj"], "all_matmuls": True}, recorded
    assert with_kind_options(Int8(), recorded) == kind
    assert with_kind_options(Fp8(), {"float_rules": ["*.fc2"]}) == Fp8(float_rules=("*.fc2",))
    assert with_kind_options(Fp8(), {"all_matmuls": True}) is None


def test_the_demos_bundled_text_is_read_without_calib_data(tmp_path: Path) -> None:
    """An export of the bundled demo calibrated on its held-out text runs again over kiln's own copy
    (the installed package's, whatever path the manifest records) without --calib-data; other
    windows than that text gives are skipped with the line."""
    demo = load_model(DEMO)
    bundled = resolve_checkpoint(DEMO) / "heldout.txt"
    windows = load_calibration_data(
        str(bundled), tokenizer=demo.tokenizer, vocab_size=demo.spec.vocab_size, samples=2, window=128
    )
    recorded = Recorded(str(tmp_path / "gone" / "heldout.txt"), windows.sha256, 2, 128)
    assert rerun_source(recorded, None, demo) == str(bundled)
    other = dataclasses.replace(recorded, sha256="0" * 64)
    assert rerun_source(other, None, demo) == Skip(_no_data_said(recorded.source, "0" * 64))
