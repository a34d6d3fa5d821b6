"""Third-party families arrive through the ``kiln.plugins`` entry-point group."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

import kiln.plugins as registry
from kiln.cli import main
from kiln.errors import CheckpointError
from kiln_testing import tiny_config

FAMILY_MODULE = """
import json
from kiln.plugins.base import LoadedModel
from kiln.plugins.native import NATIVE, spec_of
from kiln.plugins.native.build import random_model
from kiln.plugins.native.config import NativeConfig


class ToyFamily:
    name = "toy"
    description = "a family registered by another package's entry point"

    def claims(self, config):
        return config.get("architecture") == "toy-decoder"

    def load(self, path):
        data = json.loads((path / "config.json").read_text())
        data.pop("architectures", None)  # a Hugging Face-style key this family ignores
        cfg = NativeConfig.from_dict(data)
        return LoadedModel(random_model(cfg, 0), spec_of(cfg), path)

    def tiny(self, seed):
        return NATIVE.tiny(seed)


FAMILY = ToyFamily()
"""


@pytest.fixture
def toy_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An installed package (a module + its dist-info with entry_points.txt) on sys.path."""
    site = tmp_path / "site"
    (site / "kiln_toy_family-0.1.dist-info").mkdir(parents=True)
    (site / "kiln_toy_family.py").write_text(FAMILY_MODULE)
    (site / "kiln_toy_family-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kiln-toy-family\nVersion: 0.1\n"
    )
    (site / "kiln_toy_family-0.1.dist-info" / "entry_points.txt").write_text(
        "[kiln.plugins]\ntoy = kiln_toy_family:FAMILY\n"
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(registry, "FAMILIES", registry.FAMILIES.fresh())  # entry points read anew, dropped after
    yield site
    sys.modules.pop("kiln_toy_family", None)


def test_entry_point_family_is_found_and_loads(toy_package: Path, tmp_path: Path) -> None:
    assert [f.name for f in registry.families()] == ["hf", "native", "toy"]
    ckpt = tmp_path / "toy-ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({**tiny_config().to_dict(), "architecture": "toy-decoder"}))
    loaded = registry.load_model(ckpt)
    assert type(loaded.module).__name__ == "PLEDecoder" and loaded.spec.n_layers == 2
    listed = CliRunner().invoke(main, ["plugins"])
    assert "toy" in listed.stdout and "kiln_toy_family" in listed.stdout


def test_entry_point_that_is_not_a_family(toy_package: Path) -> None:
    (toy_package / "kiln_toy_family-0.1.dist-info" / "entry_points.txt").write_text(
        "[kiln.plugins]\nbad = json:dumps\n"
    )
    from kiln.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"entry point 'bad' \(json:dumps\) does not provide a kiln ModelFamily"):
        registry.families()


def test_a_third_party_family_claims_before_the_built_in_ones(toy_package: Path, tmp_path: Path) -> None:
    """The toy family sorts after "hf" by name, yet it is asked first: a Hugging Face-style
    config (it has ``architectures``, which hf would take) that the toy family claims is its."""
    assert [f.name for f in registry.claim_order()] == ["toy", "native", "hf"]
    ckpt = tmp_path / "toy-hf-style"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(
        json.dumps({**tiny_config().to_dict(), "architecture": "toy-decoder", "architectures": ["ToyForCausalLM"]})
    )
    loaded = registry.load_model(ckpt)
    assert type(loaded.module).__name__ == "PLEDecoder"  # not hf's "unsupported Hugging Face architecture"
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["ToyForCausalLM"]}))
    with pytest.raises(CheckpointError, match=r"unsupported Hugging Face architecture 'ToyForCausalLM'"):
        registry.load_model(ckpt)  # what the toy family does not claim still reaches hf
