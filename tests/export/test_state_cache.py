"""A recurrent state through kiln's export pipeline (issue 43 item 2: Mamba2, the ``state`` cache
kind of ``plugins/cache_layout.py``): ``kiln export`` of a tiny Mamba2 passes its own parity; its
graphs and manifest carry per layer ``conv`` and ``ssm`` of fixed sizes (prefill takes none and
returns them, decode and the unified graph read and replace them); ``kiln verify`` and ``kiln
check`` pass and verify names a manifest whose length disagrees; greedy tokens through kiln's ORT
runner (batch 1 and a left-padded batch) and through ``kiln generate`` equal transformers'
``generate()``; the Triton repository carries the state at its fixed shape from zeros; GenAI refuses the
state by name (``--target onnx`` takes it: tests/export/test_onnx_target_state.py); ``--fp16`` and int4
(RTN, on both graph sets) pass their parity. The traced mixer itself: tests/export/test_recurrent_state.py."""

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
from kiln.errors import ArtifactError
from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.artifacts.structure import structure_problems
from kiln.exporter.check import check_dir
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.exporter.serving.genai import genai_config
from kiln.exporter.support import refusal
from kiln.plugins.hf.build import tiny_model, tiny_transformers
from kiln_testing import assert_greedy_equals_hf, assert_int4_generation, assert_kiln_generate

KERNEL, CONV, HEADS, HEAD_DIM, SIZE = 4, 160, 8, 16, 16  # plugins/hf/tiny_recurrent.py's mamba2
SHAPES = {"conv": (1, KERNEL, CONV), "ssm": (HEADS, HEAD_DIM, SIZE)}
STEPS = 16


def _save(directory: Path) -> Path:
    tiny_transformers("mamba2", seed=1).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("state")
    ckpt = _save(root / "ckpt")
    result = export(ckpt, root / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8, triton="mamba2"))
    assert result.parity.passed, result.parity.failures()
    return ckpt, root / "out"


def test_the_graphs_and_the_manifest_carry_the_state(mamba2: tuple[Path, Path]) -> None:
    manifest = manifest_mod.read(mamba2[1])
    cache = manifest.kv_cache
    assert cache.kind == "state", cache
    assert [(t.layer, t.name, t.heads, t.length, t.width, t.span) for t in cache.tensors or ()] == [
        (i, name, *shape, "state") for i in range(2) for name, shape in SHAPES.items()
    ]
    fixed = {f"{i}.{n}": ["batch", *shape] for i in range(2) for n, shape in SHAPES.items()}
    for kind in (GraphKind.PREFILL, GraphKind.DECODE, GraphKind.UNIFIED):
        graph = manifest.graph(kind)
        pasts = {t.name: list(t.shape) for t in graph.inputs if t.name.startswith("past_key_values.")}
        presents = {t.name: list(t.shape) for t in graph.outputs if t.name.startswith("present.")}
        assert presents == {f"present.{k}": v for k, v in fixed.items()}, (kind, presents)
        assert pasts == ({} if kind is GraphKind.PREFILL else {f"past_key_values.{k}": v for k, v in fixed.items()})
    raw = json.loads((mamba2[1] / "manifest.json").read_text())
    validator = Draft202012Validator(
        json.loads(resources.files("kiln.exporter.artifacts").joinpath("manifest.schema.json").read_text())
    )
    assert [e.message for e in validator.iter_errors(raw)] == []
    del raw["kv_cache"]["tensors"][0]["length"]  # a state tensor must give its length
    assert [e.message for e in validator.iter_errors(raw)] != []
    assert not (mamba2[1] / "onnx" / "genai_config.json").exists()
    with pytest.raises(ArtifactError, match="genai: no genai_config.json for a state cache .*keys and values only"):
        genai_config(manifest)


def test_kiln_verify_and_check_pass_and_verify_names_a_wrong_length(mamba2: tuple[Path, Path]) -> None:
    result = CliRunner().invoke(main, ["verify", str(mamba2[1])])
    assert result.exit_code == 0, result.output
    assert check_dir(mamba2[1]).passed
    manifest = manifest_mod.read(mamba2[1])
    tensors = manifest.kv_cache.tensors or ()
    wrong = dataclasses.replace(
        manifest,
        kv_cache=dataclasses.replace(
            manifest.kv_cache, tensors=(dataclasses.replace(tensors[0], length=3), *tensors[1:])
        ),
    )
    problems = structure_problems(mamba2[1], wrong)
    assert any(
        "kv_cache.tensors gives present.0.conv a length of 3, but graph onnx/prefill.onnx has 4" in p for p in problems
    ), problems


def test_greedy_tokens_equal_transformers_generate(mamba2: tuple[Path, Path]) -> None:
    """kiln's ORT runner on prefill + decode, batch 1 and a left-padded batch of two."""
    assert_greedy_equals_hf(*mamba2, STEPS, unified=False)


def test_kiln_generate_equals_transformers_generate(mamba2: tuple[Path, Path]) -> None:
    assert_kiln_generate(*mamba2, [5, 17, 33, 9, 101, 64, 3, 88, 12], STEPS)


def test_the_triton_states_are_the_fixed_shapes_from_zeros(mamba2: tuple[Path, Path]) -> None:
    text = "\n".join(p.read_text() for p in (mamba2[1] / "triton").rglob("config.pbtxt"))
    for i in range(2):
        for name, shape in SHAPES.items():
            state = text[text.index(f'input_name: "past_key_values.{i}.{name}"') :][:400]
            dims = f"dims: [ {', '.join(map(str, shape))} ]"
            assert state.count(dims) == 2 and "zero_data: true" in state, state


def test_the_onnx_target_takes_the_state() -> None:
    spec = tiny_model("mamba2", seed=0).spec  # its graphs: tests/export/test_onnx_target_state.py
    assert refusal(spec, {"target": "onnx"}) is None
    assert refusal(spec, {"target": "ort"}) is None and refusal(spec, {}) is None


@pytest.mark.slow
def test_fp16_and_int4_pass_their_parity(tmp_path: Path) -> None:
    """--fp16 (its own parity), and int4 RTN on the portable graphs and --target ort, against
    PyTorch on the same int4 weights (``assert_int4_generation``)."""
    ckpt = _save(tmp_path / "ckpt")
    fp16 = export(
        ckpt, tmp_path / "out16", ExportOptions.from_flags(max_batch=4, parity_tokens=8, precision=Precision.FP16)
    )
    assert fp16.parity.passed, fp16.parity.failures()
    assert [t.dtype for t in fp16.manifest.graph(GraphKind.DECODE).inputs if t.name.endswith(".ssm")] == ["float16"] * 2
    int4 = assert_int4_generation(ckpt, tmp_path / "out4", STEPS)
    assert int4.manifest.kv_cache.kind == "state"
