"""The pipeline reads the plan it is given (``exporter.plan``, issue 42): the targets an
``ExportPlan`` names are the ones written, each once, whatever the options would ask of the
registry again; and the model's round is asked when the plan comes without one."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import onnx_ir as ir
import pytest

from kiln.errors import ExportError
from kiln.exporter.contract.io import CacheUpdate, GraphKind
from kiln.exporter.options import ExportOptions
from kiln.exporter.passes.weights import WeightsWriter
from kiln.exporter.pipeline import export
from kiln.exporter.plan import plan
from kiln.exporter.precision.kinds.plan import Precision
from kiln.exporter.runners import OrtRunner
from kiln.exporter.runners.base import Feeds, Runner
from kiln.exporter.targets import TARGETS
from kiln.exporter.targets.base import TargetGiven, TargetGraphs
from kiln.plugins.base import DecoderSpec
from kiln.registry import Flag
from kiln_testing import tiny_config, write_checkpoint


class PlannedOnly:
    """A target no options ask for (``wanted`` is always False): only a plan that names it gets it
    written. Its graphs are the portable ones saved again as ``<kind>.planned.onnx``; it counts its writes."""

    name = "planned"
    label = "planned-only"
    description = "written only where a plan names it"
    kv_caches: tuple[CacheUpdate, ...] = (CacheUpdate.GROWN,)
    flags: tuple[Flag, ...] = ()
    letter = "q"
    lora_slots = False

    def __init__(self) -> None:
        self.writes = 0

    def wanted(self, options: ExportOptions) -> bool:
        return False

    def reasons(self, spec: DecoderSpec | None, options: ExportOptions) -> list[str]:
        return []

    def write(self, given: TargetGiven) -> TargetGraphs:
        self.writes += 1
        paths = {kind: given.onnx_dir / f"{kind.value}.planned.onnx" for kind in given.portable}
        with WeightsWriter(given.onnx_dir / "weights.planned.bin", rename=False) as writer:
            for kind, path in given.portable.items():
                ir.save(ir.load(path), paths[kind])
            weights = writer.close()
        reports: dict[GraphKind, dict[str, object]] = {kind: {} for kind in paths}
        return TargetGraphs(self.name, given.options.precision, paths, weights, reports, CacheUpdate.GROWN)

    def runner(
        self, paths: dict[GraphKind, Path], extra_feeds: Feeds | None
    ) -> Callable[[], contextlib.AbstractContextManager[Runner]]:
        return OrtRunner.opener(paths, extra_feeds)

    def serves_genai(self, precision: Precision) -> bool:
        return False

    def quantized_precision(self, precision: Precision) -> Precision | None:
        return None


@pytest.fixture
def planned_only() -> Iterator[PlannedOnly]:
    made = PlannedOnly()
    TARGETS.register(made.name, made)
    yield made
    TARGETS.forget(made.name)


def test_the_pipeline_writes_the_plan_s_targets_once(planned_only: PlannedOnly, tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    options = ExportOptions.from_flags(max_batch=2, parity_tokens=4)
    assert plan(options).targets == (), "the options alone ask for no target"
    planned = dataclasses.replace(plan(options), targets=(planned_only,))
    result = export(ckpt, tmp_path / "out", planned)
    assert planned_only.writes == 1, planned_only.writes
    assert result.parity.passed and set(result.parity.targets) == {"planned"}, result.parity.failures()
    assert sorted(p.name for p in (tmp_path / "out" / "onnx").glob("*.planned.onnx")) == [
        "decode.planned.onnx",
        "model.planned.onnx",
        "prefill.planned.onnx",
    ]


def test_a_plan_given_without_the_model_is_sized_against_it(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    with pytest.raises(ExportError, match=r"^export: --max-context 100000 exceeds the model's max_context \d+$"):
        export(ckpt, tmp_path / "out", plan(ExportOptions.from_flags(max_context=100_000)))
    assert not (tmp_path / "out").exists()
