"""Cross-attention decoders (the seed's MyDecoderLayer): prefill takes encoder_hidden_states and
returns the cross cache once; decode and model.onnx take it back and never grow it."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner
from jsonschema import Draft202012Validator

from kiln.cli import main
from kiln.errors import ConfigError
from kiln.exporter.artifacts.manifest import Manifest
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.plugins import load_model
from kiln_testing import tiny_config, write_checkpoint

CROSS = tiny_config(cross_attention=True)


@pytest.fixture(scope="module")
def cross_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cross")
    ckpt = write_checkpoint(root / "ckpt", CROSS, seed=3)
    result = export(ckpt, root / "out", ExportOptions.from_flags(max_batch=4))
    assert result.parity.passed, result.parity.failures()
    return root / "out"


def _session(directory: Path, kind: str) -> ort.InferenceSession:
    return ort.InferenceSession(str(directory / "onnx" / f"{kind}.onnx"), providers=["CPUExecutionProvider"])


def _prompt(batch: int = 1, seq: int = 4) -> dict[str, np.ndarray]:
    ids = np.arange(3, 3 + batch * seq, dtype=np.int64).reshape(batch, seq)
    return {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "position_ids": np.tile(np.arange(seq, dtype=np.int64), (batch, 1)),
    }


def _encoder(batch: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, length, CROSS.d_model)).astype(np.float32)


def test_io_names_and_the_cross_cache_is_returned_once(cross_export: Path) -> None:
    prefill, decode, model = (_session(cross_export, k) for k in ("prefill", "decode", "model"))
    assert [i.name for i in prefill.get_inputs()] == [
        "input_ids",
        "attention_mask",
        "position_ids",
        "encoder_hidden_states",
    ]
    assert prefill.get_inputs()[3].shape == ["batch", "encoder_seq", 32]
    assert [o.name for o in prefill.get_outputs()][1:5] == [
        "present.0.key",
        "present.0.value",
        "present.0.cross_key",
        "present.0.cross_value",
    ]
    assert prefill.get_outputs()[3].shape == ["batch", 2, "encoder_seq", 8]
    for session in (decode, model):
        names = [i.name for i in session.get_inputs()]
        assert "encoder_hidden_states" not in names
        assert names[3:7] == [
            "past_key_values.0.key",
            "past_key_values.0.value",
            "past_key_values.0.cross_key",
            "past_key_values.0.cross_value",
        ]
        assert session.get_inputs()[5].shape == ["batch", 2, "encoder_seq", 8]
        assert [o.name for o in session.get_outputs()] == [
            "logits",
            "present.0.key",
            "present.0.value",
            "present.1.key",
            "present.1.value",
        ]
    manifest = json.loads((cross_export / "manifest.json").read_text())
    assert manifest["model"]["encoder_dim"] == 32
    schema = json.loads(resources.files("kiln.exporter.artifacts").joinpath("manifest.schema.json").read_text())
    assert not [e.message for e in Draft202012Validator(schema).iter_errors(manifest)]  # encoder_seq dims, cross names
    assert not (
        cross_export / "onnx" / "genai_config.json"
    ).exists()  # GenAI's decoder models cannot feed a cross cache


def test_decode_never_recomputes_the_encoder_projection(cross_export: Path) -> None:
    def modules(kind: str) -> set[str]:
        graph = onnx.load(cross_export / "onnx" / f"{kind}.onnx", load_external_data=False).graph
        return {n.name.rsplit("/", 1)[0] for n in graph.node if "cross_attn" in n.name}

    assert {"/layers.0.cross_attn.k_proj", "/layers.0.cross_attn.v_proj"} <= modules("prefill")
    for kind in ("decode", "model"):
        assert not any(".k_proj" in m or ".v_proj" in m for m in modules(kind) if "cross_attn" in m)
        assert "/layers.0.cross_attn.q_proj" in modules(kind)


def test_cross_cache_is_the_projection_of_the_encoder_states(cross_export: Path) -> None:
    """The prefill's cross cache equals the PyTorch layer's own projection, and decode
    really reads it: a different cache gives different logits."""
    loaded = load_model(cross_export.parent / "ckpt")
    encoder = _encoder(2, 5, seed=0)
    outs = dict(
        zip(
            [o.name for o in _session(cross_export, "prefill").get_outputs()],
            _session(cross_export, "prefill").run(None, {**_prompt(2), "encoder_hidden_states": encoder}),
            strict=True,
        )
    )
    with torch.no_grad():
        key, value = loaded.module.layers[1].cross_attn.project(torch.from_numpy(encoder))
    np.testing.assert_allclose(outs["present.1.cross_key"], key.numpy(), atol=1e-5)
    np.testing.assert_allclose(outs["present.1.cross_value"], value.numpy(), atol=1e-5)

    decode = _session(cross_export, "decode")
    feeds = {
        "input_ids": np.array([[7], [8]], dtype=np.int64),
        "attention_mask": np.ones((2, 5), dtype=np.int64),
        "position_ids": np.array([[4], [4]], dtype=np.int64),
    }
    for i in range(CROSS.n_layers):
        for kind in ("key", "value", "cross_key", "cross_value"):
            feeds[f"past_key_values.{i}.{kind}"] = outs[f"present.{i}.{kind}"]
    first = decode.run(["logits"], feeds)[0]
    other = dict(
        feeds,
        **{
            f"past_key_values.{i}.cross_value": np.zeros_like(outs[f"present.{i}.cross_value"])
            for i in range(CROSS.n_layers)
        },
    )
    assert np.abs(decode.run(["logits"], other)[0] - first).max() > 1e-2


def test_cross_attention_has_no_causal_mask(cross_export: Path) -> None:
    """The first decoder token already sees the LAST encoder position (the seed's warning:
    a causal mask on cross-attention would hide it)."""
    prefill = _session(cross_export, "prefill")
    encoder = _encoder(1, 6, seed=1)
    changed = encoder.copy()
    changed[:, -1, :] += 3.0
    a = prefill.run(["logits"], {**_prompt(1), "encoder_hidden_states": encoder})[0]
    b = prefill.run(["logits"], {**_prompt(1), "encoder_hidden_states": changed})[0]
    assert np.abs(a[:, 0] - b[:, 0]).max() > 1e-3


def test_check_passes_on_a_cross_attention_export(cross_export: Path) -> None:
    result = CliRunner().invoke(main, ["check", str(cross_export)])
    assert result.exit_code == 0, result.output
    exported = json.loads((cross_export / "reports" / "parity.json").read_text())  # the same checks, at export time
    runs, steps = len(exported["generation"]), sum(g["steps"] for g in exported["generation"])
    lines = result.stdout.strip().splitlines()  # a short table and one closing verdict line
    assert (
        lines[0]
        == f"{cross_export}: onnxruntime vs PyTorch, {len(exported['tensors'])} tensors and {runs} generation runs"
        and lines[1] == ""
    )
    assert lines[2].startswith("| graph set | precision | worst logit error |") and lines[4].startswith(
        "| portable | fp32 | "
    )
    assert len(lines) == 7 and lines[5] == "" and lines[6].startswith("parity passed: logits error ")
    assert lines[6].endswith(
        f"), tokens 100% equal over {steps} steps; quality not measured: a cross-attention decoder's quality "
        "needs its encoder's inputs"
        f" (every check: kiln check {cross_export} --verbose)"
    )
    assert lines[6].count(" (limit ") == 2  # the logits' and the KV cache's
    verbose = CliRunner().invoke(main, ["check", str(cross_export), "--verbose"])
    assert (
        verbose.exit_code == 0
        and "## Tensors" in verbose.stdout
        and "| prefill | 2 | present.1.cross_value |" in verbose.stdout
    )
    assert verbose.stdout.strip().splitlines()[-1].startswith("parity passed: ")
    report = json.loads((cross_export / "reports" / "parity.json").read_text())
    graphs = {(t["graph"], t["output"]) for t in report["tensors"]}
    assert ("prefill", "present.1.cross_value") in graphs and ("decode", "present.1.cross_value") not in graphs
    assert {(g["path"], g["batch"]) for g in report["generation"]} == {
        ("prefill+decode", 1),
        ("model", 1),
        ("prefill+decode", 3),
        ("model", 3),
    }
    assert all(g["token_match_rate"] == 1.0 for g in report["generation"])


def test_fp16_post_norm_cross_attention(tmp_path: Path) -> None:
    from kiln.plugins.native.config import NativeConfig

    base = tiny_config().to_dict()
    cfg = NativeConfig.from_dict(
        {
            **base,
            "cross_attention": True,
            "norm_position": "post",
            "norm": "layernorm",
            "ple": {**base["ple"], "placement": "before_attention"},
        }
    )
    ckpt = write_checkpoint(tmp_path / "ckpt", cfg, seed=5)
    result = export(ckpt, tmp_path / "out", ExportOptions.from_flags(precision=Precision.FP16, parity_tokens=16))
    assert result.parity.passed, result.parity.failures()
    prefill = onnx.load(tmp_path / "out" / "onnx" / "prefill.onnx", load_external_data=False).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*prefill.input, *prefill.output]}
    assert types["encoder_hidden_states"] == types["present.0.cross_key"] == onnx.TensorProto.FLOAT16


def test_int8_and_triton_are_refused_with_the_reason(cross_export: Path, tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match="--int8 is not supported for cross-attention decoders yet: calibration needs encoder_hidden_states",
    ):
        export(
            cross_export.parent / "ckpt",
            tmp_path / "int8",
            ExportOptions.from_flags(precision=Precision.INT8, calib_data="synthetic"),
        )
    assert not (tmp_path / "int8").exists()
    result = CliRunner().invoke(main, ["triton", str(cross_export), "--name", "cross"])
    assert result.exit_code != 0
    assert "triton: cross-attention decoders are not supported yet" in result.output


def test_config_flag_must_be_boolean() -> None:
    from kiln.plugins.native.config import NativeConfig

    raw = {**tiny_config().to_dict(), "cross_attention": "yes"}
    with pytest.raises(ConfigError, match="cross_attention must be true or false, found 'yes'"):
        NativeConfig.from_dict(raw)


def test_engine_profiles_bound_the_encoder_length(cross_export: Path) -> None:
    from kiln.exporter.engine.options import BuildOptions
    from kiln.exporter.engine.profiles import engine_profiles

    manifest = json.loads((cross_export / "manifest.json").read_text())
    prefill, decode = engine_profiles(Manifest.from_json(manifest), BuildOptions(opt_context=16))
    shapes = {s.name: (s.min, s.opt, s.max) for s in prefill.inputs}
    assert shapes["encoder_hidden_states"] == ((1, 1, 32), (1, 16, 32), (4, 48, 32))
    shapes = {s.name: (s.min, s.opt, s.max) for s in decode.inputs}
    assert shapes["past_key_values.1.cross_key"] == ((1, 2, 1, 8), (1, 2, 16, 8), (4, 2, 48, 8))
    assert shapes["past_key_values.1.key"] == ((1, 2, 1, 8), (1, 2, 15, 8), (4, 2, 47, 8))


def test_bench_feeds_the_encoder_and_generate_refuses(cross_export: Path) -> None:
    bench = CliRunner().invoke(
        main,
        ["bench", str(cross_export), "--runs", "3", "--prefill-seq", "8", "--past", "8", "--no-roofline", "--json"],
    )
    assert bench.exit_code == 0, bench.output
    result = json.loads(bench.output)
    assert result["median_ms"]["decode"] and all(v > 0 for v in result["median_ms"]["decode"].values())
    generate = CliRunner().invoke(main, ["generate", str(cross_export), "--ids", "3,4,5"])
    assert generate.exit_code != 0
    assert (
        "a cross-attention decoder needs its encoder's output (encoder_hidden_states); kiln generate has no "
        "encoder to run" in generate.output
    )
