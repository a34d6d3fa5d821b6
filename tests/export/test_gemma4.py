"""Gemma 4's text decoder (issue 43 item 3: ``Gemma4ForCausalLM``, plugins/hf/tiny_gemma4.py) through
kiln's export pipeline: each layer's own KV heads and head dim (transformers' ``per_layer_config``: a
sliding layer's 2 of 16, a global layer's 1 of 32), values equal to the keys' projection on the global
layers, proportional rope, per-layer inputs and (``gemma4-shared-window``) the last layers reading an
earlier layer's cache with a double-wide MLP. The fp32 export passes kiln's parity; the graphs and the
manifest carry each layer's own shapes (``kv_cache.tensors``) and ``kiln verify`` names one that
disagrees; ``kiln generate`` and kiln's ORT runner (batch 1 and a left-padded batch, prefill + decode and
the unified graph) give transformers' greedy ``generate()`` tokens; the Triton repository carries each
layer's state of its own shape; GenAI and ``--target onnx`` refuse by name; the MoE block, a config
whose every layer reads another's cache (the assistant's) and the assistant class are refused by name.
``--target ort`` (fp32, both graph sets, batch 1 and a left-padded batch) and ``--fp16`` of both tiny
cases are ``test_hf_archs``'s; ``--fp16`` and ``--int4 --int4-method rtn`` of the shared case are this
file's slow test."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])"
)

from click.testing import CliRunner
from jsonschema import Draft202012Validator

from kiln.cli import main
from kiln.errors import ArtifactError, CheckpointError
from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.artifacts.structure import structure_problems
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.exporter.precision.kinds.int4 import Int4, Int4Method
from kiln.exporter.serving.genai import genai_config, genai_refusal
from kiln.exporter.support import refusal
from kiln.plugins.cache_layout import CacheLayout
from kiln.plugins.hf import SUPPORTED
from kiln.plugins.hf.build import tiny_model, tiny_transformers
from kiln.plugins.hf.unsupported import refusal as unsupported_refusal
from kiln_testing import assert_greedy_equals_hf, assert_kiln_generate

CASE = "gemma4-shared-window"  # plugins/hf/tiny_gemma4.py: 6 layers, sliding/global alternating, 4 and 5 read 2 and 3
SHAPES = {0: (2, 16), 1: (1, 32), 2: (2, 16), 3: (1, 32)}  # the carrying layers' (KV heads, head dim)
READS = ((4, 2), (5, 3))
STEPS = 16


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gemma4")
    tiny_transformers(CASE, seed=1).save_pretrained(root / "ckpt", safe_serialization=True)
    result = export(root / "ckpt", root / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8, triton="g4"))
    assert result.parity.passed, result.parity.failures()
    return root / "ckpt", root / "out"


def test_each_layer_carries_keys_and_values_of_its_own_shape(gemma4: tuple[Path, Path]) -> None:
    manifest = manifest_mod.read(gemma4[1])
    cache = manifest.kv_cache
    assert (cache.kind, manifest.model.n_layers) == ("shared_kv", 6), cache
    assert [(t.layer, t.name, t.heads, t.width) for t in cache.tensors or ()] == [
        (i, name, *SHAPES[i]) for i in SHAPES for name in ("key", "value")
    ]
    assert [(r.layer, r.reads) for r in cache.reads or ()] == list(READS)
    for kind in (GraphKind.PREFILL, GraphKind.DECODE, GraphKind.UNIFIED):
        shapes = {t.name: t.shape for t in manifest.graph(kind).inputs if t.name.startswith("past_key_values.")}
        if kind is not GraphKind.PREFILL:
            assert shapes["past_key_values.1.value"] == ("batch", 1, "past_seq", 32), shapes
            assert shapes["past_key_values.2.key"] == ("batch", 2, "past_seq", 16), shapes
            assert not any(n.startswith(("past_key_values.4.", "past_key_values.5.")) for n in shapes), shapes
    raw = json.loads((gemma4[1] / "manifest.json").read_text())
    schema = resources.files("kiln.exporter.artifacts").joinpath("manifest.schema.json").read_text()
    validator = Draft202012Validator(json.loads(schema))
    assert [e.message for e in validator.iter_errors(raw)] == []
    raw["kv_cache"]["kind"] = "per_layer_shapes"  # the schema names the kinds
    assert [e.message for e in validator.iter_errors(raw)] != []


def test_kiln_verify_names_a_layer_of_another_shape(gemma4: tuple[Path, Path]) -> None:
    result = CliRunner().invoke(main, ["verify", str(gemma4[1])])
    assert result.exit_code == 0, result.output
    manifest = manifest_mod.read(gemma4[1])
    assert structure_problems(gemma4[1], manifest) == []
    tensors = tuple(
        dataclasses.replace(t, width=16) if (t.layer, t.name) == (1, "key") else t
        for t in manifest.kv_cache.tensors or ()
    )
    wrong = dataclasses.replace(manifest, kv_cache=dataclasses.replace(manifest.kv_cache, tensors=tensors))
    problems = structure_problems(gemma4[1], wrong)
    assert any(
        "kv_cache.tensors gives past_key_values.1.key 1 heads of 16, but graph onnx/decode.onnx has 1 of 32" in p
        for p in problems
    ), problems
    kept = tuple(t for t in manifest.kv_cache.tensors or () if t.layer != 1)  # layer 1's left out
    gone = structure_problems(
        gemma4[1], dataclasses.replace(manifest, kv_cache=dataclasses.replace(manifest.kv_cache, tensors=kept))
    )
    assert any("has past_key_values.1.key, which kv_cache.tensors does not list" in p for p in gone), gone


def test_kiln_generate_equals_transformers_generate(gemma4: tuple[Path, Path]) -> None:
    assert_kiln_generate(*gemma4, [5, 17, 33, 9, 101, 64, 3, 88, 12], STEPS)


def test_a_left_padded_batch_equals_transformers_generate(gemma4: tuple[Path, Path]) -> None:
    """kiln's ORT runner on prefill + decode and on the unified graph alone, batch 1 and a
    left-padded batch of two, against transformers' greedy ``generate()``."""
    for _, want in assert_greedy_equals_hf(*gemma4, STEPS):
        assert len(set(want[0].tolist())) > 3, want  # the tiny model does not repeat one token


def test_the_triton_states_have_each_layers_shape(gemma4: tuple[Path, Path]) -> None:
    text = "\n".join(p.read_text() for p in (gemma4[1] / "triton").rglob("config.pbtxt"))
    for layer, (heads, width) in SHAPES.items():
        block = text[text.index(f'input_name: "past_key_values.{layer}.value"') :]
        assert f"dims: [ {heads}, -1, {width} ]" in block[: block.index("initial_state")], block[:300]
    assert "past_key_values.4." not in text and "past_key_values.5." not in text, text


def test_genai_and_the_onnx_target_refuse_by_name(gemma4: tuple[Path, Path]) -> None:
    assert not (gemma4[1] / "onnx" / "genai_config.json").exists()
    manifest = manifest_mod.read(gemma4[1])
    with pytest.raises(ArtifactError, match="genai: no genai_config.json for a shared_kv cache"):
        genai_config(manifest)
    own = dataclasses.replace(manifest, kv_cache=dataclasses.replace(manifest.kv_cache, kind="per_layer", reads=None))
    why = genai_refusal(own)
    assert why is not None and "genai: no genai_config.json for a per_layer cache (keys and values of each" in why
    spec = tiny_model("gemma4-window", seed=0).spec
    assert spec.cache is not None and spec.cache.kind == "per_layer", spec.cache
    why = refusal(spec, {"target": "onnx"})
    assert why is not None and "--target onnx is not supported for a per_layer cache" in why, why
    shared = refusal(tiny_model(CASE, seed=0).spec, {"target": "onnx"})
    assert shared is not None and "--target onnx is not supported for a shared_kv cache" in shared, shared
    assert refusal(spec, {"target": "ort"}) is None and refusal(spec, {}) is None


def test_the_per_layer_layout_keeps_each_layers_shape() -> None:
    layout = CacheLayout.per_layer([(2, 16), (1, 32)], {})
    assert layout.kind == "per_layer" and layout.per_token() == 2 * (2 * 16 + 32), layout
    assert [(i, t.heads, t.width) for i, t in layout.tensors()] == [(0, 2, 16), (0, 2, 16), (1, 1, 32), (1, 1, 32)]
    shared = CacheLayout.per_layer([(2, 16), (1, 32), (2, 16)], {2: 0})
    assert (shared.kind, shared.reads, shared.carrying()) == ("shared_kv", ((2, 0),), 2), shared
    with pytest.raises(ValueError, match="only the last layers can read an earlier layer's cache"):
        CacheLayout.per_layer([(2, 16), (1, 32), (2, 16)], {1: 2})
    assert CacheLayout.kv(2, 2, 16).layers == CacheLayout.per_layer([(2, 16)] * 2, {}).layers  # the same tensors


def test_what_gemma4_does_not_prove_is_refused_by_name() -> None:
    moe = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    with pytest.raises(CheckpointError, match=r"enable_moe_block=True is not supported: Gemma 4's mixture-of-experts"):
        tiny_model("gemma4-window", seed=0, **moe)
    with pytest.raises(CheckpointError, match="num_kv_shared_layers=2 of 2 layers leaves a shared layer no earlier"):
        tiny_model("gemma4-window", seed=0, num_kv_shared_layers=2)
    with pytest.raises(
        CheckpointError, match=r"num_attention_heads \(4\) is not a multiple of the key/value heads \(3\)"
    ):
        tiny_model("gemma4-window", seed=0, num_global_key_value_heads=3)  # the global layer's, read per layer
    with pytest.raises(CheckpointError, match="use_bidirectional_attention='all' is not supported: non-causal"):
        tiny_model("gemma4-window", seed=0, use_bidirectional_attention="all")
    config = {"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant", "text_config": {}}
    line = unsupported_refusal("Gemma4AssistantForCausalLM", config, SUPPORTED)
    assert "kiln does not export Gemma 4's assistant (a drafter reading its target model's keys and values" in line
    assert "Gemma4ForCausalLM" in SUPPORTED


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_fp16_and_int4_pass_their_parity(precision: str, tmp_path: Path) -> None:
    """fp16 and int4 (RTN) of the per-layer shapes and shared layers meet their own parity: tensors
    and teacher-forced tokens, batch 1 and a left-padded batch."""
    tiny_transformers(CASE, seed=1).save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    chosen = Precision.FP16 if precision == "fp16" else Precision.of(Int4(method=Int4Method.RTN))
    result = export(
        tmp_path / "ckpt", tmp_path / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8, precision=chosen)
    )
    assert result.parity.passed, result.parity.failures()
    assert [(t.layer, t.heads, t.width) for t in result.manifest.kv_cache.tensors or () if t.name == "key"] == [
        (i, *SHAPES[i]) for i in SHAPES
    ]
