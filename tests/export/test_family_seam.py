"""Adding a model family is its folder and one registration (issue 42): ``ToyFamily``, a family
declared in this file (its folder) and registered by one entry (``plugins.FAMILIES.register``),
claims checkpoints whose config says ``"architecture": "toy-decoder"`` (kiln's own decoder under
another name: its module and weights, its spec its own) and exports one end to end: it claims
before the built-in families, its graphs pass parity, the manifest records it, and ``kiln check``
loads the checkpoint through it again and passes, with nothing of kiln's own code changed. Without
the registration the same checkpoint is refused by name. What ``--target onnx`` asks of a family's
recurrent state and of its sliding window is the family's declaration (``DecoderSpec.static_state``,
``DecoderSpec.sliding_window_proved``), never its name: a registered family that declares one is
named among the proved ones."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.errors import CheckpointError, ConfigError
from kiln.exporter.check import check_dir
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.exporter.support import refusal
from kiln.plugins import FAMILIES, claim_order, families, load_model
from kiln.plugins.base import DecoderSpec, LoadedModel, ModelFamily, StaticStateProof
from kiln_testing import tiny_config, write_checkpoint

ARCHITECTURE = "toy-decoder"


class ToyFamily:
    """Kiln's native decoder read from a checkpoint whose config names ``toy-decoder``."""

    name = "toy"
    description = "kiln's decoder under another name (config.json with architecture 'toy-decoder')"

    def claims(self, config: dict[str, Any]) -> bool:
        return config.get("architecture") == ARCHITECTURE

    def load(self, path: Path) -> LoadedModel:
        from kiln.plugins.native.build import load

        return self._own(load(path))

    def tiny(self, seed: int) -> LoadedModel:
        from kiln.plugins.native import NATIVE

        return self._own(NATIVE.tiny(seed))

    def _own(self, loaded: LoadedModel) -> LoadedModel:
        """The native model with this family's name and architecture in its spec."""
        config = {**loaded.spec.config, "architecture": ARCHITECTURE}
        return dataclasses.replace(loaded, spec=dataclasses.replace(loaded.spec, family=self.name, config=config))


TOY = ToyFamily()


@pytest.fixture
def toy_registered() -> Iterator[None]:
    FAMILIES.register(TOY.name, TOY)  # the one registration
    yield
    FAMILIES.forget(TOY.name)


def _toy_checkpoint(directory: Path) -> Path:
    """A tiny native checkpoint whose config names the toy family's architecture."""
    ckpt = write_checkpoint(directory, tiny_config())
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architecture": ARCHITECTURE}))
    return ckpt


def test_an_unregistered_family_is_refused_by_name(tmp_path: Path) -> None:
    ckpt = _toy_checkpoint(tmp_path / "ckpt")
    with pytest.raises(
        CheckpointError, match=f"unknown architecture '{ARCHITECTURE}'; supported families: hf, native$"
    ):
        load_model(ckpt)


def test_a_new_family_is_its_folder_and_one_registration(toy_registered: None, tmp_path: Path) -> None:
    assert isinstance(TOY, ModelFamily) and TOY in families() and claim_order()[0] is TOY, claim_order()
    ckpt = _toy_checkpoint(tmp_path / "ckpt")
    assert load_model(ckpt).spec.family == "toy"
    result = export(ckpt, tmp_path / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8))
    assert result.parity.passed and result.parity.generation, result.parity.failures()
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["family"] == "toy" and result.manifest.family == "toy", manifest["family"]
    again = check_dir(tmp_path / "out")  # loads the checkpoint through the toy family again
    assert again.passed and again.generation, again.failures()


class StateFamily(ToyFamily):
    """A family of one structure, whose proofs (a recurrent state's, a window's) it declares for ``--target onnx``."""

    name = "toy-state"

    def __init__(self, spec: DecoderSpec) -> None:
        self.spec = spec

    def claims(self, config: dict[str, Any]) -> bool:
        return False

    def specs(self) -> list[DecoderSpec]:
        return [self.spec]


def test_the_onnx_target_asks_the_family_what_its_state_proves() -> None:
    pytest.importorskip("transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])")
    from kiln.plugins.hf import tiny_model

    spec = tiny_model("mamba", seed=0).spec  # Mamba v1: its family declares no proof on the onnx target
    onnx = {"target": "onnx"}
    assert spec.static_state is None and "this MambaForCausalLM model is not one" in (refusal(spec, onnx) or "")
    declared = dataclasses.replace(spec, static_state=StaticStateProof(precisions=("fp32",)))
    assert refusal(declared, onnx) is None
    why = refusal(declared, {**onnx, "precision": Precision.FP16}) or ""
    assert "(state cache) at fp32 only, each proved by a test; export MambaForCausalLM at fp16" in why, why
    unparsed = dataclasses.replace(spec, static_state=StaticStateProof(unparsed="its trace holds an op"))
    why = refusal(unparsed, onnx) or ""
    assert "--target onnx does not write MambaForCausalLM: its trace holds an op; the portable graphs" in why, why
    other = dataclasses.replace(declared, family="toy-state", config={**spec.config, "architecture": "ToyState"})
    FAMILIES.register("toy-state", StateFamily(other))  # one registration adds it to the proved ones
    try:
        why = refusal(spec, onnx) or ""
    finally:
        FAMILIES.forget("toy-state")
    assert "only for Mamba2ForCausalLM, BambaForCausalLM, Lfm2ForCausalLM, ToyState, each proved" in why, why


def test_the_onnx_target_asks_the_family_whether_its_window_is_proved() -> None:
    from kiln.exporter.targets.onnx.windows import layer_windows

    spec = DecoderSpec("toy-window", 2, 1, 8, 32, 64, config={"architecture": "ToyWindow", "sliding_window": 4})
    with pytest.raises(ConfigError) as err:
        layer_windows(spec)  # a family that declares nothing: refused, and not among the proved ones
    assert (
        "Gemma3ForConditionalGeneration, Mistral3ForConditionalGeneration, each proved by a test; this ToyWindow model "
        "has a 4-token" in str(err.value)
    )
    declared = dataclasses.replace(spec, sliding_window_proved=True)
    assert layer_windows(declared) == {0: 4, 1: 4}
    FAMILIES.register("toy-state", StateFamily(declared))  # one registration adds it to the proved ones
    try:
        with pytest.raises(ConfigError) as err:
            layer_windows(dataclasses.replace(spec, config={"sliding_window": 8}))
    finally:
        FAMILIES.forget("toy-state")
    assert "Mistral3ForConditionalGeneration, ToyWindow, each proved by a test; this toy-window model has a 8" in str(
        err.value
    )
