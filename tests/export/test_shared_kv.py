"""Layers that read another layer's cache (issue 43: Gemma 3n's ``num_kv_shared_layers``) through
every reader of the cache layout (``plugins/cache_layout.py``, kind ``shared_kv``): the graphs take
and return keys and values for the layers that carry them only; the manifest lists those tensors
and which layer each other layer reads (``kv_cache.reads``); ``kiln verify`` checks both against the
graphs and names a manifest that disagrees; ``kiln generate``'s greedy tokens equal transformers'
``generate()``; the Triton repository carries the carrying layers' states only; GenAI and
``--target onnx`` refuse by name. Greedy parity at fp32 (portable and --target ort, batch 1 and a
left-padded batch) and fp16 is ``test_hf_archs``'s, for the same tiny cases."""

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
from kiln.exporter.artifacts.cache_info import SharedKvRead
from kiln.exporter.artifacts.structure import structure_problems
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.exporter.precision.kinds.int4 import Int4, Int4Method
from kiln.exporter.serving.genai import genai_config
from kiln.exporter.support import refusal
from kiln.plugins.cache_layout import CacheLayout
from kiln.plugins.hf.build import tiny_model, tiny_transformers
from kiln.plugins.hf.gemma3n_sparsity import std_multipliers
from kiln_testing import assert_kiln_generate

CASE = "gemma3n-shared-window"  # plugins/hf/tiny_gemma3n.py: 5 layers, the last 2 read layers 1 and 2
CARRYING, READS = (0, 1, 2), ((3, 1), (4, 2))


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("shared_kv")
    tiny_transformers(CASE, seed=1).save_pretrained(root / "ckpt", safe_serialization=True)
    result = export(root / "ckpt", root / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8, triton="g3n"))
    assert result.parity.passed, result.parity.failures()
    return root / "ckpt", root / "out"


def test_the_graphs_carry_no_cache_for_the_layers_that_read_another(shared: tuple[Path, Path]) -> None:
    manifest = manifest_mod.read(shared[1])
    cache = manifest.kv_cache
    assert (cache.kind, manifest.model.n_layers) == ("shared_kv", 5), cache
    assert [(t.layer, t.name, t.heads, t.width) for t in cache.tensors or ()] == [
        (i, name, 2, 16) for i in CARRYING for name in ("key", "value")
    ]
    assert [(r.layer, r.reads) for r in cache.reads or ()] == list(READS)
    for kind in (GraphKind.PREFILL, GraphKind.DECODE, GraphKind.UNIFIED):
        graph = manifest.graph(kind)
        names = {t.name for t in (*graph.inputs, *graph.outputs)}
        assert "present.2.value" in names and not any(n.endswith((".3.key", ".4.value")) for n in names), names
    raw = json.loads((shared[1] / "manifest.json").read_text())
    validator = Draft202012Validator(
        json.loads(resources.files("kiln.exporter.artifacts").joinpath("manifest.schema.json").read_text())
    )
    assert [e.message for e in validator.iter_errors(raw)] == []
    raw["kv_cache"]["reads"][0] = {"layer": 3}  # the schema can refuse one
    assert [e.message for e in validator.iter_errors(raw)] != []


def test_kiln_verify_checks_the_reads_against_the_graphs(shared: tuple[Path, Path]) -> None:
    result = CliRunner().invoke(main, ["verify", str(shared[1])])
    assert result.exit_code == 0, result.output
    manifest = manifest_mod.read(shared[1])
    assert structure_problems(shared[1], manifest) == []

    def problems(reads: tuple[SharedKvRead, ...] | None) -> list[str]:
        wrong = dataclasses.replace(manifest, kv_cache=dataclasses.replace(manifest.kv_cache, reads=reads))
        return structure_problems(shared[1], wrong)

    forgotten = problems(None)
    assert any(
        "model.n_layers is 5, but graph onnx/decode.onnx carries the KV cache of 3 layers" in p for p in forgotten
    ), forgotten
    later = problems((SharedKvRead(3, 4), SharedKvRead(4, 2)))
    assert "kv_cache.reads has layer 3 read layer 4, but it is not an earlier layer" in later, later
    own = problems((SharedKvRead(2, 1), SharedKvRead(3, 1), SharedKvRead(4, 2)))
    assert any("kv_cache.tensors lists a cache of layer 2 itself" in p for p in own), own
    assert any("graph onnx/model.onnx carries a cache for layer 2, which kv_cache.reads says" in p for p in own), own


def test_kiln_generate_equals_transformers_generate(shared: tuple[Path, Path]) -> None:
    assert_kiln_generate(*shared, [5, 17, 33, 9, 101, 64, 3, 88, 12], 16)


def test_the_triton_states_are_the_carrying_layers(shared: tuple[Path, Path]) -> None:
    text = "\n".join(p.read_text() for p in (shared[1] / "triton").rglob("config.pbtxt"))
    assert 'input_name: "past_key_values.2.value"' in text, text
    assert "past_key_values.3." not in text and "past_key_values.4." not in text, text


def test_genai_and_the_onnx_target_refuse_shared_layers_by_name(shared: tuple[Path, Path]) -> None:
    assert not (shared[1] / "onnx" / "genai_config.json").exists()
    with pytest.raises(ArtifactError, match="genai: no genai_config.json for a shared_kv cache .*kv_cache.reads"):
        genai_config(manifest_mod.read(shared[1]))
    spec = tiny_model(CASE, seed=0).spec
    why = refusal(spec, {"target": "onnx"})
    assert why is not None and "--target onnx is not supported for a shared_kv cache" in why, why
    assert refusal(spec, {"target": "ort"}) is None and refusal(spec, {}) is None


def test_only_the_last_layers_may_read_an_earlier_one() -> None:
    layout = CacheLayout.shared_kv(5, 2, 16, {3: 1, 4: 2})
    assert layout.carrying() == 3 and layout.per_token() == 3 * 2 * 2 * 16 and layout.reads == READS
    for reads in ({2: 1, 4: 3}, {3: 1, 4: 3}, {3: 4, 4: 2}):
        with pytest.raises(ValueError, match="only the last layers can read an earlier layer's cache"):
            CacheLayout.shared_kv(5, 2, 16, reads)
    assert tiny_model("gemma3n-window", seed=0).spec.cache is None  # no shared layers: keys and values per layer


def test_the_sparsity_threshold_is_transformers_own_icdf() -> None:
    """The number the traced graphs read in place of ``Normal.icdf`` (``gemma3n_sparsity``): the
    first layers' 0.95, as transformers computes it; the dense layers (0.0) have none."""
    model = tiny_transformers("gemma3n-window", seed=0)
    want = float(torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(0.95)))
    assert std_multipliers(model) == {0.95: want} and 1.64 < want < 1.65


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_fp16_and_int4_pass_their_parity(precision: str, tmp_path: Path) -> None:
    """fp16 and int4 (RTN) of the shared layers meet their own parity: tensors and teacher-forced
    tokens, batch 1 and a left-padded batch."""
    tiny_transformers(CASE, seed=1).save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    chosen = Precision.FP16 if precision == "fp16" else Precision.of(Int4(method=Int4Method.RTN))
    result = export(
        tmp_path / "ckpt", tmp_path / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8, precision=chosen)
    )
    assert result.parity.passed, result.parity.failures()
    assert [(r.layer, r.reads) for r in result.manifest.kv_cache.reads or ()] == list(READS)
