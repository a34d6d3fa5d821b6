"""Multimodal checkpoints (Gemma 3 and Mistral 3 ``*ForConditionalGeneration``) exported as their
text decoder (``plugins/hf/multimodal.py``), beyond what tests/export/test_hf_archs.py proves of
every architecture (fp32 on the portable and --target ort graphs, batch 1 and left-padded 2, kiln
check, fp16 parity): --fp16 (--target ort takes fp32 graphs only), --target onnx at fp32 and fp16,
each one's greedy tokens (``kiln generate``'s loop) against the wrapper's own text-only
``generate()``, --target ort --ort-int8 (weight-only int8) passing kiln's parity and check, and
--target ort --int4 against PyTorch on its int4 weights (the tiny wrapper saved whole, vision tower
and all, given input_ids only); the manifest and the export's output saying the vision tower is not
exported; and the refusals."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])"
)

import torch
from jsonschema import Draft202012Validator

from kiln.errors import CheckpointError
from kiln.exporter.artifacts.manifest import TextDecoderInfo, read
from kiln.exporter.check import check_dir
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import ExportResult, export
from kiln.exporter.progress import LineProgress
from kiln.plugins import load_model
from kiln.plugins.hf import tiny_model
from kiln.plugins.hf.build import tiny_transformers
from kiln.plugins.hf.tiny import TINY
from kiln.runtime.generate import Generator
from kiln_testing import assert_int4_generation

CASES = {
    "gemma3-multimodal-window": "Gemma3ForCausalLM",
    "mistral3-multimodal-window": "MistralForCausalLM",
}  # case -> its text decoder's class
# every wrapper whose text decoder kiln exports: also Llama 4's (its generation is proved in test_hf_archs.py;
# --target onnx refuses its chunked layers, so it is not in CASES)
TEXT_DECODERS = {**CASES, "llama4-multimodal-chunked": "Llama4ForCausalLM"}
LEFT_OUT = ("model.multi_modal_projector", "model.vision_tower")
PROMPT = [5, 17, 3, 29, 11]
STEPS = 16
SCHEMA = json.loads((Path(__file__).parents[2] / "exporter" / "artifacts" / "manifest.schema.json").read_text())


def _export(case: str, tmp_path: Path, **options: object) -> tuple[torch.nn.Module, Path, ExportResult, str]:
    """The tiny wrapper saved by transformers, exported; the wrapper as transformers loads it back,
    and the export's notes."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    tiny_transformers(case, seed=1).save_pretrained(ckpt, safe_serialization=True)
    notes = io.StringIO()
    result = export(
        ckpt, out, ExportOptions.from_flags(max_batch=4, parity_tokens=8, **options), LineProgress(notes, stages=False)
    )  # type: ignore[arg-type]
    wrapper = (
        getattr(transformers, TINY[case][0])
        .from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager")
        .eval()
    )
    return wrapper, out, result, notes.getvalue()


def _wrapper_tokens(wrapper: torch.nn.Module, n: int = STEPS) -> list[int]:
    """The wrapper's own greedy generate() on input_ids alone (no pixel_values), its own cache."""
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        out = wrapper.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )  # type: ignore[operator]
    return [int(t) for t in out[0, len(PROMPT) :]]


def _tokens(out: Path, target: str | None = None) -> list[int]:
    return [int(t) for t in Generator(out, target=target).run(PROMPT, STEPS, stop_at_eos=False).tokens]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_fp16_says_what_it_left_out_and_equals_the_wrappers_generate(case: str, tmp_path: Path) -> None:
    wrapper, out, result, notes = _export(case, tmp_path, precision=Precision.FP16)
    assert result.parity.passed, result.parity.failures()
    arch = TINY[case][0]
    line = (
        f"{arch} is multimodal: exporting its text decoder (model.language_model) only; not exported: "
        f"{', '.join(LEFT_OUT)} (the graphs take token ids, no images)"
    )
    assert notes.splitlines().count(line) == 1, notes
    assert (
        result.manifest.model.text_decoder_of
        == read(out).model.text_decoder_of
        == TextDecoderInfo(arch, "model.language_model", LEFT_OUT)
    )
    assert result.manifest.config["architecture"] == CASES[case]
    data = json.loads((out / "manifest.json").read_text())
    assert not [e.message for e in Draft202012Validator(SCHEMA).iter_errors(data)]
    assert data["model"]["text_decoder_of"] == {
        "architecture": arch,
        "prefix": "model.language_model",
        "not_exported": list(LEFT_OUT),
    }
    assert not (
        out / "onnx" / "config.json"
    ).exists()  # the wrapper's config.json is no text decoder's (Optimum would load the wrapper)
    names = {t.name for t in onnx.load(out / "onnx" / "decode.onnx", load_external_data=False).graph.initializer}
    assert names and not [n for n in names if "vision" in n or "multi_modal" in n], sorted(names)[:5]
    assert _tokens(out) == _wrapper_tokens(wrapper.half())


@pytest.mark.slow
@pytest.mark.parametrize("precision", [Precision.FP32, Precision.FP16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_target_onnx_equals_the_wrappers_generate(case: str, precision: Precision, tmp_path: Path) -> None:
    wrapper, out, result, _ = _export(case, tmp_path, precision=precision, target="onnx")
    assert result.parity.passed and result.parity.targets["onnx"].passed, result.parity.failures()
    want = _wrapper_tokens(wrapper if precision is Precision.FP32 else wrapper.half())
    assert _tokens(out, "onnx") == _tokens(out) == want


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_ort_int8_passes_parity_and_check(case: str, tmp_path: Path) -> None:
    """--target ort --ort-int8: kiln's own parity passes for the weight-only int8 graphs, and kiln
    check passes on the export; they generate on ONNX Runtime."""
    _, out, result, _ = _export(case, tmp_path, target="ort", target_flags={"ort_int8": True})
    assert result.parity.passed, result.parity.failures()
    assert (
        result.manifest.targets is not None
        and (result.manifest.targets["ort"].record or {}).get("int8", {}).get("bits") == 8
    ), result.manifest.targets
    assert result.manifest.model.text_decoder_of is not None
    assert check_dir(out).passed
    assert len(_tokens(out, "ort")) == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_int4_equals_the_quantized_text_decoder(case: str, tmp_path: Path) -> None:
    """--target ort --int4 (RTN) of the wrapper saved whole: its text decoder's graphs proved against
    PyTorch on the int4 weights they hold (``kiln_testing.assert_int4_generation``: an int4 model's
    tokens are not the float wrapper's generate()'s); the vision tower is left out as at fp32."""
    ckpt = tmp_path / "ckpt"
    tiny_transformers(case, seed=1).save_pretrained(ckpt, safe_serialization=True)
    result = assert_int4_generation(ckpt, tmp_path / "out", STEPS)
    assert result.manifest.model.text_decoder_of == TextDecoderInfo(TINY[case][0], "model.language_model", LEFT_OUT)


def test_the_text_decoder_is_the_wrappers_own_modules() -> None:
    """The exported module holds the wrapper's language model and head (same tensors, tied as the
    wrapper ties them), and its forward pass is the wrapper's on a left-padded batch."""
    for case, text in TEXT_DECODERS.items():
        loaded = tiny_model(case, seed=3)
        assert type(loaded.module.model).__name__ == text and loaded.spec.config["architecture"] == text
        wrapper = tiny_transformers(case, seed=3)  # the same seed: the same weights
        ids = torch.tensor([[0, 0, 7, 9, 4], [3, 8, 6, 2, 5]])
        mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            want = wrapper(input_ids=ids, attention_mask=mask, position_ids=positions).logits  # type: ignore[operator]
            got, _ = loaded.module(ids, mask, positions)
        np.testing.assert_allclose(got[mask.bool()].numpy(), want[mask.bool()].numpy(), atol=1e-5, err_msg=case)
        assert (
            loaded.module.model.lm_head.weight is loaded.module.model.model.embed_tokens.weight
        ) == wrapper.config.tie_word_embeddings, case


def test_refused_by_name() -> None:
    """What kiln does not export exactly is one line naming the wrapper and the field."""
    with pytest.raises(CheckpointError) as err:
        tiny_model("gemma3-multimodal-window", seed=0, final_logit_softcapping=30.0)
    assert str(err.value) == (
        "checkpoint: Gemma3ForConditionalGeneration: text_config.final_logit_softcapping=30.0 is not supported: "
        "Gemma3ForConditionalGeneration's head does not"
        " soft-cap the logits, Gemma3ForCausalLM's does, so its text decoder would not compute as the checkpoint does"
    )
    with pytest.raises(CheckpointError) as err:
        tiny_model("gemma3-multimodal-window", seed=0, use_bidirectional_attention=True)
    assert str(err.value) == (
        "checkpoint: Gemma3ForConditionalGeneration's text_config: Gemma3ForCausalLM: "
        "use_bidirectional_attention=True is not supported: non-causal attention is not a decoder"
    )


def test_a_text_decoder_no_test_proves_inside_the_wrapper_is_refused(tmp_path: Path) -> None:
    """A Mistral 3 checkpoint whose text_config is another model type: refused before any weight is read."""
    ckpt = tmp_path / "ckpt"
    tiny_transformers("mistral3-multimodal-window", seed=0).save_pretrained(ckpt, safe_serialization=True)
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(config))
    (ckpt / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert str(err.value) == (
        "checkpoint: Mistral3ForConditionalGeneration: text_config.model_type 'llama' (LlamaForCausalLM) is not "
        "supported: kiln exports this wrapper's text decoder as MistralForCausalLM"
    )


@pytest.mark.parametrize(
    "arch", ["Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration", "LlavaForConditionalGeneration"]
)
def test_other_multimodal_wrappers_stay_refused(arch: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "x"}))
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path)
    assert arch in str(err.value) and "\n" not in str(err.value)
