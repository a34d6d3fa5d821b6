"""LFM2's short-convolution layers through kiln's export pipeline (issue 43 item 2: a ``hybrid``
cache whose convolution layers carry their conv window alone, ``CacheLayout.hybrid``): ``kiln
export --target ort`` of a tiny Lfm2 (conv, attention, conv layers) passes its own parity on the
portable and the ONNX Runtime graphs; its graphs and manifest carry ``conv`` ``[batch, 1,
conv_L_cache, hidden]`` (fixed) on the conv layers and growing ``key``/``value`` on the attention
layer, no SSM state; ``kiln verify`` passes; the Triton states are the fixed shapes from zeros;
greedy tokens through kiln's ORT runner (batch 1 and a left-padded batch of two: the padded row's
window must stay the unpadded row's, which transformers keeps by zeroing padded inputs before the
convolution; prefill + decode, and the unified graph alone) and ``kiln generate`` equal transformers'
``generate()``; --fp16 and int4 RTN pass their parity; GenAI refuses the cache by name
(``--target onnx`` takes it: tests/export/test_onnx_target_state.py). Lfm2Moe (the same layers with
experts) is proved with every family in test_hf_archs.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
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
from kiln.plugins.cache_layout import CacheLayout, Span
from kiln.plugins.hf.build import tiny_model, tiny_transformers
from kiln_testing import assert_greedy_equals_hf, assert_int4_generation, assert_kiln_generate, hf_greedy, hf_model

# plugins/hf/tiny_lfm2.py's lfm2: layers 0 and 2 short convolutions (window 3 x hidden 64), layer 1 attention
# (2 KV heads of 16)
WINDOW = (1, 3, 64)
STEPS = 16


def _save(directory: Path) -> Path:
    tiny_transformers("lfm2", seed=1).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lfm2")
    ckpt = _save(root / "ckpt")
    options = ExportOptions.from_flags(max_batch=4, parity_tokens=8, target="ort", triton="lfm2")
    result = export(ckpt, root / "out", options)
    assert result.parity.passed, result.parity.failures()
    return ckpt, root / "out"


def _expected_cache(kind: GraphKind, prefix: str) -> dict[str, list[object]]:
    """Each layer's cache tensors as ``kind``'s graph names them (``prefix``: past or present)."""
    length = {"past_key_values": "past_seq", "present": "seq" if kind is GraphKind.PREFILL else "total_seq"}[prefix]
    windows = {f"{prefix}.{i}.conv": ["batch", *WINDOW] for i in (0, 2)}
    return windows | {f"{prefix}.1.{n}": ["batch", 2, length, 16] for n in ("key", "value")}


def test_the_graphs_and_the_manifest_carry_a_conv_window_alone(lfm2: tuple[Path, Path]) -> None:
    manifest = manifest_mod.read(lfm2[1])
    cache = manifest.kv_cache
    assert cache.kind == "hybrid", cache
    got = [(t.layer, t.name, t.heads, t.length, t.width, t.span) for t in cache.tensors or ()]
    want = [(0, "conv", 1, 3, 64, "state"), *[(1, n, 2, None, 16, "sequence") for n in ("key", "value")]]
    assert got == [*want, (2, "conv", 1, 3, 64, "state")], got
    for kind in (GraphKind.PREFILL, GraphKind.DECODE, GraphKind.UNIFIED):
        graph = manifest.graph(kind)
        pasts = {t.name: list(t.shape) for t in graph.inputs if t.name.startswith("past_key_values.")}
        presents = {t.name: list(t.shape) for t in graph.outputs if t.name.startswith("present.")}
        assert presents == _expected_cache(kind, "present"), (kind, presents)
        assert pasts == ({} if kind is GraphKind.PREFILL else _expected_cache(kind, "past_key_values")), (kind, pasts)
    assert not (lfm2[1] / "onnx" / "genai_config.json").exists()
    with pytest.raises(ArtifactError, match="genai: no genai_config.json for a hybrid cache"):
        genai_config(manifest)


def test_kiln_verify_passes(lfm2: tuple[Path, Path]) -> None:
    result = CliRunner().invoke(main, ["verify", str(lfm2[1])])
    assert result.exit_code == 0, result.output


def test_the_triton_states_are_the_fixed_windows_from_zeros(lfm2: tuple[Path, Path]) -> None:
    text = "\n".join(p.read_text() for p in (lfm2[1] / "triton").rglob("config.pbtxt"))
    for i in (0, 2):
        state = text[text.index(f'input_name: "past_key_values.{i}.conv"') :][:400]
        assert state.count(f"dims: [ {', '.join(map(str, WINDOW))} ]") == 2 and "zero_data: true" in state, state
    assert "past_key_values.0.ssm" not in text and "past_key_values.1.conv" not in text


def test_greedy_tokens_equal_transformers_generate(lfm2: tuple[Path, Path]) -> None:
    """kiln's ORT runner on prefill + decode (portable and --target ort) and on the unified graph alone,
    batch 1 and a left-padded batch of two."""
    ckpt, _ = lfm2
    prompts, want = assert_greedy_equals_hf(*lfm2, STEPS, ort=True)[1]
    # the padded row's tokens are the short prompt's alone: padding left nothing in its conv windows
    np.testing.assert_array_equal(want[1], hf_greedy(hf_model(ckpt), [list(map(int, prompts[1]))], STEPS)[0])
    assert len(set(want[1].tolist())) > 1, want  # a tiny model that repeats one token would prove little


def test_kiln_generate_equals_transformers_generate(lfm2: tuple[Path, Path]) -> None:
    assert_kiln_generate(*lfm2, [5, 17, 33, 9, 101, 64, 3, 88, 12], STEPS)


def test_the_onnx_target_takes_the_conv_window_and_genai_refuses_it_by_name() -> None:
    spec = tiny_model("lfm2", seed=0).spec
    assert spec.cache is not None and spec.cache.kind == "hybrid", spec.cache
    assert refusal(spec, {"target": "onnx"}) is None  # its graphs: tests/export/test_onnx_target_state.py
    assert refusal(spec, {"target": "ort"}) is None and refusal(spec, {}) is None


def test_the_layout_gives_a_conv_layer_its_window_alone() -> None:
    layout = CacheLayout.hybrid(["conv", "kv", "conv"], (2, 16), (3, 64))
    got = [(i, t.suffix, t.heads, t.width, t.span, t.length) for i, t in layout.tensors()]
    window = ("conv", 1, 64, Span.STATE, 3)
    keys = [(1, n, 2, 16, Span.SEQUENCE, 0) for n in ("key", "value")]
    assert layout.kind == "hybrid" and got == [(0, *window), *keys, (2, *window)], got
    assert layout.per_token() == 2 * 2 * 16  # the windows do not grow
    with pytest.raises(ValueError, match="conv: a fixed length is for a state span only"):
        CacheLayout.hybrid(["conv"], (2, 16), (0, 64))


@pytest.mark.slow
def test_fp16_and_int4_pass_their_parity(tmp_path: Path) -> None:
    """--fp16 (its own parity), and int4 RTN on the portable graphs and --target ort, against PyTorch on
    the same int4 weights (``assert_int4_generation``)."""
    ckpt = _save(tmp_path / "ckpt")
    fp16 = export(
        ckpt, tmp_path / "out16", ExportOptions.from_flags(max_batch=4, parity_tokens=8, precision=Precision.FP16)
    )
    assert fp16.parity.passed, fp16.parity.failures()
    inputs = fp16.manifest.graph(GraphKind.DECODE).inputs
    assert [t.dtype for t in inputs if t.name.endswith(".conv")] == ["float16"] * 2, inputs
    int4 = assert_int4_generation(ckpt, tmp_path / "out4", STEPS)
    assert int4.manifest.kv_cache.kind == "hybrid"
