"""Whisper, the speech encoder-decoder (``plugins.hf.seq2seq``; its tiny random model, 2 encoder and
2 decoder layers, hidden 64, 16 mel bins over 32 frames, is ``plugins.hf.speech``'s): exported as
an encoder graph on log-mel ``input_features`` plus the decoder's prefill/decode/unified graphs
with their self and cross caches. kiln's greedy tokens through ONNX Runtime (its own encoder graph,
then prefill + decode) must equal transformers' ``generate(input_features=...)`` at batch 1 and 2,
and ``kiln generate --features`` must print them. The tiny config bans and forces no token
(``suppress_tokens``/``begin_suppress_tokens`` None, no forced language/task ids), and the end
token does not stop transformers (``eos_token_id=None``): both sides run the same rule, argmax
from ``decoder_start_token_id``."""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jsonschema import Draft202012Validator

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install 'kiln[hf]')"
)

import onnx
import onnxruntime as ort
import torch
from click.testing import CliRunner

from kiln.cli import main
from kiln.errors import ConfigError
from kiln.exporter.check import check_dir
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.parity import greedy, make_prompts
from kiln.exporter.parity.generation import stand_in_features
from kiln.exporter.pipeline import export
from kiln.exporter.precision.kinds import Int4
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln.exporter.runners import OrtRunner
from kiln.plugins import load_model
from kiln.plugins.hf import SUPPORTED, tiny_model
from kiln.plugins.hf.seq2seq import SEQ2SEQ
from kiln.plugins.hf.speech import FRAMES, MELS, SPEECH_TINY
from kiln_testing import hf_seq2seq, rtn_linears, whisper_generate

STEPS = 16
START = 3  # the tiny config's decoder_start_token_id


def _save(directory: Path, **overrides: Any) -> Path:
    tiny_model("whisper", seed=1, **overrides).module.model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("whisper")
    result = export(_save(root / "ckpt"), root / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8))
    assert result.parity.passed, result.parity.failures()
    assert {c.graph for c in result.parity.tensors} == {"prefill", "decode", "model", "encoder"}
    return root


def _validator() -> Draft202012Validator:
    return Draft202012Validator(
        json.loads(resources.files("kiln.exporter.artifacts").joinpath("manifest.schema.json").read_text())
    )


def test_whisper_is_listed_with_its_tiny_model() -> None:
    assert "WhisperForConditionalGeneration" in SEQ2SEQ and "WhisperForConditionalGeneration" in SUPPORTED
    assert SPEECH_TINY["whisper"][0] == "WhisperForConditionalGeneration"
    assert tiny_model("whisper", seed=0).spec.encoder_features == (MELS, FRAMES)


def test_the_encoder_graph_takes_log_mel_features(whisper: Path) -> None:
    def session(kind: str) -> ort.InferenceSession:
        return ort.InferenceSession(str(whisper / "out" / "onnx" / f"{kind}.onnx"), providers=["CPUExecutionProvider"])

    encoder, prefill, decode = session("encoder"), session("prefill"), session("decode")
    assert [(i.name, i.type, i.shape) for i in encoder.get_inputs()] == [
        ("input_features", "tensor(float)", ["batch", MELS, FRAMES])
    ]
    assert [(o.name, o.shape) for o in encoder.get_outputs()] == [("encoder_hidden_states", ["batch", FRAMES // 2, 64])]
    # its encoder reads no mask, and neither does the decoder's cross-attention
    assert [i.name for i in prefill.get_inputs()] == [
        "input_ids",
        "attention_mask",
        "position_ids",
        "encoder_hidden_states",
    ]
    assert [i.name for i in decode.get_inputs()][3:5] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert "past_key_values.0.cross_key" in [i.name for i in decode.get_inputs()]
    manifest = json.loads((whisper / "out" / "manifest.json").read_text())
    assert manifest["model"]["has_encoder"] and manifest["model"]["decoder_start_token_id"] == START
    assert manifest["graphs"]["encoder"]["inputs"] == [
        {"name": "input_features", "dtype": "float32", "shape": ["batch", MELS, FRAMES]}
    ]
    assert not [e.message for e in _validator().iter_errors(manifest)]
    wrong = copy.deepcopy(manifest)
    wrong["graphs"]["encoder"]["inputs"][0]["dtype"] = "int64"  # features are floats
    assert list(_validator().iter_errors(wrong))


def test_greedy_tokens_equal_transformers_generate(whisper: Path) -> None:
    spec = load_model(whisper / "ckpt").spec
    onnx_dir = whisper / "out" / "onnx"
    graphs = {k: onnx_dir / f"{k.value}.onnx" for k in (GraphKind.ENCODER, GraphKind.PREFILL, GraphKind.DECODE)}
    hf = hf_seq2seq(whisper / "ckpt")
    for lengths in ([5], [5, 3]):  # batch 1 and 2: each prompt stands for its own random features
        prompts = make_prompts(spec, lengths, seed=len(lengths))
        features = stand_in_features(spec, prompts)
        assert features.shape == (len(lengths), MELS, FRAMES)
        want = whisper_generate(hf, features, STEPS)
        assert len(set(want.ravel().tolist())) > 3, want  # the tiny model's tokens vary: a comparison that can fail
        with OrtRunner(graphs) as runner:
            got, _ = greedy(runner, spec, prompts, STEPS)
        np.testing.assert_array_equal(got, want, err_msg=f"batch {len(lengths)}")


def _generate_cli(*args: str) -> Any:
    return CliRunner().invoke(main, ["generate", *args])


def test_kiln_generate_features(whisper: Path, tmp_path: Path) -> None:
    out = str(whisper / "out")
    features = np.random.default_rng(5).standard_normal((MELS, FRAMES)).astype(np.float32)
    np.save(tmp_path / "f.npy", features)
    want = whisper_generate(hf_seq2seq(whisper / "ckpt"), features[None], 10)[0].tolist()
    result = _generate_cli(out, "--features", str(tmp_path / "f.npy"), "--max-new-tokens", "10", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["tokens"] == want and summary["prompt_ids"] == [START]
    np.save(tmp_path / "batched.npy", features[None])  # [1, n_mels, frames] too
    result = _generate_cli(out, "--features", str(tmp_path / "batched.npy"), "--max-new-tokens", "10")
    assert result.exit_code == 0, result.output
    assert result.stdout.split() == [str(t) for t in want]
    # --ids is the decoder's prefix: from the start token and the first generated token, the rest follows
    result = _generate_cli(
        out, "--features", str(tmp_path / "f.npy"), "--ids", f"{START},{want[0]}", "--max-new-tokens", "9", "--json"
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] == want[1:]


def _error(*args: str) -> str:
    result = _generate_cli(*args)
    assert result.exit_code == 1, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: generate: ") and "Traceback" not in result.stderr
    return lines[0]


def test_kiln_generate_refuses_what_does_not_fit(whisper: Path, tmp_path: Path) -> None:
    out = str(whisper / "out")
    features = np.zeros((MELS, FRAMES), dtype=np.float32)
    for name, array in {"short": features[:, :30], "ints": features.astype(np.int64), "nan": features * np.nan}.items():
        np.save(tmp_path / f"{name}.npy", array)
    (tmp_path / "text.npy").write_text("not an array")
    assert f"shape [{MELS}, 30], expected [{MELS}, {FRAMES}] (n_mels x frames" in _error(
        out, "--features", str(tmp_path / "short.npy")
    )
    assert "dtype int64, expected floating-point log-mel features" in _error(
        out, "--features", str(tmp_path / "ints.npy")
    )
    assert "has non-finite values" in _error(out, "--features", str(tmp_path / "nan.npy"))
    assert "not a readable .npy file" in _error(out, "--features", str(tmp_path / "text.npy"))
    assert "is a speech encoder-decoder (Whisper): it transcribes log-mel features; pass --features" in _error(
        out, "--ids", "5,6"
    )
    np.save(tmp_path / "f.npy", features)
    assert "the decoder's prefix is given as --ids" in _error(
        out, "--features", str(tmp_path / "f.npy"), "--prompt", "x"
    )
    assert "exceed the export's context limit 64" in _error(
        out, "--features", str(tmp_path / "f.npy"), "--max-new-tokens", "65"
    )


def test_check_and_verify_pass(whisper: Path) -> None:
    assert check_dir(whisper / "out").passed
    result = CliRunner().invoke(main, ["verify", str(whisper / "out")])
    assert result.exit_code == 0 and "match manifest.json" in result.output, result.output


@pytest.mark.slow
def test_fp16(tmp_path: Path) -> None:
    """fp16 graphs pass their own parity; the encoder takes fp16 features, which kiln generate casts to."""
    ckpt = _save(tmp_path / "ckpt", init_std=0.1)
    result = export(
        ckpt, tmp_path / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8, precision=Precision.FP16)
    )
    assert result.parity.passed, result.parity.failures()
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["precision"] == "fp16" and not [e.message for e in _validator().iter_errors(manifest)]
    assert manifest["graphs"]["encoder"]["inputs"][0]["dtype"] == "float16"
    features = np.random.default_rng(5).standard_normal((MELS, FRAMES)).astype(np.float16).astype(np.float32)
    np.save(tmp_path / "f.npy", features)
    result = _generate_cli(str(tmp_path / "out"), "--features", str(tmp_path / "f.npy"), "--max-new-tokens", "8")
    assert result.exit_code == 0, result.output
    assert result.stdout.split() == [str(t) for t in whisper_generate(hf_seq2seq(ckpt), features[None], 8)[0]]


@pytest.mark.slow
def test_int4_rtn_equals_pytorch_on_the_same_int4_weights(tmp_path: Path) -> None:
    """--int4 --int4-method rtn: the encoder's and the decoder's MatMul weights int4 (the convolutions
    and the head, ``proj_out``, float); parity against PyTorch on the quantizer's numbers passes for
    every graph, the encoder's included; kiln's greedy tokens through its ORT runner equal
    transformers' generate() on the checkpoint's own weights rounded to int4 here (``rtn_linears``)."""
    ckpt = _save(tmp_path / "ckpt")
    rtn = Precision.of(Int4(method=Int4Method.RTN))
    result = export(ckpt, tmp_path / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8, precision=rtn))
    quantized = result.parity.quantized
    assert result.parity.passed and quantized is not None and quantized.passed, result.parity.failures()
    assert {c.graph for c in quantized.tensors} == {"prefill", "decode", "model", "encoder"}
    onnx_dir = tmp_path / "out" / "onnx"
    graphs = {k: onnx_dir / f"{k.value}.onnx" for k in (GraphKind.ENCODER, GraphKind.PREFILL, GraphKind.DECODE)}
    prefill = onnx.load(graphs[GraphKind.PREFILL], load_external_data=False).graph
    (head,) = [n for n in prefill.node if n.name == "/model.proj_out/MatMul"]
    assert head.input[1] in {t.name for t in prefill.initializer}  # the head reads its float table
    hf = hf_seq2seq(ckpt)
    features = np.random.default_rng(5).standard_normal((1, MELS, FRAMES)).astype(np.float32)
    with torch.no_grad():
        floats = hf.model.encoder(torch.from_numpy(features)).last_hidden_state.numpy()
        assert len(rtn_linears(hf)) == 32  # 12 encoder, 20 decoder (the cross-attention's too); not proj_out
        want = hf.model.encoder(torch.from_numpy(features)).last_hidden_state.numpy()
    with OrtRunner(graphs) as runner:
        got = runner.run(GraphKind.ENCODER, {"input_features": features})["encoder_hidden_states"]
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.abs(got - floats).max() > 1e-2  # the encoder graph computes in int4
    spec = load_model(ckpt).spec
    for lengths in ([5], [5, 3]):
        prompts = make_prompts(spec, lengths, seed=len(lengths))
        with OrtRunner(graphs) as runner:
            tokens, _ = greedy(runner, spec, prompts, STEPS)
        assert len(set(tokens.ravel().tolist())) > 2, tokens  # the tokens vary: a comparison that can fail
        np.testing.assert_array_equal(
            tokens, whisper_generate(hf, stand_in_features(spec, prompts), STEPS), err_msg=f"batch {len(lengths)}"
        )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ExportOptions.from_flags(precision=Precision.of(Int4()), calib_data="synthetic"),
            "--int4-method gptq is not supported for encoder-decoders yet",
        ),
    ],
)
def test_what_is_not_done_yet_is_refused(options: ExportOptions, message: str, whisper: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        export(whisper / "ckpt", tmp_path / "out", options)
    assert not (tmp_path / "out").exists()
