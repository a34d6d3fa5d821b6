"""bf16 and fp16 checkpoints exported as they are: loaded in their own dtype (no fp32 copy of the
model), graphs in fp32 or fp16 converted tensor by tensor, parity against the model computing in
fp32 from those same weights."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from safetensors.torch import save_model

from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.exporter.progress import LineProgress
from kiln.plugins import load_model
from kiln.plugins.native.build import random_model
from kiln_testing import tiny_config


def _native(directory: Path, dtype: torch.dtype) -> Path:
    directory.mkdir(parents=True)
    cfg = tiny_config()
    cfg.save(directory / "config.json")
    model = random_model(cfg, 0)
    for parameter in model.parameters():
        parameter.data = parameter.data.to(dtype)
    save_model(model, str(directory / "model.safetensors"))
    return directory


def _external(path: Path, name: str) -> np.ndarray:
    model = onnx.load(str(path), load_external_data=True)
    tensor = next(t for t in model.graph.initializer if t.name == name)
    return onnx.numpy_helper.to_array(tensor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_native_checkpoint_loads_as_it_is(dtype: torch.dtype, tmp_path: Path) -> None:
    loaded = load_model(_native(tmp_path / "ckpt", dtype))
    assert loaded.spec.dtype == str(dtype).removeprefix("torch.")
    assert {p.dtype for p in loaded.module.parameters()} == {dtype}  # no fp32 copy of the weights
    assert all(
        b.dtype == torch.float32 for b in loaded.module.buffers() if b.is_floating_point()
    )  # rotary angles stay fp32


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.FP16])
def test_bf16_native_checkpoint_to_fp32_and_fp16_graphs(precision: Precision, tmp_path: Path) -> None:
    ckpt = _native(tmp_path / "ckpt", torch.bfloat16)
    lines = io.StringIO()
    result = export(
        ckpt, tmp_path / "out", ExportOptions.from_flags(precision=precision, parity_tokens=8), LineProgress(lines)
    )
    assert result.parity.passed, result.parity.failures()
    widening = (
        "the checkpoint's weights are bfloat16: the fp32 graphs hold each in 4 bytes, twice the checkpoint's size "
        "(--fp16 keeps 2 bytes a weight)"
    )
    assert (widening in lines.getvalue().splitlines()) is (precision is Precision.FP32)
    assert any(
        line.startswith("fold PLE: 1/1 in ") for line in lines.getvalue().splitlines()
    )  # the native decoder has PLE
    assert result.manifest.checkpoint.dtype == "bfloat16" and result.manifest.precision == precision.value
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["checkpoint"]["dtype"] == "bfloat16"
    # the graphs' weights are the checkpoint's bf16 values, converted tensor by tensor (exactly: bf16 fits fp32 and
    # fp16)
    stored = load_model(ckpt).module.state_dict()["layers.0.attn.q_proj.weight"]
    graph = tmp_path / "out" / "onnx" / "model.onnx"
    name = "weights/layers.0.attn.q_proj/MatMul:1"
    np.testing.assert_array_equal(
        _external(graph, name),
        stored.float().numpy().T.astype(np.float16 if precision is Precision.FP16 else np.float32),
    )


def test_bf16_hugging_face_checkpoint_to_fp16_graphs(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from kiln.plugins.hf import tiny_model

    ckpt = tmp_path / "ckpt"
    tiny_model("LlamaForCausalLM", seed=1).module.model.to(torch.bfloat16).save_pretrained(
        ckpt, safe_serialization=True
    )
    loaded = load_model(ckpt)
    assert loaded.spec.dtype == "bfloat16" and {p.dtype for p in loaded.module.parameters()} == {torch.bfloat16}
    lines = io.StringIO()
    result = export(
        ckpt, tmp_path / "out", ExportOptions.from_flags(precision=Precision.FP16, parity_tokens=8), LineProgress(lines)
    )
    assert result.parity.passed, result.parity.failures()
    assert result.manifest.checkpoint.dtype == "bfloat16" and result.manifest.kv_cache.dtype == "float16"
    stages = [line.split(":")[0] for line in lines.getvalue().splitlines()]
    assert (
        "load checkpoint" in stages and "fold PLE" not in stages and "trace" in stages
    )  # no PLE stage for a model without PLE
    assert not any("bytes a weight" in line for line in lines.getvalue().splitlines())  # fp16 graphs: no widening
