"""Structure of the exported directory: contract I/O, one weights file, PLE folded away, options."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from kiln.errors import ExportError
from kiln.exporter.check import check_dir
from kiln.exporter.contract.io import DECODER_KINDS, graph_io
from kiln.exporter.options import ExportOptions, LogitsMode, PLEExtendMode, PLETables
from kiln.exporter.pipeline import export
from kiln.plugins.native import spec_of
from kiln_testing import tiny_config, write_checkpoint


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("graphs")
    ckpt = write_checkpoint(root / "ckpt", tiny_config(ple={"bounded": True, "projection": True}))
    export(ckpt, root / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8))
    return root / "out"


def _dims(value: onnx.ValueInfoProto) -> list[object]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_graph_io_follows_the_contract(exported: Path) -> None:
    spec = spec_of(tiny_config(ple={"bounded": True, "projection": True}))
    for kind in DECODER_KINDS:
        model = onnx.load(exported / "onnx" / f"{kind.value}.onnx", load_external_data=False)
        want = graph_io(spec, kind)
        assert [i.name for i in model.graph.input] == want.input_names
        assert [o.name for o in model.graph.output] == want.output_names
        for value, tensor in zip([*model.graph.input, *model.graph.output], [*want.inputs, *want.outputs], strict=True):
            assert _dims(value) == list(tensor.dims), value.name
        assert model.opset_import[0].version == 19
        onnx.checker.check_model(exported / "onnx" / f"{kind.value}.onnx", full_check=True)  # typed, sorted, valid


def test_one_weights_file_shared_by_all_graphs(exported: Path) -> None:
    onnx_dir = exported / "onnx"
    assert sorted(p.name for p in onnx_dir.iterdir()) == [
        "decode.onnx",
        "genai_config.json",
        "model.onnx",
        "prefill.onnx",
        "weights.bin",
    ]
    spans: dict[str, set[tuple[str, str]]] = {}
    for kind in DECODER_KINDS:
        model = onnx.load(onnx_dir / f"{kind.value}.onnx", load_external_data=False)
        external = set()
        for init in model.graph.initializer:
            if init.data_location == onnx.TensorProto.EXTERNAL:
                info = {e.key: e.value for e in init.external_data}
                assert info["location"] == "weights.bin"
                external.add((info["offset"], info["length"]))
            else:
                assert len(init.raw_data) < 1024, f"{init.name} is embedded in {kind.value}.onnx"
        spans[kind.value] = external
    # decode and model.onnx use exactly the same weights; prefill a subset of them
    assert spans["decode"] == spans["model"]
    assert spans["prefill"] <= spans["model"]
    size = (onnx_dir / "weights.bin").stat().st_size
    assert sum(int(length) for _, length in spans["model"]) <= size


def test_ple_is_folded_away(exported: Path) -> None:
    model = onnx.load(exported / "onnx" / "model.onnx", load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert "Tanh" not in ops  # the bounded PLE's tanh is folded into the tables
    shapes = [list(i.dims) for i in model.graph.initializer]
    assert [48, 32] in shapes  # folded scale/shift tables
    assert [48, 64] not in shapes  # no projection output or (a, b) table
    names = [n.name for n in model.graph.node]
    assert "/layers.0.ple/Gather" in names and "/layers.1.ple/Gather_1" in names
    assert not any(n.startswith("/layers.0.ple.ple") for n in names)  # no node of the unfolded PLE module


def test_nodes_are_named_after_modules(exported: Path) -> None:
    model = onnx.load(exported / "onnx" / "decode.onnx", load_external_data=False)
    names = [n.name for n in model.graph.node]
    assert len(names) == len(set(names))
    assert "/layers.1.attn.q_proj/MatMul" in names
    assert "/layers.0.attn/Softmax" in names
    assert all(not n.metadata_props for n in model.graph.node)


def test_manifest_hashes_and_limits(exported: Path) -> None:
    from kiln.exporter.artifacts.hashing import sha256_file

    manifest = json.loads((exported / "manifest.json").read_text())
    assert manifest["manifest_version"] == 2
    assert manifest["limits"] == {"max_batch": 4, "max_context": 48}
    assert manifest["kv_cache"]["layout"] == "BNSH"
    assert set(manifest["files"]) == {
        "onnx/decode.onnx",
        "onnx/genai_config.json",
        "onnx/model.onnx",
        "onnx/prefill.onnx",
        "onnx/weights.bin",
        "reports/parity.json",
        "reports/parity.md",
        "reports/parity.png",
    }
    for rel, digest in manifest["files"].items():
        assert sha256_file(exported / rel) == digest
    assert manifest["graphs"]["decode"]["inputs"][3] == {
        "name": "past_key_values.0.key",
        "dtype": "float32",
        "shape": ["batch", 2, "past_seq", 8],
    }


def test_check_passes_and_refuses_changed_checkpoint(exported: Path) -> None:
    assert check_dir(exported).passed
    ckpt = exported.parent / "ckpt"
    other = write_checkpoint(exported.parent / "other", tiny_config(ple={"bounded": True, "projection": True}), seed=9)
    from kiln.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"checkpoint files \['model.safetensors'\] differ from the ones"):
        check_dir(exported, other)
    assert ckpt.is_dir()


def test_logits_last(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    result = export(ckpt, tmp_path / "out", ExportOptions.from_flags(logits=LogitsMode.LAST, parity_tokens=8))
    assert result.parity.passed
    prefill = onnx.load(tmp_path / "out" / "onnx" / "prefill.onnx", load_external_data=False)
    assert _dims(prefill.graph.output[0]) == ["batch", 1, 101]
    assert check_dir(tmp_path / "out").passed


def test_ple_tables_as_inputs(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    result = export(ckpt, tmp_path / "out", ExportOptions.from_flags(ple_tables=PLETables.INPUT, parity_tokens=8))
    assert result.parity.passed
    decode = onnx.load(tmp_path / "out" / "onnx" / "decode.onnx", load_external_data=False)
    names = [i.name for i in decode.graph.input]
    assert names[-4:] == ["ple.0.scale", "ple.0.shift", "ple.1.scale", "ple.1.shift"]
    assert _dims(decode.graph.input[-1]) == [48, 32]
    assert [48, 32] not in [list(i.dims) for i in decode.graph.initializer]
    assert check_dir(tmp_path / "out").passed


def test_context_longer_than_ple_table(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config(max_context=80))
    with pytest.raises(
        ExportError, match=r"--max-context 80 is longer than the PLE table \(48 rows\).*pass --ple-extend 80"
    ):
        export(ckpt, tmp_path / "out", ExportOptions.from_flags(max_context=80))
    assert not (tmp_path / "out").exists()
    with pytest.raises(ExportError, match="--max-context 96 exceeds the model's max_context 80"):
        export(ckpt, tmp_path / "out", ExportOptions.from_flags(max_context=96, ple_extend=96))
    for mode in PLEExtendMode:
        out = tmp_path / f"out-{mode.value}"
        result = export(
            ckpt, out, ExportOptions.from_flags(max_context=80, ple_extend=80, ple_extend_mode=mode, parity_tokens=70)
        )
        assert result.parity.passed
        assert result.manifest.limits.max_context == 80
        assert (
            max(g.steps + max(g.prompt_lengths) for g in result.parity.generation) == 80
        )  # positions past 48 exercised
        model = onnx.load(out / "onnx" / "model.onnx", load_external_data=False)
        assert [80, 32] in [list(i.dims) for i in model.graph.initializer]
        assert check_dir(out).passed


def test_exports_are_byte_identical(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    a = export(ckpt, tmp_path / "a", ExportOptions.from_flags(parity_tokens=4)).manifest.files
    b = export(ckpt, tmp_path / "b", ExportOptions.from_flags(parity_tokens=4)).manifest.files
    for rel in ("onnx/prefill.onnx", "onnx/decode.onnx", "onnx/model.onnx", "onnx/weights.bin"):
        assert a[rel] == b[rel], rel


def test_verify_hashes_without_torch(exported: Path) -> None:
    from kiln_testing import heavy_imports

    assert heavy_imports("verify", str(exported)) == (0, [])


def test_verify_lists_every_difference(exported: Path, tmp_path: Path) -> None:
    import shutil

    from click.testing import CliRunner

    from kiln.cli import main

    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    ok = CliRunner().invoke(main, ["verify", str(copy)])
    assert ok.exit_code == 0 and "all 8 files match manifest.json" in ok.stdout
    with open(copy / "onnx" / "weights.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\x01\x02")
    (copy / "reports" / "parity.png").unlink()
    (copy / "onnx" / "extra.onnx").write_bytes(b"")
    bad = CliRunner().invoke(main, ["verify", str(copy)])
    assert bad.exit_code == 1
    assert bad.stdout.splitlines()[1:] == [
        "  missing: reports/parity.png",
        "  changed (sha256 differs): onnx/weights.bin",
        "  unexpected: onnx/extra.onnx",
    ]
    checked = CliRunner().invoke(main, ["check", str(copy)])
    assert checked.exit_code == 1
    assert (
        "files differ from manifest.json: missing: reports/parity.png; changed (sha256 differs): onnx/weights.bin"
        in checked.stderr
    )


def test_check_trt_backend_without_engines(exported: Path) -> None:
    from click.testing import CliRunner

    from kiln.cli import main

    result = CliRunner().invoke(main, ["check", str(exported), "--backend", "trt"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        f"error: artifacts: {exported}: no engines/engines.json; run kiln build {exported} on a machine with TensorRT"
    ]


def test_bench_runs_and_reports_every_row(exported: Path, tmp_path: Path) -> None:
    """Measurement only (no timing is asserted): the table has a row per backend and sane values."""
    from click.testing import CliRunner

    from kiln.cli import main

    result = CliRunner().invoke(
        main, ["bench", str(exported), "--runs", "3", "--prefill-seq", "16", "--past", "8", "--no-roofline", "--json"]
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["prefill_seq"] == 16 and data["decode_past"] == 8
    for graph in ("prefill", "decode"):
        assert set(data["median_ms"][graph]) == {"pytorch eager", f"kiln fp32 ({exported.name})"}
        assert all(v > 0 for v in data["median_ms"][graph].values())
    other = write_checkpoint(tmp_path / "other", tiny_config(), seed=5)
    export(other, tmp_path / "other-out", ExportOptions.from_flags(parity_tokens=2))
    bad = CliRunner().invoke(main, ["bench", str(exported), str(tmp_path / "other-out"), "--runs", "3"])
    assert bad.exit_code == 1 and "exported from another checkpoint than" in bad.stderr
