"""--fp8: E4M3 Q/DQ before MatMul inputs (weights per channel, activations per tensor), the rest fp16."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from kiln.errors import ExportError
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.exporter.precision.fp8 import fp8_weight
from kiln.exporter.precision.kinds import Fp8
from kiln.exporter.precision.qdq_rules import check_qdq
from kiln_testing import config_error, tiny_config, write_checkpoint


@pytest.fixture(scope="module")
def fp8_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    ckpt = write_checkpoint(root / "ckpt", tiny_config())
    rng = np.random.default_rng(0)
    np.save(root / "calib.npy", (np.cumsum(rng.integers(1, 4, size=4000)) % 101).astype(np.int64))
    options = ExportOptions.from_flags(
        precision=Precision.FP8,
        calib_data=str(root / "calib.npy"),
        calib_samples=8,
        calib_cache=root / "cache",
        parity_tokens=16,
    )
    export(ckpt, root / "out", options)
    return root / "out"


def test_qdq_structure_checker_and_rules(fp8_export: Path) -> None:
    for kind in ("prefill", "decode", "model"):
        path = fp8_export / "onnx" / f"{kind}.onnx"
        onnx.checker.check_model(path, full_check=True)
        assert check_qdq(ir.load(path)) == 14 + 8  # 14 weight DQs, 8 activation pairs (q/k/v share one, gate/fc1 one)
        model = onnx.load(path)
        assert model.opset_import[0].version == 19
        types = {i.name: i.data_type for i in model.graph.initializer}
        inits = {
            i.name: onnx.numpy_helper.to_array(i)
            for i in model.graph.initializer
            if i.data_type != onnx.TensorProto.FLOAT8E4M3FN
        }
        producers = {o: n for n in model.graph.node for o in n.output}
        nodes = {n.name: n for n in model.graph.node}
        act, weight = (producers[i] for i in nodes["/layers.0.attn.k_proj/MatMul"].input)
        assert act.op_type == weight.op_type == "DequantizeLinear"
        assert types[weight.input[0]] == onnx.TensorProto.FLOAT8E4M3FN and inits[weight.input[1]].shape == (16,)
        assert inits[weight.input[1]].dtype == np.float16 and {a.name: a.i for a in weight.attribute} == {"axis": 1}
        assert producers[act.input[0]].op_type == "QuantizeLinear" and inits[act.input[1]].shape == ()
        assert types[act.input[2]] == onnx.TensorProto.FLOAT8E4M3FN
        assert producers[nodes["/layers.0.attn.q_proj/MatMul"].input[0]] is act  # one pair for the tensor q/k/v read
        for name in ("/lm_head/MatMul", "/layers.0.attn/MatMul", "/layers.0.attn/MatMul_1"):
            assert all(
                producers.get(i) is None or producers[i].op_type != "DequantizeLinear" for i in nodes[name].input
            ), name


def test_manifest_and_parity(fp8_export: Path) -> None:
    from importlib import resources

    from jsonschema import Draft202012Validator

    manifest = json.loads((fp8_export / "manifest.json").read_text())
    assert manifest["precision"] == "fp8" and manifest["kv_cache"]["dtype"] == "float16"
    assert (
        manifest["export"]["quantization"]["method"] == "max"
        and manifest["export"]["calibration"]["settings"]["method"] == "max"
    )
    assert "/layers.1.mlp.fc2/MatMul" in manifest["graphs"]["decode"]["passes"]["fp8"]["nodes"]
    schema = json.loads((resources.files("kiln.exporter.artifacts") / "manifest.schema.json").read_text())
    Draft202012Validator(schema).validate(manifest)
    report = json.loads((fp8_export / "reports" / "parity.json").read_text())
    assert report["passed"] and report["precision"] == "fp8"
    assert all(g["token_match_rate"] >= 0.9 for g in report["generation"])


def test_weights_round_to_e4m3_without_nan() -> None:
    w = np.array([[1000.0, -3.0], [0.5, 2.0]], dtype=np.float32)
    q, scale = fp8_weight(w)
    assert scale.dtype == np.float16 and np.all(np.isfinite(q.astype(np.float32)))
    assert q.astype(np.float32)[0, 0] == 448.0  # the column's amax maps to E4M3's largest value
    assert np.allclose(q.astype(np.float32) * scale.astype(np.float32), w, rtol=0.07)


def test_rule_check_names_what_is_wrong(fp8_export: Path) -> None:
    model = ir.load(fp8_export / "onnx" / "decode.onnx")
    dq = next(
        n
        for n in model.graph
        if n.op_type == "DequantizeLinear" and n.inputs[0] is not None and n.inputs[0].const_value is not None
    )
    dq.inputs[1].const_value = ir.tensor(-np.ones(16, np.float16))  # type: ignore[union-attr]
    with pytest.raises(ExportError, match="scales must be finite and > 0"):
        check_qdq(model)
    model.opset_imports[""] = 18
    with pytest.raises(ExportError, match="Q/DQ graph has opset 18; fp8 needs 19 or later"):
        check_qdq(model)


def _calib(root: Path) -> Path:
    rng = np.random.default_rng(0)
    np.save(root / "calib.npy", (np.cumsum(rng.integers(1, 4, size=4000)) % 101).astype(np.int64))
    return root / "calib.npy"


def test_fp8_float_keeps_the_named_matmuls_fp16(tmp_path: Path) -> None:
    """``--fp8-float`` (through the CLI): a module rule and a suffix rule leave exactly those
    MatMuls without Q/DQ (fp16, as the rest of the graph), the others stay fp8, the manifest
    records the rules, and the graphs still pass the checker, the rule check and parity."""
    from click.testing import CliRunner

    from kiln.cli import main

    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    args = [
        "export",
        "--model",
        str(ckpt),
        "--out",
        str(tmp_path / "out"),
        "--fp8",
        "--calib-data",
        str(_calib(tmp_path)),
        "--calib-samples",
        "8",
        "--calib-cache",
        str(tmp_path / "cache"),
        "--parity-tokens",
        "8",
        "--fp8-float",
        "/layers.0.mlp.fc2/",
        "--fp8-float",
        "*.q_proj",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    for kind in ("prefill", "decode", "model"):
        path = out / "onnx" / f"{kind}.onnx"
        onnx.checker.check_model(path, full_check=True)
        # 14 weight DQs less layers.0's fc2 and both q_proj; 8 activation pairs less layers.0
        # fc2's (q/k/v's pair stays: k and v still read it)
        assert check_qdq(ir.load(path)) == 11 + 7
        model = onnx.load(path)
        producers = {o: n for n in model.graph.node for o in n.output}
        nodes = {n.name: n for n in model.graph.node}
        for name in ("/layers.0.mlp.fc2/MatMul", "/layers.0.attn.q_proj/MatMul", "/layers.1.attn.q_proj/MatMul"):
            assert all(
                producers.get(i) is None or producers[i].op_type != "DequantizeLinear" for i in nodes[name].input
            ), name
        for name in ("/layers.1.mlp.fc2/MatMul", "/layers.0.attn.k_proj/MatMul", "/layers.0.mlp.fc1/MatMul"):
            assert all(producers[i].op_type == "DequantizeLinear" for i in nodes[name].input), name
        weight = {i.name: i for i in model.graph.initializer}
        assert weight[nodes["/layers.0.mlp.fc2/MatMul"].input[1]].data_type == onnx.TensorProto.FLOAT16
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"/layers.0.mlp.fc2/", "*.q_proj"} <= set(manifest["export"]["quantization"]["kept_float"]["rules"])
    assert "/layers.0.mlp.fc2/MatMul" not in manifest["graphs"]["decode"]["passes"]["fp8"]["nodes"]
    assert "/layers.1.mlp.fc2/MatMul" in manifest["graphs"]["decode"]["passes"]["fp8"]["nodes"]
    assert json.loads((out / "reports" / "parity.json").read_text())["passed"]


def test_fp8_float_refuses_a_rule_that_names_nothing_and_other_precisions(tmp_path: Path) -> None:
    from kiln.errors import ConfigError

    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    options = ExportOptions.from_flags(
        precision=Precision.of(Fp8(float_rules=("/layers.0.mlp.fc3/",))),
        calib_data=str(_calib(tmp_path)),
        calib_samples=2,
        calib_cache=tmp_path / "cache",
        parity_tokens=4,
    )
    with pytest.raises(ConfigError, match=r"--fp8-float /layers.0.mlp.fc3/: no MatMul of the .* graph matches it"):
        export(ckpt, tmp_path / "out", options)
    assert not (tmp_path / "out").exists()
    out = str(tmp_path / "out")
    assert (
        config_error("export", "--model", str(ckpt), "--out", out, "--fp16", "--fp8-float", "*.fc2")
        == "--fp8-float only applies to --fp8 exports"
    )


def test_gpt2_conv1d_gemms_get_fp8_weights(tmp_path: Path) -> None:
    """GPT-2's Conv1D traces to Gemm: written as MatMul + Add (``passes.gemm``), each one's weight
    is fp8 (before, an --fp8 GPT-2 had no fp8 weight at all: fp8 in name only); parity passes."""
    pytest.importorskip("transformers")
    from kiln.plugins.hf import tiny_model

    ckpt = tmp_path / "ckpt"
    model = tiny_model("gpt2", seed=1).module.model
    model.save_pretrained(ckpt, safe_serialization=True)
    options = ExportOptions.from_flags(
        max_batch=4,
        precision=Precision.FP8,
        calib_data=str(_calib(tmp_path)),
        calib_samples=8,
        calib_cache=tmp_path / "cache",
        parity_tokens=8,
    )
    result = export(ckpt, tmp_path / "out", options)
    assert result.parity.passed, result.parity.failures()
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    modules = [
        f"/model.transformer.h.{i}.{m}/MatMul"
        for i in range(model.config.n_layer)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    for graph in manifest["graphs"].values():
        assert graph["passes"]["fp8"]["nodes"] == modules
        ops = {n.op_type for n in onnx.load(str(tmp_path / "out" / graph["file"]), load_external_data=False).graph.node}
        assert "Gemm" not in ops
