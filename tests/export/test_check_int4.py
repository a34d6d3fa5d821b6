"""``kiln check`` on an int4 export judges it against the quantizer run again on the checkpoint
(issue 40): a quantized weight changed in a graph, the manifest's hashes recomputed as a tamperer
would, is refused by name (``exporter/int4/rerun.py``, ``exporter/int4/proof.py``); GPTQ runs again
over the data passed with ``--calib-data`` only (``exporter/check_calibration.py``)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from kiln.cli import main
from kiln.exporter.artifacts.hashing import hash_tree
from kiln.exporter.artifacts.verify import require_verified
from kiln.exporter.int4.proof import NUMBERS_FILE
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.exporter.precision.kinds import Int4
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln_testing import tiny_config, write_checkpoint

_REFUSED = "int4 weights differ from the quantizer's numbers (run again on the checkpoint): "
_BLOCK = "layers.0.attn.o_proj's int4 weight differs from the quantizer's numbers at block 1 (rows 16-31), column 3: "


@pytest.fixture(scope="module")
def rtn_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, ``--int4 --int4-method rtn --int4-block 16 --target ort`` (two blocks along K)."""
    root = tmp_path_factory.mktemp("check_int4")
    ckpt = write_checkpoint(root / "ckpt", tiny_config())
    rtn = Int4(method=Int4Method.RTN, block=16)
    export(ckpt, root / "out", ExportOptions.from_flags(precision=Precision.of(rtn), target="ort", parity_tokens=4))
    return root / "out"


@pytest.fixture
def export_dir(rtn_export: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "export"
    shutil.copytree(rtn_export, copy)
    return copy


def _rehash(directory: Path, change: Callable[[dict[str, Any]], None] = lambda data: None) -> None:
    """The manifest changed, then every hash made true again (as a careful tamperer would)."""
    path = directory / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    data["files"] = hash_tree(directory, exclude=("manifest.json",))
    path.write_text(json.dumps(data))


def _scale_off(graph: Path, name: str, at: tuple[int, ...]) -> None:
    """One scale of the initializer ``name`` 10% off, in the graph itself or in its weights file."""
    model = onnx.load(graph, load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.name == name)
    external = {e.key: e.value for e in tensor.external_data}
    if not external:
        values = numpy_helper.to_array(tensor).copy()
        values[at] *= np.float32(1.1)
        tensor.CopyFrom(numpy_helper.from_array(values, name))
        onnx.save(model, graph)
        return
    assert tensor.data_type == onnx.TensorProto.FLOAT, tensor.data_type
    weights = graph.parent / external["location"]
    data = np.fromfile(weights, dtype=np.uint8)
    offset, count = int(external.get("offset", 0)), int(np.prod(tensor.dims))
    values = data[offset : offset + 4 * count].view(np.float32).reshape(tuple(tensor.dims))
    values[at] *= np.float32(1.1)
    data.tofile(weights)


def _refused(directory: Path, *args: str) -> str:
    result = CliRunner().invoke(main, ["check", str(directory), *args])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and lines and lines[-1].startswith("error: "), (result.exit_code, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    return lines[-1]


def test_the_pristine_export_passes_against_the_quantizer_run_again(rtn_export: Path) -> None:
    """kiln check runs the quantizer again (its stage is there), proves every graph on its numbers
    and leaves nothing behind in the export."""
    result = CliRunner().invoke(main, ["check", str(rtn_export)])
    assert result.exit_code == 0, result.output
    assert "check: int4 weights against the quantizer's numbers, run again on the checkpoint" in result.stderr
    assert "cannot run again" not in result.stderr, result.stderr
    assert "ort vs int4 weights" in result.stdout and "portable vs int4 weights" in result.stdout, result.stdout
    assert not any(p.name == NUMBERS_FILE for p in rtn_export.rglob("*"))


def test_a_portable_scale_off_with_the_hashes_recomputed_fails_check(export_dir: Path) -> None:
    """One block's scale 10% off in the portable graphs' DequantizeLinear weight (every graph: they
    agree with each other, so numbers read back from them would be copied into the reference and
    pass), hashes recomputed: kiln verify sees nothing, kiln check names the graph, node, weight and block."""
    for graph in ("prefill", "decode", "model"):
        _scale_off(export_dir / "onnx" / f"{graph}.onnx", "int4/layers.0.attn.o_proj.scale", (1, 3))
    _rehash(export_dir)
    require_verified(export_dir)  # the hashes hold: only the numbers can tell
    line = _refused(export_dir)
    assert (
        f"{_REFUSED}portable prefill.onnx: /layers.0.attn.o_proj/MatMul/weight/DequantizeLinear: {_BLOCK}scale " in line
    ), line
    assert "where the quantizer made " in line, line


def test_an_ort_scale_off_with_the_hashes_recomputed_fails_check(export_dir: Path) -> None:
    """The same fault in the --target ort graphs' MatMulNBits (scales [N, K/B] flat: column 3, block 1)."""
    for graph in ("prefill", "decode", "model"):
        _scale_off(
            export_dir / "onnx" / f"{graph}.ort.onnx", "ort_int4/int4/layers.0.attn.o_proj.weight_dq.scales", (7,)
        )
    _rehash(export_dir)
    require_verified(export_dir)
    line = _refused(export_dir)
    assert f"{_REFUSED}ort prefill.ort.onnx: /layers.0.attn.o_proj/MatMulNBits: {_BLOCK}scale " in line, line


def test_a_manifest_without_the_method_is_refused_not_loosened(export_dir: Path) -> None:
    """Every int4 export records its method and block size: a manifest edited to drop them cannot turn
    the check into one read back from the graphs; it is refused in one line."""

    def drop(data: dict[str, Any]) -> None:
        del data["export"]["quantization"]["method"]

    _rehash(export_dir, drop)
    line = _refused(export_dir)
    assert (
        "the manifest's export.quantization records no int4 method and block size (found None, 16), which every "
        "kiln int4 export records: kiln check cannot make the quantizer's numbers again; export again" in line
    ), line


def test_gptq_runs_again_on_the_calibration_data_passed(tmp_path: Path) -> None:
    """GPTQ: kiln check runs it again over the --calib-data file and matches every graph weight bit
    for bit; without the option the recorded file is not read (one line says what to pass) and the
    check judges on the numbers read back; a file of other windows is refused naming both hashes;
    with the right file a scale changed (hashes recomputed) is refused by name."""
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    rng = np.random.default_rng(0)
    calib = tmp_path / "calib.npy"
    np.save(calib, (np.cumsum(rng.integers(1, 4, size=2000)) % 101).astype(np.int64))
    options = ExportOptions.from_flags(
        precision=Precision.of(Int4(method=Int4Method.GPTQ, block=16)),
        calib_data=str(calib),
        calib_samples=4,
        parity_tokens=4,
    )
    out = tmp_path / "out"
    export(ckpt, out, options)
    result = CliRunner().invoke(main, ["check", str(out), "--calib-data", str(calib)])
    assert result.exit_code == 0 and "GPTQ: 14 weights, 4 windows" in result.stderr, result.output
    assert "cannot run again" not in result.stderr, result.stderr
    sha256 = json.loads((out / "manifest.json").read_text())["export"]["quantization"]["calibration"]["data_sha256"]
    result = CliRunner().invoke(main, ["check", str(out)])
    assert result.exit_code == 0 and "GPTQ:" not in result.stderr, result.output
    assert (
        "int4: the quantizer cannot run again: kiln check reads no calibration data from a path the manifest "
        f"records: pass --calib-data FILE, the export's calibration data (recorded as {calib}; its token windows' "
        f"sha256 {sha256}), to run it again; judged against the int4 numbers read back from the graphs"
    ) in result.stderr, result.stderr
    other = tmp_path / "other.npy"
    np.save(other, np.arange(2000, dtype=np.int64) % 101)
    line = _refused(out, "--calib-data", str(other))
    assert line.startswith(f"error: calibration: --calib-data {other}: its token windows' sha256 is "), line
    assert f", the export's calibration data's {sha256} (recorded as {calib}): not the data" in line, line
    for graph in ("prefill", "decode", "model"):
        _scale_off(out / "onnx" / f"{graph}.onnx", "int4/layers.0.attn.o_proj.scale", (1, 3))
    _rehash(out)
    line = _refused(out, "--calib-data", str(calib))
    assert f"{_REFUSED}portable prefill.onnx: /layers.0.attn.o_proj/MatMul/weight/DequantizeLinear: {_BLOCK}" in line


def test_calib_data_for_a_check_that_reads_none_is_refused(rtn_export: Path, tmp_path: Path) -> None:
    """RTN calibrates nothing: --calib-data is refused by name before anything is loaded, not ignored."""
    line = _refused(rtn_export, "--calib-data", str(tmp_path / "calib.npy"))
    assert line == (
        f"error: config: --calib-data {tmp_path / 'calib.npy'}: the check of {rtn_export} (its int4 graphs) runs no "
        "calibration again; leave --calib-data out (it is read for int8 and fp8 exports on ONNX Runtime and for "
        "int4 GPTQ exports)"
    ), line
