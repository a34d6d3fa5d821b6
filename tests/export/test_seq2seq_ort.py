"""``--target ort`` for encoder-decoders (issue 41): the ORT target's rewrites applied where they are
exact. The decoder's causal self-attention becomes GroupQueryAttention where the recogniser matches
(Whisper, BART: no rotary, learned positions as they are), every cross-attention stays portable
attention and so does the encoder's bidirectional self-attention, each reported by name in the
manifest; T5's self-attention (a relative position bias added beside the mask) stays portable too,
named. The encoder graph gets the same weight treatment (packed projections, MatMulNBits with
``--int4``). Proved on the tiny random Whisper, BART and T5: kiln's parity passes for every graph
(the encoder's included) and ``kiln generate --target ort``'s greedy tokens equal transformers'
``generate()`` (Whisper: on ``--features FILE.npy``), and kiln's ORT runner on the ``.ort`` graphs
gives them for a padded batch too."""

from __future__ import annotations

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
from click.testing import CliRunner

from kiln.cli import main
from kiln.errors import ConfigError
from kiln.exporter.check import check_dir
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.contract.steps import right_pad
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.parity import greedy, make_prompts
from kiln.exporter.parity.generation import judge, stand_in_features
from kiln.exporter.pipeline import export
from kiln.exporter.precision.kinds.int4 import Int4, Int4Method
from kiln.exporter.runners import OrtRunner
from kiln.exporter.targets.ort.gqa import CROSS_ATTENTION, ENCODER_ATTENTION
from kiln.plugins import load_model
from kiln.plugins.hf.speech import FRAMES, MELS
from kiln_testing import (
    hf_seq2seq,
    rtn_linears,
    save_base,
    seq2seq_generate,
    tiny_config,
    whisper_generate,
    write_checkpoint,
)

STEPS = 12
KINDS = (GraphKind.ENCODER, GraphKind.PREFILL, GraphKind.DECODE)
TWO_BIASES = "its scores take two additive biases (a relative position bias, then the mask)"
RTN = Precision.of(Int4(method=Int4Method.RTN))


def _export(case: str, root: Path, precision: Precision = Precision.FP32, **options: Any) -> Path:
    ckpt = save_base(case, root / "ckpt")
    result = export(
        ckpt,
        root / "out",
        ExportOptions.from_flags(max_batch=4, parity_tokens=8, target="ort", precision=precision, **options),
    )
    assert result.parity.passed, result.parity.failures()
    checked = {c.graph for c in result.parity.tensors}
    assert checked >= {"encoder.ort", "prefill.ort", "decode.ort", "model.ort"}, checked
    if precision.weight_only:
        quantized = result.parity.quantized
        assert quantized is not None and quantized.passed, result.parity.failures()
    assert check_dir(root / "out").passed
    return root


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export("whisper", tmp_path_factory.mktemp("whisper_ort"))


@pytest.fixture(scope="module")
def bart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export("bart", tmp_path_factory.mktemp("bart_ort"))


def _ort_graphs(root: Path) -> dict[GraphKind, Path]:
    return {kind: root / "out" / "onnx" / f"{kind.value}.ort.onnx" for kind in KINDS}


def _count(path: Path, op: str) -> int:
    return sum(n.op_type == op for n in onnx.load(path, load_external_data=False).graph.node)


def _assert_fusions(root: Path, fused: list[int], self_attention: str | None = None) -> dict[str, Any]:
    """The ORT target's report of each graph: ``fused`` layers' self-attention is GroupQueryAttention
    in prefill and decode (a silent fall back to portable attention fails here); every cross-attention
    and the encoder's attention are reported left portable, by name, as is every unfused self-attention
    (``self_attention``: its reason)."""
    manifest = json.loads((root / "out" / "manifest.json").read_text())
    validator = Draft202012Validator(
        json.loads(resources.files("kiln.exporter.artifacts").joinpath("manifest.schema.json").read_text())
    )
    assert not [e.message for e in validator.iter_errors(manifest)]
    entry = manifest["targets"]["ort"]
    assert set(entry["graphs"]) == {"encoder", "prefill", "decode", "model"}
    assert entry["kv_cache"] == "grown"  # the cross cache is no shared buffer (graphs._cache_update)
    n_layers = manifest["model"]["n_layers"]
    for kind in ("prefill", "decode"):
        passes = entry["graphs"][kind]["passes"]
        assert passes["attention"]["layers"] == fused, (kind, passes)
        reasons = passes["not_fused"]["attention"]
        assert sum(CROSS_ATTENTION in r for r in reasons) == n_layers, reasons
        unfused = [r for r in reasons if CROSS_ATTENTION not in r]
        assert len(unfused) == n_layers - len(fused), reasons
        assert all(self_attention is not None and self_attention in r for r in unfused), reasons
        assert _count(_ort_graphs(root)[GraphKind(kind)], "GroupQueryAttention") == len(fused)
    encoder = entry["graphs"]["encoder"]["passes"]
    assert encoder["attention"]["layers"] == []
    reasons = encoder["not_fused"]["attention"]
    assert len(reasons) == n_layers and all(ENCODER_ATTENTION in r for r in reasons), reasons  # as deep as the decoder
    return entry


def _generate_cli(*args: str) -> list[int]:
    result = CliRunner().invoke(main, ["generate", *args, "--ignore-eos", "--json"])
    assert result.exit_code == 0, result.output
    tokens: list[int] = json.loads(result.stdout)["tokens"]
    return tokens


def _kiln_whisper(root: Path, tmp_path: Path, hf: Any) -> None:
    """``kiln generate --target ort --features`` == transformers' generate() on the same features."""
    features = np.random.default_rng(5).standard_normal((MELS, FRAMES)).astype(np.float32)
    np.save(tmp_path / "f.npy", features)
    want = whisper_generate(hf, features[None], STEPS)[0].tolist()
    assert len(set(want)) > 3, want  # the tiny model's tokens vary: a comparison that can fail
    got = _generate_cli(
        str(root / "out"), "--target", "ort", "--features", str(tmp_path / "f.npy"), "--max-new-tokens", str(STEPS)
    )
    assert got == want


def test_whisper_decoder_self_attention_fuses_and_the_rest_is_named(whisper: Path) -> None:
    _assert_fusions(whisper, [0, 1])
    assert _count(_ort_graphs(whisper)[GraphKind.ENCODER], "GroupQueryAttention") == 0


def test_whisper_ort_graphs_generate_transformers_tokens(whisper: Path, tmp_path: Path) -> None:
    hf = hf_seq2seq(whisper / "ckpt")
    _kiln_whisper(whisper, tmp_path, hf)
    spec = load_model(whisper / "ckpt").spec
    prompts = make_prompts(spec, [5, 3], seed=2)  # batch 2: each prompt stands for its own random features
    with OrtRunner(_ort_graphs(whisper)) as runner:
        got, _ = greedy(runner, spec, prompts, STEPS)
    np.testing.assert_array_equal(got, whisper_generate(hf, stand_in_features(spec, prompts), STEPS))


def test_bart_decoder_self_attention_fuses_and_the_rest_is_named(bart: Path) -> None:
    _assert_fusions(bart, [0, 1])


def _assert_text_generation(root: Path, hf: Any) -> None:
    """``kiln generate --target ort --ids`` and kiln's ORT runner on the ``.ort`` graphs (a right-padded
    batch of encoder inputs) give transformers' generate() tokens."""
    spec = load_model(root / "ckpt").spec
    prompts = make_prompts(spec, [9, 5, 3], seed=3)
    want = seq2seq_generate(hf, *right_pad(prompts, 0), STEPS)
    assert len(set(want.ravel().tolist())) > 3, want  # the tiny model's tokens vary: a comparison that can fail
    with OrtRunner(_ort_graphs(root)) as runner:
        got, _ = greedy(runner, spec, prompts, STEPS)
    np.testing.assert_array_equal(got, want)
    ids = ",".join(str(int(t)) for t in prompts[0])  # the longest row: unpadded, its tokens are want[0]
    cli = _generate_cli(str(root / "out"), "--target", "ort", "--ids", ids, "--max-new-tokens", str(STEPS))
    assert cli == want[0].tolist()


def test_bart_ort_graphs_generate_transformers_tokens(bart: Path) -> None:
    _assert_text_generation(bart, hf_seq2seq(bart / "ckpt"))


def test_ort_int8_is_refused_for_encoder_decoders(bart: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--ort-int8 is not supported for cross-attention decoders yet: parity"):
        export(bart / "ckpt", tmp_path / "out", ExportOptions(target="ort", target_flags={"ort_int8": True}))
    assert not (tmp_path / "out").exists()


def test_a_native_cross_attention_decoder_fuses_its_self_attention(tmp_path: Path) -> None:
    """The native decoder with cross-attention (no encoder graph; prefill takes encoder_hidden_states):
    its self-attention fuses in prefill and decode, its cross-attention (behind repeat_kv) is named."""
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config(cross_attention=True), seed=3)
    result = export(ckpt, tmp_path / "out", ExportOptions.from_flags(max_batch=4, target="ort"))
    assert result.parity.passed, result.parity.failures()
    entry = json.loads((tmp_path / "out" / "manifest.json").read_text())["targets"]["ort"]
    assert set(entry["graphs"]) == {"prefill", "decode", "model"} and entry["kv_cache"] == "grown"
    for kind in ("prefill", "decode"):
        passes = entry["graphs"][kind]["passes"]
        assert passes["attention"]["layers"] == [0, 1], passes
        assert passes["not_fused"]["attention"] == [f"layer {i}: {CROSS_ATTENTION}" for i in (0, 1)]


@pytest.mark.slow
def test_t5_self_attention_stays_portable_by_name(tmp_path: Path) -> None:
    """T5 adds its relative position bias to the scores beside the mask: no layer fuses, each says why,
    and the ORT graphs (norms fused, projections packed) still generate transformers' tokens."""
    root = _export("t5", tmp_path, max_context=64)
    entry = _assert_fusions(root, [], TWO_BIASES)
    assert entry["graphs"]["decode"]["passes"]["rms_norm"]["fused"] > 0
    _assert_text_generation(root, hf_seq2seq(root / "ckpt"))


def _int4_ops(root: Path) -> dict[GraphKind, int]:
    graphs = _ort_graphs(root)
    return {kind: _count(graphs[kind], "MatMulNBits") for kind in KINDS}


def _assert_int4_tokens(root: Path, prompts: list[Any], want: np.ndarray, cli: list[str]) -> None:
    """``want``: transformers' generate() on the checkpoint's weights rounded to int4 here
    (``rtn_linears``). The portable graphs (DequantizeLinear, in float) give exactly those tokens;
    the ``.ort`` graphs' MatMulNBits run at ``accuracy_level`` 4 (int8 activations), so each of their
    tokens must be the portable graphs' argmax at its prefix or a tie within int8's tolerance
    (parity's ``judge``), and ``kiln generate --target ort`` (``cli``: the first prompt) prints what
    kiln's runner gives on those graphs."""
    spec = load_model(root / "ckpt").spec
    assert len(set(want.ravel().tolist())) > 2, want  # the tokens vary: a comparison that can fail
    portable = {kind: root / "out" / "onnx" / f"{kind.value}.onnx" for kind in KINDS}
    with OrtRunner(portable) as runner:
        np.testing.assert_array_equal(greedy(runner, spec, prompts, STEPS)[0], want)
    with OrtRunner(_ort_graphs(root)) as runner:
        tokens, logits = greedy(runner, spec, prompts, STEPS)
        alone = greedy(runner, spec, prompts[:1], STEPS)[0][0]
    with OrtRunner(portable) as runner:
        _, reference = greedy(runner, spec, prompts, STEPS, forced=tokens)
    judged = judge(prompts, reference, logits, Precision.INT8.tolerance, unified=False, length=None)
    assert judged.first_divergence is None, judged
    assert _generate_cli(str(root / "out"), "--target", "ort", *cli, "--max-new-tokens", str(STEPS)) == alone.tolist()


@pytest.mark.slow
def test_whisper_int4_rtn(tmp_path: Path) -> None:
    """--target ort --int4 --int4-method rtn: MatMulNBits in the encoder and the decoder, the decoder's
    self-attention still fused; its tokens as ``_assert_int4_tokens`` says."""
    root = _export("whisper", tmp_path, RTN)
    _assert_fusions(root, [0, 1])
    assert all(n > 0 for n in _int4_ops(root).values()), _int4_ops(root)
    hf = hf_seq2seq(root / "ckpt")
    assert len(rtn_linears(hf)) == 32  # 12 encoder, 20 decoder; not proj_out
    spec = load_model(root / "ckpt").spec
    prompts = make_prompts(spec, [5, 3], seed=2)  # each prompt stands for its own random features
    np.save(tmp_path / "f.npy", stand_in_features(spec, prompts[:1])[0])
    want = whisper_generate(hf, stand_in_features(spec, prompts), STEPS)
    _assert_int4_tokens(root, prompts, want, ["--features", str(tmp_path / "f.npy")])


@pytest.mark.slow
def test_bart_int4_rtn(tmp_path: Path) -> None:
    root = _export("bart", tmp_path, RTN)
    _assert_fusions(root, [0, 1])
    assert all(n > 0 for n in _int4_ops(root).values()), _int4_ops(root)
    hf = hf_seq2seq(root / "ckpt")
    assert len(rtn_linears(hf)) == 32  # 12 encoder, 20 decoder (the cross-attention's too); not the tied head
    prompts = make_prompts(load_model(root / "ckpt").spec, [9, 5, 3], seed=3)
    want = seq2seq_generate(hf, *right_pad(prompts, 0), STEPS)
    _assert_int4_tokens(root, prompts, want, ["--ids", ",".join(str(int(t)) for t in prompts[0])])
