"""Attention and Mamba2 layers in one decoder through kiln's export pipeline (issue 43 item 2: the
``hybrid`` cache kind of ``plugins/cache_layout.py``; GraniteMoeHybrid, Granite 4.0-H): ``kiln
export`` of a tiny GraniteMoeHybrid (Mamba2, attention, Mamba2 layers; NoPE attention, mixture of
experts) passes its own parity; its graphs and manifest carry ``conv``/``ssm`` of fixed sizes on the
Mamba2 layers and growing ``key``/``value`` on the attention layer; ``kiln verify`` passes; greedy
tokens through kiln's ORT runner (batch 1 and a left-padded batch of two; prefill + decode, and the
unified graph alone) and ``kiln generate`` equal transformers' ``generate()``, and a tiny Bamba's
too; GenAI and ``--target onnx`` (GraniteMoeHybrid's routing) refuse it by name. Mamba2 alone:
tests/export/test_state_cache.py."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])"
)

from click.testing import CliRunner

from kiln.cli import main
from kiln.errors import ArtifactError
from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.exporter.serving.genai import genai_config
from kiln.exporter.support import refusal
from kiln.plugins.hf.build import tiny_model, tiny_transformers
from kiln_testing import assert_greedy_equals_hf, assert_kiln_generate

# plugins/hf/tiny_recurrent.py's granitemoehybrid: layers 0 and 2 Mamba2 (conv window 4 x 160, ssm 8 x 16 x 16),
# layer 1 attention (2 KV heads of 16)
STATE = {"conv": (1, 4, 160), "ssm": (8, 16, 16)}
STEPS = 16


def _save(case: str, directory: Path) -> Path:
    tiny_transformers(case, seed=1).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    ckpt = _save("granitemoehybrid", root / "ckpt")
    result = export(ckpt, root / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8))
    assert result.parity.passed, result.parity.failures()
    return ckpt, root / "out"


def _expected_cache(kind: GraphKind, prefix: str) -> dict[str, list[object]]:
    """Each layer's cache tensors as ``kind``'s graph names them (``prefix``: past or present)."""
    length = {"past_key_values": "past_seq", "present": "seq" if kind is GraphKind.PREFILL else "total_seq"}[prefix]
    states = {f"{prefix}.{i}.{n}": ["batch", *shape] for i in (0, 2) for n, shape in STATE.items()}
    keys = {f"{prefix}.1.{n}": ["batch", 2, length, 16] for n in ("key", "value")}
    return states | keys


def test_the_graphs_and_the_manifest_carry_each_layers_own_cache(hybrid: tuple[Path, Path]) -> None:
    manifest = manifest_mod.read(hybrid[1])
    cache = manifest.kv_cache
    assert cache.kind == "hybrid", cache
    want = [(0, n, *s, "state") for n, s in STATE.items()]
    want += [(1, n, 2, None, 16, "sequence") for n in ("key", "value")]
    want += [(2, n, *s, "state") for n, s in STATE.items()]
    got = [(t.layer, t.name, t.heads, t.length, t.width, t.span) for t in cache.tensors or ()]
    assert got == want, got
    for kind in (GraphKind.PREFILL, GraphKind.DECODE, GraphKind.UNIFIED):
        graph = manifest.graph(kind)
        pasts = {t.name: list(t.shape) for t in graph.inputs if t.name.startswith("past_key_values.")}
        presents = {t.name: list(t.shape) for t in graph.outputs if t.name.startswith("present.")}
        assert presents == _expected_cache(kind, "present"), (kind, presents)
        assert pasts == ({} if kind is GraphKind.PREFILL else _expected_cache(kind, "past_key_values")), (kind, pasts)
    assert not (hybrid[1] / "onnx" / "genai_config.json").exists()
    with pytest.raises(ArtifactError, match="genai: no genai_config.json for a hybrid cache"):
        genai_config(manifest)


def test_kiln_verify_passes(hybrid: tuple[Path, Path]) -> None:
    result = CliRunner().invoke(main, ["verify", str(hybrid[1])])
    assert result.exit_code == 0, result.output


def test_greedy_tokens_equal_transformers_generate(hybrid: tuple[Path, Path]) -> None:
    _assert_greedy_equals_generate(*hybrid)


def test_kiln_generate_equals_transformers_generate(hybrid: tuple[Path, Path]) -> None:
    assert_kiln_generate(*hybrid, [5, 17, 33, 9, 101, 64, 3, 88, 12], STEPS)


def test_bamba_exports_and_its_greedy_tokens_equal_transformers_generate(tmp_path: Path) -> None:
    """Bamba: the same Mamba2 and attention layers (partial rotary attention, a dense MLP)."""
    ckpt = _save("bamba", tmp_path / "ckpt")
    result = export(ckpt, tmp_path / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8))
    assert result.parity.passed, result.parity.failures()
    spans = [(t.layer, t.name, t.span) for t in result.manifest.kv_cache.tensors or ()]
    assert result.manifest.kv_cache.kind == "hybrid" and spans[2:4] == [
        (1, "key", "sequence"),
        (1, "value", "sequence"),
    ]
    _assert_greedy_equals_generate(ckpt, tmp_path / "out")


def _assert_greedy_equals_generate(ckpt: Path, out: Path) -> None:
    """kiln's ORT runner on prefill + decode and on the unified graph alone, batch 1 and a
    left-padded batch of two (the padded row's state must stay the unpadded row's)."""
    assert_greedy_equals_hf(ckpt, out, STEPS)


def test_the_onnx_target_refuses_the_hybrid_cache_by_name() -> None:
    spec = tiny_model("granitemoehybrid", seed=0).spec
    assert spec.cache is not None and spec.cache.kind == "hybrid", spec.cache
    why = refusal(spec, {"target": "onnx"})  # its experts' routing: tests/export/test_onnx_target_state.py
    assert why is not None and "--target onnx does not write GraniteMoeHybridForCausalLM: its mixture-of" in why, why
    assert refusal(spec, {"target": "ort"}) is None and refusal(spec, {}) is None


@pytest.mark.slow
def test_rotary_dense_and_fp16_pass_their_parity(tmp_path: Path) -> None:
    """The rotary, dense case (``granitemoehybrid-rope-dense``) at fp32, and the NoPE MoE case at --fp16."""
    dense = _save("granitemoehybrid-rope-dense", tmp_path / "dense")
    result = export(dense, tmp_path / "out-dense", ExportOptions.from_flags(max_batch=4, parity_tokens=8))
    assert result.parity.passed, result.parity.failures()
    assert result.manifest.kv_cache.kind == "hybrid"
    ckpt = _save("granitemoehybrid", tmp_path / "ckpt")
    fp16 = export(
        ckpt, tmp_path / "out16", ExportOptions.from_flags(max_batch=4, parity_tokens=8, precision=Precision.FP16)
    )
    assert fp16.parity.passed, fp16.parity.failures()
    inputs = fp16.manifest.graph(GraphKind.DECODE).inputs
    assert {t.dtype for t in inputs if t.name.startswith("past_key_values.")} == {"float16"}
