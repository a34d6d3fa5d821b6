"""One registry shape (``kiln.registry``, issue 42) for the targets, the precision kinds and the model
families: names first, each entry imported when first asked, and another package's entries
through the ``kiln.targets``, ``kiln.precisions`` and ``kiln.plugins`` entry-point groups (those
of ``kiln.plugins``: ``test_plugins``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kiln.exporter.precision.kinds.registry as kinds_registry
import kiln.exporter.targets as targets_registry
from kiln.errors import ConfigError
from kiln.registry import Registry

PACKAGE = """
import dataclasses
from typing import ClassVar

from kiln.exporter.precision.kinds.base import PrecisionKind, Role
from kiln.exporter.tolerance import Tolerance
from kiln.registry import Flag


class Note:
    name = "note"
    label = "note-target"
    description = "a target another package registers"
    kv_caches = ()
    flags = (Flag("--note-loud", "note_loud", is_flag=True, help="With --target note: loudly."),)
    letter = "n"
    lora_slots = False

    def reasons(self, spec, options):
        loud = options.target_flags.get("note_loud")
        return ["--note-loud only applies to --target note"] if loud and not self.wanted(options) else []

    def wanted(self, options):
        return options.target == self.name

    def serves_genai(self, precision):
        return False

    def write(self, given): ...
    def runner(self, paths, extra_feeds): ...
    def quantized_precision(self, precision): ...


NOTE = Note()


@dataclasses.dataclass(frozen=True)
class Wide(PrecisionKind):
    name: ClassVar[str] = "wide"
    role: ClassVar[Role] = Role.FLOAT
    machinery: ClassVar[str] = __name__
    help: ClassVar[str] = "Wide floats (another package's kind)."
    bytes_per_weight: ClassVar[float] = 8.0
    tolerance: ClassVar[Tolerance] = Tolerance(
        logits_atol=1e-6, logits_rtol=1e-6, kv_atol=1e-6, kv_rtol=1e-6, min_cosine=0.999999
    )
"""


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An installed package adding a target and a precision kind through entry points."""
    site = tmp_path / "site"
    info = site / "kiln_note-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "kiln_note.py").write_text(PACKAGE)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kiln-note\nVersion: 0.1\n")
    entries = "[kiln.targets]\nnote = kiln_note:NOTE\n\n[kiln.precisions]\nwide = kiln_note:Wide\n"
    (info / "entry_points.txt").write_text(entries)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(targets_registry, "TARGETS", targets_registry.TARGETS.fresh())
    monkeypatch.setattr(kinds_registry, "KINDS", kinds_registry.KINDS.fresh())
    yield site
    sys.modules.pop("kiln_note", None)


def test_entry_points_add_a_target_and_a_kind(site: Path) -> None:
    assert targets_registry.names() == ("ort", "onnx", "note")
    assert targets_registry.target("note").label == "note-target"
    assert [k.name for k in kinds_registry.kinds()] == ["fp16", "int8", "fp8", "int4", "wide"]
    assert kinds_registry.kind("wide").help == "Wide floats (another package's kind)."


def test_the_cli_builds_its_options_from_the_registries(site: Path) -> None:
    """In a fresh interpreter, as a user runs it: the package's target is a --target choice, its flag
    and the package's kind are options of kiln export, and its flag is refused without its target."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    run = [sys.executable, "-m", "kiln.cli", "export"]
    shown = subprocess.run([*run, "--help"], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert shown.returncode == 0, shown.stderr
    help_text = " ".join(shown.stdout.split())
    assert "[portable|ort|onnx|note]" in help_text, help_text
    assert "note: a target another package registers." in help_text
    assert "--note-loud With --target note: loudly." in help_text
    assert "--wide Wide floats (another package's kind)." in help_text
    args = [*run, "--model", "demo", "--out", str(site / "out"), "--note-loud"]
    refused = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert refused.returncode == 1, refused.stderr
    assert refused.stderr.strip().endswith("error: config: --note-loud only applies to --target note"), refused.stderr


def test_an_entry_point_that_is_not_a_target(site: Path) -> None:
    (site / "kiln_note-0.1.dist-info" / "entry_points.txt").write_text("[kiln.targets]\nbad = json:dumps\n")
    with pytest.raises(ConfigError, match=r"^config: entry point 'bad' \(json:dumps\) does not provide a kiln target$"):
        targets_registry.targets()


def test_an_entry_point_named_otherwise_than_its_target(site: Path) -> None:
    (site / "kiln_note-0.1.dist-info" / "entry_points.txt").write_text("[kiln.targets]\nquiet = kiln_note:NOTE\n")
    named = r"entry point 'quiet' \(kiln_note:NOTE\) provides a target named 'note'; name the entry point so$"
    with pytest.raises(ConfigError, match=named):
        targets_registry.target("quiet")


def test_an_entry_point_may_not_take_a_built_in_name(site: Path) -> None:
    (site / "kiln_note-0.1.dist-info" / "entry_points.txt").write_text("[kiln.targets]\nort = kiln_note:NOTE\n")
    taken = r"entry point 'ort' \(kiln_note:NOTE\) of kiln.targets: kiln already has a target named 'ort'$"
    with pytest.raises(ConfigError, match=taken):
        targets_registry.names()


def test_entries_load_when_first_asked() -> None:
    far = {"far": "kiln_no_such_module:THING"}
    registry: Registry[object] = Registry("thing", "kiln.test-nothing", far, lambda obj: obj)
    assert registry.names() == ("far",) and "far" in registry and "near" not in registry  # nothing imported yet
    with pytest.raises(ModuleNotFoundError, match="kiln_no_such_module"):
        registry.get("far")
    with pytest.raises(KeyError):
        registry.get("near")


def test_a_second_entry_under_a_taken_name_is_refused() -> None:
    dumps = {"json": "json:dumps"}
    registry: Registry[object] = Registry("thing", "kiln.test-nothing", dumps, lambda obj: obj, named=False)
    registry.register("one", registry)
    registry.register("one", registry)  # the same again: no change
    with pytest.raises(ValueError, match="^a thing named 'one' is already registered$"):
        registry.register("one", object())
    with pytest.raises(ValueError, match="^a thing named 'json' is already registered$"):
        registry.register("json", "json:loads")
    registry.forget("one")
    assert registry.names() == ("json",) and registry.get("json").__name__ == "dumps"  # type: ignore[attr-defined]
    assert registry.fresh().names() == ("json",)
