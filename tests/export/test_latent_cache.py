"""Multi-head latent attention's cache (issue 43: DeepSeek-V2, DeepSeek-V3) through every reader of
the cache layout (``plugins/cache_layout.py``): the graphs' I/O and the manifest carry per layer the
latent (``key``, 1 x kv_lora_rank) and the rope key (``value``, 1 x qk_rope_head_dim); ``kiln
verify`` checks them against the graphs and names a manifest that disagrees; ``kiln generate``'s
greedy tokens equal transformers' ``generate()``; the Triton repository states the two widths; GenAI
and ``--target onnx`` refuse by name; int4 passes its own parity. Greedy parity at fp32 (portable and
--target ort) and fp16 is ``test_hf_archs``'s, for the same tiny cases."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])"
)

import torch
from click.testing import CliRunner
from jsonschema import Draft202012Validator

from kiln.cli import main
from kiln.errors import ArtifactError
from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.artifacts.structure import structure_problems
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.exporter.precision.kinds.int4 import Int4, Int4Method
from kiln.exporter.serving.genai import genai_config
from kiln.exporter.support import refusal
from kiln.plugins.base import DecoderSpec
from kiln.plugins.hf.build import tiny_model, tiny_transformers
from kiln_testing import assert_kiln_generate

RANK, ROPE = 32, 8  # plugins/hf/tiny.py's _MLA: kv_lora_rank, qk_rope_head_dim


def _save(case: str, directory: Path) -> Path:
    model = tiny_transformers(case, seed=1)
    with torch.no_grad():  # a correction bias of zeros would not show what it shifts
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def v3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("latent")
    ckpt = _save("deepseek-v3", root / "ckpt")
    result = export(ckpt, root / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8, triton="mla"))
    assert result.parity.passed, result.parity.failures()
    return ckpt, root / "out"


def test_the_graphs_and_the_manifest_carry_the_latent_and_the_rope_key(v3: tuple[Path, Path]) -> None:
    manifest = manifest_mod.read(v3[1])
    cache = manifest.kv_cache
    assert (cache.kind, list(cache.dims)) == ("latent", ["batch", "heads", "seq", "width"]), cache
    assert [(t.layer, t.name, t.heads, t.width, t.span) for t in cache.tensors or ()] == [
        (i, name, 1, width, "sequence") for i in range(2) for name, width in (("key", RANK), ("value", ROPE))
    ]
    for kind in (GraphKind.DECODE, GraphKind.UNIFIED):
        inputs = {t.name: list(t.shape) for t in manifest.graph(kind).inputs}
        assert inputs["past_key_values.1.key"] == ["batch", 1, "past_seq", RANK] and inputs[
            "past_key_values.1.value"
        ] == ["batch", 1, "past_seq", ROPE], inputs
    outputs = {t.name: list(t.shape) for t in manifest.graph(GraphKind.PREFILL).outputs}
    assert outputs["present.0.key"] == ["batch", 1, "seq", RANK] and outputs["present.0.value"] == [
        "batch",
        1,
        "seq",
        ROPE,
    ], outputs
    raw = json.loads((v3[1] / "manifest.json").read_text())
    validator = Draft202012Validator(
        json.loads(resources.files("kiln.exporter.artifacts").joinpath("manifest.schema.json").read_text())
    )
    assert [e.message for e in validator.iter_errors(raw)] == []
    raw["kv_cache"]["tensors"][0]["span"] = "forever"  # the schema can refuse one
    assert [e.message for e in validator.iter_errors(raw)] != []
    assert not (v3[1] / "onnx" / "genai_config.json").exists()
    with pytest.raises(ArtifactError, match="genai: no genai_config.json for a latent cache .*one head_size"):
        genai_config(manifest)


def test_kiln_verify_checks_the_layout_against_the_graphs(v3: tuple[Path, Path], tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["verify", str(v3[1])])
    assert result.exit_code == 0, result.output
    manifest = manifest_mod.read(v3[1])
    assert structure_problems(v3[1], manifest) == []
    tensors = manifest.kv_cache.tensors or ()
    wrong = dataclasses.replace(
        manifest,
        kv_cache=dataclasses.replace(
            manifest.kv_cache, tensors=(dataclasses.replace(tensors[0], width=16), *tensors[1:])
        ),
    )
    problems = structure_problems(v3[1], wrong)
    assert any(
        "kv_cache.tensors gives present.0.key 1 heads of 16, but graph onnx/prefill.onnx has 1 of 32" in p
        for p in problems
    ), problems
    missing = dataclasses.replace(manifest, kv_cache=dataclasses.replace(manifest.kv_cache, tensors=tensors[:-1]))
    assert any(
        "has present.1.value, which kv_cache.tensors does not list" in p for p in structure_problems(v3[1], missing)
    )


def test_kiln_generate_equals_transformers_generate(v3: tuple[Path, Path]) -> None:
    assert_kiln_generate(*v3, [5, 17, 33, 9, 101, 64, 3, 88, 12], 16)


def test_the_triton_states_have_each_tensors_width(v3: tuple[Path, Path]) -> None:
    text = "\n".join(p.read_text() for p in (v3[1] / "triton").rglob("config.pbtxt"))
    for name, width in (("past_key_values.1.key", RANK), ("past_key_values.1.value", ROPE)):
        state = text[text.index(f'input_name: "{name}"') :][:400]
        assert f"dims: [ 1, -1, {width} ]" in state and f"dims: [ 1, 0, {width} ]" in state, state


def _spec(case: str) -> DecoderSpec:
    return tiny_model(case, seed=0).spec


def test_the_onnx_target_refuses_the_latent_cache_by_name() -> None:
    spec = _spec("deepseek-v3")
    why = refusal(spec, {"target": "onnx"})
    assert (
        why is not None and "--target onnx is not supported for a latent cache (multi-head latent attention)" in why
    ), why
    assert refusal(spec, {"target": "ort"}) is None and refusal(spec, {}) is None


def test_the_latent_cache_is_smaller_per_token_than_multi_head_keys_and_values() -> None:
    """What a token costs in the cache: the latent and the rope key, against keys and values of
    every head at the same sizes."""
    spec = _spec("deepseek-v3")
    heads, key_width = 4, 16 + ROPE  # the tiny model's heads and qk_nope_head_dim + qk_rope_head_dim
    assert spec.cache_layout.per_token() == 2 * (RANK + ROPE)
    assert (
        dataclasses.replace(spec, cache=None, n_kv_heads=heads, head_dim=key_width).cache_layout.per_token()
        == 2 * 2 * heads * key_width
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "method"),
    [("deepseek-v2", Int4Method.RTN), ("deepseek-v3", Int4Method.RTN), ("deepseek-v3", Int4Method.GPTQ)],
)
def test_int4_passes_its_parity(case: str, method: Int4Method, tmp_path: Path) -> None:
    """int4 (RTN, and GPTQ on synthetic calibration tokens) meets its own parity: tensors and
    teacher-forced tokens, batch 1 and a left-padded batch."""
    ckpt = _save(case, tmp_path / "ckpt")
    calib = {"calib_data": "synthetic"} if method is Int4Method.GPTQ else {}
    result = export(
        ckpt,
        tmp_path / "out",
        ExportOptions.from_flags(max_batch=4, parity_tokens=8, precision=Precision.of(Int4(method=method)), **calib),
    )
    assert result.parity.passed, result.parity.failures()
    assert (
        result.manifest.kv_cache.kind == "latent"
        and result.manifest.kv_cache.tensors == manifest_mod.read(tmp_path / "out").kv_cache.tensors
    )
