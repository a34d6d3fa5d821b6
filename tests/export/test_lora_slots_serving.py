"""LoRA slots and Triton: refused, by ``kiln export --triton`` and ``kiln triton`` alike, with one reason.

Every model kiln writes for Triton batches (``max_batch_size > 0``): Triton adds a batch dim to
each input, and its ONNX Runtime and TensorRT backends require the graph's first dim to be that
batch, while a slot's A [in, r] / B [r, out] has none and one run applies one adapter to the whole
batch (``exporter/serving/triton.py``, module docstring). The tests export a tiny Llama with slots,
check that premise on its graph, and that neither command writes a repository that could not load.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from kiln.errors import ConfigError
from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.artifacts.verify import verify_dir
from kiln.exporter.options import LORA_TRITON_REASON, ExportOptions
from kiln.exporter.pipeline import export
from kiln.exporter.serving.triton import TRITON_DIR, triton_models
from kiln_testing import config_error, save_base


@pytest.fixture(scope="module")
def slotted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("slots_serving")
    ckpt = save_base("llama", root / "ckpt")
    out = root / "out"
    result = export(ckpt, out, ExportOptions.from_flags(max_batch=4, parity_tokens=8, lora_slots=8))
    assert result.parity.passed, result.parity.failures()
    return out


def test_export_with_triton_is_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        ExportOptions.from_flags(max_batch=4, parity_tokens=8, lora_slots=8, triton="m")
    assert str(refused.value) == f"config: --lora-slots with --triton: {LORA_TRITON_REASON}"
    ckpt = save_base("llama", tmp_path / "ckpt")
    line = config_error(
        "export", "--model", str(ckpt), "--out", str(tmp_path / "x"), "--lora-slots", "8", "--triton", "m"
    )
    assert line == f"--lora-slots with --triton: {LORA_TRITON_REASON}"
    assert not (tmp_path / "x").exists()


def test_the_slot_inputs_have_no_batch_dim(slotted: Path) -> None:
    """The premise of the refusal, on the graph Triton would serve (model.onnx): the slots' first
    dim is a fixed feature count, not the batch Triton would add."""
    manifest = manifest_mod.read(slotted)
    assert manifest.lora is not None
    graph = onnx.load(str(slotted / manifest.graphs["model"].file), load_external_data=False)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.graph.input}
    for slot in manifest.lora.slots:
        assert dims[slot.a] == [slot.in_features, slot.rank_dim] and dims[slot.b] == [slot.rank_dim, slot.out_features]
    assert dims["input_ids"][0] == "batch"


def test_kiln_triton_refuses_a_slotted_export(slotted: Path) -> None:
    line = config_error("triton", str(slotted), "--name", "m")
    assert line == f"triton: {slotted} was exported with --lora-slots: {LORA_TRITON_REASON}"
    assert not (slotted / TRITON_DIR).exists()
    assert verify_dir(slotted).ok  # nothing written, nothing recorded
    with pytest.raises(ConfigError, match="was exported with --lora-slots"):
        triton_models(slotted, manifest_mod.read(slotted), "m")
