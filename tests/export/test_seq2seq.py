"""Hugging Face encoder-decoders (``plugins.hf.seq2seq``): BART, mBART, Marian and T5, each a tiny
random model (2 encoder and 2 decoder layers, hidden 64) saved by transformers and exported as
the encoder graph plus the decoder's prefill/decode/unified graphs. kiln's greedy tokens through
ONNX Runtime (its own encoder graph, then prefill + decode) must equal transformers' own
``generate()`` for batch 1 and a padded batch of encoder inputs; ``kiln export`` checks the same
against the PyTorch model (tensors and tokens), and ``kiln check``, ``kiln generate`` and
``kiln bench`` run the export."""

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
from kiln.errors import CheckpointError, ConfigError
from kiln.exporter.check import check_dir
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.contract.steps import right_pad
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.parity import greedy, make_prompts
from kiln.exporter.pipeline import export
from kiln.exporter.precision.kinds import Fp16, Int4, Int8
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln.exporter.runners import OrtRunner
from kiln.plugins import load_model
from kiln.plugins.hf import SUPPORTED, tiny_model
from kiln.plugins.hf.seq2seq import SEQ2SEQ, SEQ2SEQ_TINY
from kiln.plugins.hf.speech import SPEECH_TINY
from kiln_testing import rtn_linears, seq2seq_generate

STEPS = 16
CONTEXT = {"t5": 64, "t5-gated": 64}  # T5's relative positions have no limit of their own: --max-context


def _save(case: str, directory: Path, **overrides: Any) -> Path:
    tiny_model(case, seed=1, **overrides).module.model.save_pretrained(directory, safe_serialization=True)
    return directory


def test_every_encoder_decoder_has_a_tiny_model_and_is_listed() -> None:
    # Whisper's tiny model reads log-mel features: plugins.hf.speech's, proved in test_whisper.py
    assert {arch for arch, _ in {**SEQ2SEQ_TINY, **SPEECH_TINY}.values()} == set(SEQ2SEQ)
    assert set(SEQ2SEQ_TINY) >= {"bart", "mbart", "marian", "t5", "t5-gated"}
    assert set(SEQ2SEQ) <= set(SUPPORTED)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SEQ2SEQ_TINY))
def test_generation_equals_transformers_generate(case: str, tmp_path: Path) -> None:
    ckpt = _save(case, tmp_path / "ckpt")
    result = export(
        ckpt, tmp_path / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8, max_context=CONTEXT.get(case))
    )
    assert result.parity.passed, result.parity.failures()
    assert {c.graph for c in result.parity.tensors} == {"prefill", "decode", "model", "encoder"}
    manifest = result.manifest
    assert manifest.model.has_encoder and manifest.model.encoder_dim == 64
    assert manifest.model.decoder_start_token_id == transformers.AutoConfig.from_pretrained(ckpt).decoder_start_token_id
    assert manifest.graph(GraphKind.ENCODER).file == "onnx/encoder.onnx"
    spec = load_model(ckpt).spec
    onnx_dir = tmp_path / "out" / "onnx"
    graphs = {k: onnx_dir / f"{k.value}.onnx" for k in (GraphKind.ENCODER, GraphKind.PREFILL, GraphKind.DECODE)}
    hf = (
        getattr(transformers, SEQ2SEQ_TINY[case][0])
        .from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager")
        .eval()
    )
    alone = {}
    for lengths in ([9], [9, 5, 3]):  # batch 1, and a (right-)padded batch of encoder inputs
        prompts = make_prompts(spec, lengths, seed=len(lengths))
        ids, mask = right_pad(prompts, 0)
        want = seq2seq_generate(hf, ids, mask, STEPS)
        with OrtRunner(graphs) as runner:
            got, _ = greedy(runner, spec, prompts, STEPS)
            alone = {i: greedy(runner, spec, [p], STEPS)[0][0] for i, p in enumerate(prompts)}
        np.testing.assert_array_equal(got, want, err_msg=f"{case} {lengths}")
        for row, tokens in alone.items():  # padding changes nothing: each row generates what it does alone
            np.testing.assert_array_equal(got[row], tokens, err_msg=f"{case} {lengths} row {row}")


@pytest.fixture(scope="module")
def bart_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bart")
    result = export(_save("bart", root / "ckpt"), root / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8))
    assert result.parity.passed, result.parity.failures()
    return root / "out"


def test_encoder_and_decoder_io(bart_export: Path) -> None:
    def session(kind: str) -> ort.InferenceSession:
        return ort.InferenceSession(str(bart_export / "onnx" / f"{kind}.onnx"), providers=["CPUExecutionProvider"])

    encoder, prefill, decode = session("encoder"), session("prefill"), session("decode")
    assert [(i.name, i.shape) for i in encoder.get_inputs()] == [
        ("input_ids", ["batch", "encoder_seq"]),
        ("attention_mask", ["batch", "encoder_seq"]),
    ]
    assert [(o.name, o.shape) for o in encoder.get_outputs()] == [
        ("encoder_hidden_states", ["batch", "encoder_seq", 64])
    ]
    assert [i.name for i in prefill.get_inputs()] == [
        "input_ids",
        "attention_mask",
        "position_ids",
        "encoder_attention_mask",
        "encoder_hidden_states",
    ]
    assert [o.name for o in prefill.get_outputs()][1:5] == [
        "present.0.key",
        "present.0.value",
        "present.0.cross_key",
        "present.0.cross_value",
    ]
    names = [i.name for i in decode.get_inputs()]
    assert names[3:8] == [
        "encoder_attention_mask",
        "past_key_values.0.key",
        "past_key_values.0.value",
        "past_key_values.0.cross_key",
        "past_key_values.0.cross_value",
    ]
    assert not any("cross" in o.name for o in decode.get_outputs())  # the cross cache never grows
    manifest = json.loads((bart_export / "manifest.json").read_text())
    assert set(manifest["graphs"]) == {"prefill", "decode", "model", "encoder"}
    module = load_model(bart_export.parent / "ckpt").module
    stored = {t.data_ptr(): t.numel() * 4 for t in (*module.parameters(), *module.buffers())}  # tied tensors once
    assert manifest["weights"]["bytes"] <= sum(
        stored.values()
    )  # every weight once: the encoder gathers the head's table too
    graphs = {
        k: onnx.load(bart_export / "onnx" / f"{k}.onnx", load_external_data=False).graph for k in ("encoder", "decode")
    }
    (lookup,) = [n for n in graphs["encoder"].node if n.op_type == "Gather" and "embed_tokens" in n.name]
    head = [n for n in graphs["decode"].node if n.op_type == "MatMul" and "lm_head" in n.name][0]
    assert [a.i for a in lookup.attribute if a.name == "axis"] == [1]  # the columns of the head's [d, V] table
    assert lookup.input[0] == head.input[1]  # the one tensor, under its one name: no [V, d] copy
    assert not (bart_export / "onnx" / "genai_config.json").exists()


def test_the_manifest_schema_ties_the_encoder_graph_to_has_encoder(bart_export: Path) -> None:
    validator = _validator()
    manifest = json.loads((bart_export / "manifest.json").read_text())
    assert not list(validator.iter_errors(manifest))
    no_graph = copy.deepcopy(manifest)
    del no_graph["graphs"]["encoder"]
    assert any("'encoder' is a required property" in e.message for e in validator.iter_errors(no_graph))
    no_flag = copy.deepcopy(manifest)
    no_flag["model"]["has_encoder"] = False
    assert list(validator.iter_errors(no_flag))  # an encoder graph the model says it has not


def test_the_encoder_mask_masks_the_padding(bart_export: Path) -> None:
    """A padded encoder position changes nothing when masked, and changes the logits when not."""
    sessions = {
        k: ort.InferenceSession(str(bart_export / "onnx" / f"{k}.onnx"), providers=["CPUExecutionProvider"])
        for k in ("encoder", "prefill")
    }

    def logits(ids: list[int], mask: list[int]) -> np.ndarray:
        i, m = np.array([ids], dtype=np.int64), np.array([mask], dtype=np.int64)
        (states,) = sessions["encoder"].run(["encoder_hidden_states"], {"input_ids": i, "attention_mask": m})
        start = np.array([[2]], dtype=np.int64)
        feeds = {
            "input_ids": start,
            "attention_mask": np.ones_like(start),
            "position_ids": np.zeros_like(start),
            "encoder_attention_mask": m,
            "encoder_hidden_states": states,
        }
        return np.asarray(sessions["prefill"].run(["logits"], feeds)[0])

    real = logits([5, 6, 7, 8], [1, 1, 1, 1])
    np.testing.assert_allclose(logits([5, 6, 7, 8, 0, 0], [1, 1, 1, 1, 0, 0]), real, atol=1e-5)
    assert np.abs(logits([5, 6, 7, 8, 0, 0], [1, 1, 1, 1, 1, 1]) - real).max() > 1e-2


def test_check_generate_and_bench_run_it(bart_export: Path) -> None:
    assert check_dir(bart_export).passed
    runner = CliRunner()
    result = runner.invoke(
        main, ["generate", str(bart_export), "--ids", "5,6,7,8,9", "--max-new-tokens", "6", "--json"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{") :])
    assert summary["prompt_ids"] == [5, 6, 7, 8, 9] and len(summary["tokens"]) == 6
    hf = transformers.BartForConditionalGeneration.from_pretrained(
        bart_export.parent / "ckpt", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = np.array([[5, 6, 7, 8, 9]], dtype=np.int64)
    assert summary["tokens"] == seq2seq_generate(hf, ids, np.ones_like(ids), 6)[0].tolist()
    result = runner.invoke(
        main, ["bench", str(bart_export), "--prefill-seq", "8", "--past", "8", "--runs", "3", "--no-roofline", "--json"]
    )
    assert result.exit_code == 0, result.output
    timed = json.loads(result.output)["median_ms"]
    assert set(timed["decode"]) == {"pytorch eager", "kiln fp32 (out)"} and all(v > 0 for v in timed["decode"].values())


def test_too_long_an_input_is_refused(bart_export: Path) -> None:
    result = CliRunner().invoke(
        main, ["generate", str(bart_export), "--ids", ",".join(["5"] * 65), "--max-new-tokens", "4"]
    )
    assert result.exit_code != 0
    assert "the encoder's input (65 tokens) or the 4 new tokens exceed the export's context limit 64" in result.output


# a moderate init for fp16: at the fp32 cases' larger init (chosen so that the tiny models generate
# more than one token; logits in the tens to hundreds) fp16's own rounding flips greedy tokens
# (T5 at initializer_factor 8: a first divergence at step 6), which its parity rightly refuses
FP16_INIT = {
    "bart": {"init_std": 0.1},
    "mbart": {"init_std": 0.1},
    "marian": {"init_std": 0.1},
    "t5": {"initializer_factor": 1.0},
    "t5-gated": {"initializer_factor": 1.0},
}


def test_every_case_has_an_fp16_init() -> None:
    assert set(FP16_INIT) == set(SEQ2SEQ_TINY)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SEQ2SEQ_TINY))
def test_fp16(case: str, tmp_path: Path) -> None:
    """fp16 graphs of every architecture pass their own parity (what the table's "fp16" says)."""
    ckpt = _save(case, tmp_path / "ckpt", **FP16_INIT[case])
    result = export(
        ckpt,
        tmp_path / "out",
        ExportOptions.from_flags(max_batch=4, parity_tokens=8, precision=Precision.FP16, max_context=CONTEXT.get(case)),
    )
    assert result.parity.passed, result.parity.failures()
    assert result.manifest.precision == "fp16"
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert not [e.message for e in _validator().iter_errors(manifest)]


def _validator() -> Draft202012Validator:
    return Draft202012Validator(
        json.loads(resources.files("kiln.exporter.artifacts").joinpath("manifest.schema.json").read_text())
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ExportOptions.from_flags(precision=Precision.of(Int4()), calib_data="synthetic"),
            "--int4-method gptq is not supported for encoder-decoders yet: its calibration runs decoder-only prompts",
        ),
        (
            ExportOptions.from_flags(precision=Precision.of(Int8()), calib_data="synthetic"),
            "int8 exports are not supported for encoder-decoders yet: .* or --int4 --int4-method rtn",
        ),
        (
            ExportOptions(precision=Precision.of(Fp16(auto_keep_fp32=True))),
            "--auto-keep-fp32 is not supported for encoder-decoders yet",
        ),
    ],
)
def test_what_is_not_done_yet_is_refused(
    options: ExportOptions, message: str, bart_export: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=message):
        export(bart_export.parent / "ckpt", tmp_path / "out", options)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_int4_rtn_equals_pytorch_on_the_same_int4_weights(tmp_path: Path) -> None:
    """--int4 --int4-method rtn: the encoder's and the decoder's MatMul weights int4 (the head float);
    parity against PyTorch on the quantizer's numbers passes for every graph, the encoder's
    included; kiln's greedy tokens through its ORT runner equal transformers' generate() on the
    checkpoint's own weights rounded to int4 here (``rtn_linears``), batch 1 and a padded batch."""
    ckpt = _save("bart", tmp_path / "ckpt")
    rtn = Precision.of(Int4(method=Int4Method.RTN))
    result = export(ckpt, tmp_path / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8, precision=rtn))
    quantized = result.parity.quantized
    assert result.parity.passed and quantized is not None and quantized.passed, result.parity.failures()
    assert {c.graph for c in quantized.tensors} == {"prefill", "decode", "model", "encoder"}
    onnx_dir = tmp_path / "out" / "onnx"
    graphs = {k: onnx_dir / f"{k.value}.onnx" for k in (GraphKind.ENCODER, GraphKind.PREFILL, GraphKind.DECODE)}
    encoder = onnx.load(graphs[GraphKind.ENCODER], load_external_data=False).graph
    assert sum(n.op_type == "DequantizeLinear" for n in encoder.node) == 12  # q/k/v/out, fc1/fc2 x 2 layers
    hf = transformers.BartForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager"
    )
    ids = np.array([[5, 6, 7, 8, 9]], dtype=np.int64)
    with torch.no_grad():
        floats = hf.eval().get_encoder()(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
        assert len(rtn_linears(hf)) == 32  # 12 encoder, 20 decoder (the cross-attention's too)
        want = hf.get_encoder()(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
    with OrtRunner(graphs) as runner:
        got = runner.run(GraphKind.ENCODER, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    np.testing.assert_allclose(got["encoder_hidden_states"], want, atol=1e-4)
    assert np.abs(got["encoder_hidden_states"] - floats).max() > 1e-2  # the encoder graph computes in int4
    spec = load_model(ckpt).spec
    for lengths in ([9], [9, 5]):
        prompts = make_prompts(spec, lengths, seed=len(lengths))
        with OrtRunner(graphs) as runner:
            tokens, _ = greedy(runner, spec, prompts, STEPS)
        assert len(set(tokens.ravel().tolist())) > 2, tokens  # the tokens vary: a comparison that can fail
        np.testing.assert_array_equal(tokens, seq2seq_generate(hf, *right_pad(prompts, 0), STEPS), err_msg=f"{lengths}")


def test_engines_are_refused_by_name(bart_export: Path) -> None:
    result = CliRunner().invoke(main, ["build", str(bart_export)])
    assert result.exit_code != 0
    assert "TensorRT engines for encoder-decoders are not built yet" in result.output


def test_config_refusals(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"quantization_config \(gptq\) is not supported"):
        tiny_model("bart", seed=0, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(CheckpointError, match="share_encoder_decoder_embeddings=False is not supported"):
        tiny_model("marian", seed=0, share_encoder_decoder_embeddings=False)
    with pytest.raises(CheckpointError, match="no decoder_start_token_id"):
        tiny_model("t5", seed=0, decoder_start_token_id=None, bos_token_id=None)
