"""Adding a target is its folder and one registration (issue 42): ``Toy``, a target declared in this
file (its folder) and registered by one entry (``targets.TARGETS.register``), with one flag of its
own, is a ``--target`` choice with its flag in the CLI, is asked by the plan stage with every
other refusal, and exports the tiny model end to end: its graphs (copies of the portable ones)
written, parity-checked, recorded in the manifest, and run again by ``kiln check``, with nothing
of kiln's own code changed."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import onnx_ir as ir
import pytest

from kiln import cli_options
from kiln.errors import ConfigError
from kiln.exporter import support
from kiln.exporter.check import check_dir
from kiln.exporter.contract.io import CacheUpdate, GraphKind
from kiln.exporter.options import ExportOptions
from kiln.exporter.passes.weights import WeightsWriter
from kiln.exporter.pipeline import export
from kiln.exporter.plan import plan
from kiln.exporter.precision.kinds.plan import Precision
from kiln.exporter.runners import OrtRunner
from kiln.exporter.runners.base import Feeds, Runner
from kiln.exporter.targets import TARGETS, names, targets
from kiln.exporter.targets.base import TargetGiven, TargetGraphs
from kiln.plugins.base import DecoderSpec
from kiln.registry import Flag
from kiln_testing import tiny_config, write_checkpoint

STRICT = Flag("--toy-strict", "toy_strict", is_flag=True, help="With --target toy: at most 4 layers.")
Opened = contextlib.AbstractContextManager[Runner]  # what a runner opener opens


class ToyTarget:
    """The identity target: its graphs are the portable ones, saved again as ``<kind>.toy.onnx``
    (their weights stay in the portable weights file; its own weights file holds none)."""

    name = "toy"
    label = "toy-target"
    description = "also write toy-target graphs (onnx/*.toy.onnx: the portable graphs, unchanged)"
    kv_caches: tuple[CacheUpdate, ...] = (CacheUpdate.GROWN,)
    flags: tuple[Flag, ...] = (STRICT,)
    letter = "t"
    lora_slots = False

    def wanted(self, options: ExportOptions) -> bool:
        return options.target == self.name

    def reasons(self, spec: DecoderSpec | None, options: ExportOptions) -> list[str]:
        strict = bool(options.target_flags.get(STRICT.field))
        if strict and not self.wanted(options):
            return ["--toy-strict only applies to --target toy"]
        if strict and spec is not None and spec.n_layers > 4:
            return [f"--toy-strict: the model has {spec.n_layers} layers, more than 4"]
        return []

    def write(self, given: TargetGiven) -> TargetGraphs:
        paths = {kind: given.onnx_dir / f"{kind.value}.toy.onnx" for kind in given.portable}
        with WeightsWriter(given.onnx_dir / "weights.toy.bin", rename=False) as writer:
            for kind, path in given.portable.items():
                ir.save(ir.load(path), paths[kind])
            weights = writer.close()
        reports: dict[GraphKind, dict[str, Any]] = {kind: {} for kind in paths}
        return TargetGraphs(self.name, given.options.precision, paths, weights, reports, CacheUpdate.GROWN)

    def runner(self, paths: dict[GraphKind, Path], extra_feeds: Feeds | None) -> Callable[[], Opened]:
        return OrtRunner.opener(paths, extra_feeds)

    def serves_genai(self, precision: Precision) -> bool:
        return False

    def quantized_precision(self, precision: Precision) -> Precision | None:
        return None


TOY = ToyTarget()


@pytest.fixture
def toy_registered() -> Iterator[None]:
    TARGETS.register("toy", TOY)  # the one registration
    yield
    TARGETS.forget("toy")


def _export_params() -> dict[str, Any]:
    """``kiln export``'s target options as the CLI builds them from the registry now."""

    def command(**flags: Any) -> None: ...

    for option in cli_options._target_options():
        command = option(command)
    return {param.name: param for param in command.__click_params__}  # type: ignore[attr-defined]


def test_a_new_target_is_its_folder_and_one_registration(toy_registered: None, tmp_path: Path) -> None:
    assert names()[-1] == "toy" and targets()[-1] is TOY
    params = _export_params()
    assert "toy" in params["target"].type.choices, params["target"].type.choices
    assert "toy: also write toy-target graphs" in (params["target"].help or "")
    assert params["toy_strict"].opts == ["--toy-strict"] and params["toy_strict"].help == STRICT.help
    assert support.target_names()[-1] == "toy" and support.letter("toy") == "t"  # a column of kiln plugins' table
    assert plan(ExportOptions(target="toy")).targets == (TOY,)
    with pytest.raises(ConfigError, match="^config: --toy-strict only applies to --target toy$"):
        plan(ExportOptions(target_flags={"toy_strict": True}))
    spec = DecoderSpec(family="toy", n_layers=6, n_kv_heads=2, head_dim=8, vocab_size=32, max_context=64)
    with pytest.raises(ConfigError, match="^config: --toy-strict: the model has 6 layers, more than 4$"):
        plan(ExportOptions(target="toy", target_flags={"toy_strict": True}), spec)
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    options = ExportOptions.from_flags(target="toy", target_flags={"toy_strict": True}, max_batch=4, parity_tokens=8)
    result = export(ckpt, tmp_path / "out", options)
    assert result.parity.passed and set(result.parity.targets) == {"toy"}, result.parity.failures()
    entry = (result.manifest.targets or {})["toy"]
    assert entry.kv_cache == "grown" and entry.precision == "fp32"
    assert {kind: graph.file for kind, graph in entry.graphs.items()} == {
        kind: f"onnx/{kind}.toy.onnx" for kind in ("prefill", "decode", "model")
    }, entry.graphs
    again = check_dir(tmp_path / "out")
    assert again.passed and set(again.targets) == {"toy"}
