"""Two more Mamba2 hybrid layouts through kiln's export pipeline (issue 43 item 2, the ``hybrid``
cache kind of ``plugins/cache_layout.py``; GraniteMoeHybrid and Bamba: tests/export/test_hybrid_cache.py):
Nemotron-H, whose blocks each hold one mixer (Mamba2, attention, MLP or experts: the MLP and expert
blocks carry no cache, between blocks that do), and Falcon-H1, whose every layer runs attention and
a Mamba2 mixer side by side (each layer carries ``key``, ``value``, ``conv`` and ``ssm``) with muP
multipliers. Per family (plugins/hf/tiny_mamba_hybrids.py): ``kiln export`` at fp32 passes its
parity, its manifest lists each layer's own tensors and ``kiln verify`` and ``kiln triton`` take
it; greedy tokens through kiln's ORT runner (prefill + decode and the unified graph, batch 1 and a
left-padded batch of two) and through ``kiln generate`` equal transformers' ``generate()``;
``--fp16``, ``--int4 --int4-method rtn`` (tokens against PyTorch on the same int4 weights) and
``--target ort`` pass their parity."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])"
)

from click.testing import CliRunner

from kiln.cli import main
from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.plugins.cache_layout import CacheLayout
from kiln.plugins.hf.build import tiny_transformers
from kiln_testing import assert_greedy_equals_hf, assert_int4_generation, assert_kiln_generate

STEPS = 12
STATE = [("conv", 1, 4, 160, "state"), ("ssm", 8, 16, 16, "state")]  # both: 8 Mamba2 heads of 16, state 16
KEYS = [("key", 2, None, 16, "sequence"), ("value", 2, None, 16, "sequence")]  # 2 KV heads of 16
# each case's cache, layer by layer: Nemotron-H's blocks Mamba2, MLP, attention, experts; Falcon-H1's both in each
LAYERS = {"nemotronh": {0: STATE, 2: KEYS}, "falconh1": {0: KEYS + STATE, 1: KEYS + STATE}}
CASES = sorted(LAYERS)


def test_a_mixed_layout_gives_each_layer_its_own_tensors_and_names_an_unknown_kind() -> None:
    sizes = ((2, 16), (4, 160), (8, 16, 16))
    layout = CacheLayout.hybrid(["state", "none", "kv", "kv+state"], *sizes)
    suffixes = [tuple(t.suffix for t in layer) for layer in layout.layers]
    assert suffixes == [("conv", "ssm"), (), ("key", "value"), ("key", "value", "conv", "ssm")], suffixes
    assert layout.kind == "hybrid" and layout.per_token() == 2 * (2 * 2 * 16), layout  # two attention layers grow
    with pytest.raises(
        ValueError, match=r"layer kinds \['mamba'\] are not one of \['conv', 'kv', 'kv\+state', 'none', 'state'\]"
    ):
        CacheLayout.hybrid(["kv", "mamba"], *sizes)


@pytest.fixture(scope="module", params=CASES)
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    case: str = request.param
    root = tmp_path_factory.mktemp(case)
    tiny_transformers(case, seed=1).save_pretrained(root / "ckpt", safe_serialization=True)
    result = export(root / "ckpt", root / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8))
    assert result.parity.passed, (case, result.parity.failures())
    return case, root / "ckpt", root / "out"


def test_the_manifest_and_the_graphs_carry_each_layers_own_cache(exported: tuple[str, Path, Path]) -> None:
    case, _, out = exported
    manifest = manifest_mod.read(out)
    assert manifest.kv_cache.kind == "hybrid", manifest.kv_cache
    got = [(t.layer, t.name, t.heads, t.length, t.width, t.span) for t in manifest.kv_cache.tensors or ()]
    assert got == [(i, *t) for i, tensors in LAYERS[case].items() for t in tensors], got
    decode = manifest.graph(GraphKind.DECODE)
    pasts = [t.name for t in decode.inputs if t.name.startswith("past_key_values.")]
    presents = [t.name for t in decode.outputs if t.name.startswith("present.")]
    want = [f"{i}.{t[0]}" for i, tensors in LAYERS[case].items() for t in tensors]
    assert pasts == [f"past_key_values.{n}" for n in want] and presents == [f"present.{n}" for n in want], pasts


def test_kiln_verify_and_triton_take_the_export(exported: tuple[str, Path, Path]) -> None:
    case, _, out = exported
    verified = CliRunner().invoke(main, ["verify", str(out)])
    assert verified.exit_code == 0, verified.output
    triton = CliRunner().invoke(main, ["triton", str(out), "--name", case])
    assert triton.exit_code == 0, triton.output
    config = (out / "triton" / case / "config.pbtxt").read_text()
    states = sum(len(tensors) for tensors in LAYERS[case].values())
    assert config.count("input_name") == states, config  # one sequence state per cache tensor, none for a bare layer


def test_greedy_tokens_equal_transformers_generate(exported: tuple[str, Path, Path]) -> None:
    """kiln's ORT runner on prefill + decode and on the unified graph alone, batch 1 and a
    left-padded batch of two (the padded row's state must stay the unpadded row's)."""
    assert_greedy_equals_hf(*exported[1:], STEPS)


def test_kiln_generate_equals_transformers_generate(exported: tuple[str, Path, Path]) -> None:
    _, ckpt, out = exported
    assert_kiln_generate(ckpt, out, [5, 17, 33, 9, 101, 64, 3, 88, 12], STEPS)


@pytest.mark.slow
def test_fp16_and_the_ort_target_pass_their_parity(exported: tuple[str, Path, Path], tmp_path: Path) -> None:
    case, ckpt, _ = exported
    fp16 = export(
        ckpt, tmp_path / "fp16", ExportOptions.from_flags(max_batch=4, parity_tokens=8, precision=Precision.FP16)
    )
    assert fp16.parity.passed, (case, fp16.parity.failures())
    inputs = fp16.manifest.graph(GraphKind.DECODE).inputs
    assert {t.dtype for t in inputs if t.name.startswith("past_key_values.")} == {"float16"}
    ort = export(ckpt, tmp_path / "ort", ExportOptions.from_flags(max_batch=4, parity_tokens=8, target="ort"))
    assert ort.parity.passed, (case, ort.parity.failures())
    assert ort.manifest.targets is not None
    fused = ort.manifest.targets["ort"].graphs[GraphKind.DECODE.value].report("attention")["layers"]
    assert fused == [i for i, tensors in LAYERS[case].items() if tensors[0][0] == "key"], fused


@pytest.mark.slow
def test_int4_generation_equals_pytorch_on_the_same_weights(exported: tuple[str, Path, Path], tmp_path: Path) -> None:
    _, ckpt, _ = exported
    assert_int4_generation(ckpt, tmp_path / "int4", STEPS)
