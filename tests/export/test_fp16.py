"""--fp16: fp16 weights, activations and KV cache with fp32 islands named by node."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.errors import ConfigError
from kiln.exporter.check import check_dir
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.exporter.precision.kinds import Fp16
from kiln.exporter.progress import LineProgress
from kiln_testing import config_error, tiny_config, write_checkpoint

FP16 = ExportOptions.from_flags(precision=Precision.FP16, parity_tokens=16)


@pytest.fixture(scope="module")
def fp16_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp16")
    ckpt = write_checkpoint(root / "ckpt", tiny_config())
    export(ckpt, root / "out", FP16)
    return root / "out"


def _types(model: onnx.ModelProto) -> dict[str, int]:
    values = [*model.graph.input, *model.graph.output, *model.graph.value_info]
    return {v.name: v.type.tensor_type.elem_type for v in values}


def test_types_of_graph_io_and_weights(fp16_export: Path) -> None:
    manifest = json.loads((fp16_export / "manifest.json").read_text())
    assert manifest["precision"] == "fp16" and manifest["kv_cache"]["dtype"] == "float16"
    decode = onnx.load(fp16_export / "onnx" / "decode.onnx", load_external_data=False)
    io = {v.name: v.type.tensor_type.elem_type for v in [*decode.graph.input, *decode.graph.output]}
    assert io["past_key_values.0.key"] == io["present.1.value"] == onnx.TensorProto.FLOAT16
    assert io["logits"] == onnx.TensorProto.FLOAT and io["input_ids"] == onnx.TensorProto.INT64
    for kind in ("prefill", "decode", "model"):  # topologically sorted, consistently typed
        onnx.checker.check_model(fp16_export / "onnx" / f"{kind}.onnx", full_check=True)
    big = [i for i in decode.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert big and all(i.data_type == onnx.TensorProto.FLOAT16 for i in big)


def test_fp32_islands_are_named_and_really_fp32(fp16_export: Path) -> None:
    manifest = json.loads((fp16_export / "manifest.json").read_text())
    kept = manifest["graphs"]["decode"]["passes"]["fp16"]["fp32_nodes"]
    assert "/layers.0.attn/Softmax" in kept and "/layers.1.attn/Softmax" in kept
    assert {"/final_norm/ReduceMean", "/final_norm/Add", "/final_norm/Sqrt"} <= set(kept)  # eps Add by propagation
    assert "/layers.0.attn.q_proj/MatMul" not in kept
    decode = onnx.load(fp16_export / "onnx" / "decode.onnx", load_external_data=False)
    types = _types(decode)
    nodes = {n.name: n for n in decode.graph.node}
    softmax = nodes["/layers.0.attn/Softmax"]
    assert types[softmax.input[0]] == types[softmax.output[0]] == onnx.TensorProto.FLOAT
    q_proj = nodes["/layers.0.attn.q_proj/MatMul"]
    assert types[q_proj.output[0]] == onnx.TensorProto.FLOAT16
    report = json.loads((fp16_export / "reports" / "parity.json").read_text())
    assert report["kept_fp32"]["decode"]["nodes"] == kept


def test_parity_and_check(fp16_export: Path) -> None:
    report = json.loads((fp16_export / "reports" / "parity.json").read_text())
    assert report["passed"] and report["precision"] == "fp16"
    assert report["tolerance"]["logits_atol"] == 5e-2
    assert all(g["first_divergence"] is None for g in report["generation"])
    result = check_dir(fp16_export)
    assert result.passed and result.precision == "fp16"


def test_keep_fp32_by_name_and_module(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    options = ExportOptions.from_flags(
        precision=Precision.of(Fp16(keep_fp32=("/layers.1.attn.o_proj/MatMul", "/layers.0.mlp.fc2/", "Gather"))),
        parity_tokens=4,
    )
    manifest = export(ckpt, tmp_path / "out", options).manifest.to_json()
    kept = manifest["graphs"]["model"]["passes"]["fp16"]["fp32_nodes"]
    assert "/layers.1.attn.o_proj/MatMul" in kept and "/layers.0.mlp.fc2/MatMul" in kept
    assert "/layers.0.ple/Gather" in kept and "/embed/Gather" in kept
    assert manifest["export"]["keep_fp32"][-3:] == ["/layers.1.attn.o_proj/MatMul", "/layers.0.mlp.fc2/", "Gather"]
    with pytest.raises(
        ConfigError, match=r"--keep-fp32 /layers.7.attn/MatMul: no node of the prefill graph has that name"
    ):
        export(
            ckpt, tmp_path / "bad", ExportOptions(precision=Precision.of(Fp16(keep_fp32=("/layers.7.attn/MatMul",))))
        )
    assert not (tmp_path / "bad").exists()
    assert config_error(
        "export", "--model", str(ckpt), "--out", str(tmp_path / "bad"), "--keep-fp32", "Softmax"
    ).endswith("only apply to --fp16 exports")


def test_auto_keep_finds_the_overflowing_module(tmp_path: Path) -> None:
    """Layer 1's MLP is rescaled so that its hidden activations overflow fp16 (fc1 x1e5,
    fc2 /1e5: the same function in fp32). The search must name that module, not others.
    (ONNX Runtime's CPU kernels would hide the overflow, see precision/sensitivity.py.)"""
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config(mlp="gelu"))
    state = load_file(ckpt / "model.safetensors")
    state["layers.1.mlp.fc1.weight"] *= 1e5
    state["layers.1.mlp.fc2.weight"] /= 1e5
    save_file(state, ckpt / "model.safetensors")
    lines = io.StringIO()
    result = export(
        ckpt,
        tmp_path / "auto",
        ExportOptions.from_flags(precision=Precision.of(Fp16(auto_keep_fp32=True)), parity_tokens=8),
        LineProgress(lines),
    )
    assert result.parity.passed
    found = result.report.precision_extras["fp16_sensitivity"]
    rules = [g["rule"] for g in found["groups"]]
    assert rules and all(r.startswith("/layers.1.mlp") for r in rules), rules
    assert not np.isfinite(found["error_default"])  # fp16 overflow: inf/NaN logits with the default policy
    assert found["error_found"] <= found["tolerance"]
    for group in found["groups"]:
        assert group["nodes"] and all(n.startswith(group["rule"]) for n in group["nodes"])
        assert not np.isfinite(group["error_in_fp16"]) or group["error_in_fp16"] > found["tolerance"]
    kept = result.manifest.graphs["decode"].report("fp16")["fp32_nodes"]
    assert any(n.startswith("/layers.1.mlp") for n in kept)
    assert torch.isfinite(torch.tensor(result.parity.tensors[0].max_abs))
    said = [
        line for line in lines.getvalue().splitlines() if line.startswith("--auto-keep-fp32: ")
    ]  # what it found, said (issue 39)
    count = len(rules)
    assert said == [
        f"--auto-keep-fp32: kept {count} module{'s' if count > 1 else ''} in fp32: "
        f"{', '.join(rules[:5])}{f' (and {count - 5} more)' if count > 5 else ''}"
        f" (logits error {found['error_default']:.3g} at fp16, {found['error_found']:.3g} with them kept; limit "
        f"{found['tolerance']:g})"
    ]
