"""Adding a precision is its file and one registration (issue 22): ``Toy``, a kind declared in this
file with this module as its machinery and registered by one entry (``registry.KINDS.register``), exports
the tiny model end to end: its flag parsed, its option checked, its pass run on every graph and
reported in the manifest, its record written, its tolerance judging parity, and ``kiln check``
re-running it, with nothing of kiln's own code changed."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import onnx_ir as ir
import pytest

from kiln.errors import ConfigError
from kiln.exporter.check import check_dir
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.exporter.plan import plan
from kiln.exporter.precision.context import PrecisionContext
from kiln.exporter.precision.kinds import Fp16, registry
from kiln.exporter.precision.kinds.base import Asked, Flag, GraphReports, PrecisionKind, Prepared, Role
from kiln.exporter.tolerance import Tolerance
from kiln.plugins.base import DecoderSpec
from kiln_testing import tiny_config, write_checkpoint

TOY_TOLERANCE = Tolerance(logits_atol=2e-5, logits_rtol=2e-4, kv_atol=2e-5, kv_rtol=2e-4, min_cosine=0.99999)


@dataclasses.dataclass(frozen=True)
class Toy(PrecisionKind):
    """A MatMuls' kind that computes them as fp32 does (its pass only counts them)."""

    strict: bool = False  # --toy-strict: refuse a model with fewer than 100 MatMuls

    name: ClassVar[str] = "toy"
    role: ClassVar[Role] = Role.MATMULS
    machinery: ClassVar[str] = __name__
    help: ClassVar[str] = "Toy MatMuls."
    flags: ClassVar[tuple[tuple[Flag, ...], ...]] = (
        (Flag("--toy-strict", "strict", is_flag=True, help="Be strict."),),
    )
    tolerance: ClassVar[Tolerance] = TOY_TOLERANCE
    bytes_per_weight: ClassVar[float] = 4.0

    def reasons(self, spec: DecoderSpec | None, options: Asked) -> list[str]:
        return ["--toy-strict needs --max-batch 4 or less"] if self.strict and options.graphs.max_batch > 4 else []


class CountMatMuls(ir.passes.InPlacePass):
    report_name = "toy"

    def __init__(self) -> None:
        super().__init__()
        self.count: int | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.count = sum(1 for node in model.graph if node.op_type == "MatMul")
        return ir.passes.PassResult(model, modified=False)

    @property
    def report(self) -> dict[str, Any] | None:
        return None if self.count is None else {"matmuls": self.count}


@dataclasses.dataclass(frozen=True)
class _ToyPrepared(Prepared):
    def passes(self, kind: GraphKind) -> list[ir.passes.PassBase]:
        return [CountMatMuls()]

    def record(self, reports: GraphReports) -> dict[str, Any]:
        return {"quantization": {"format": "toy", "matmuls": sum(r["toy"]["matmuls"] for r in reports.values())}}


def prepare(kind: Toy, context: PrecisionContext) -> Prepared:
    """The toy kind's machinery (this module, named by ``Toy.machinery``)."""
    return _ToyPrepared()


@pytest.fixture
def toy_registered() -> Iterator[None]:
    registry.KINDS.register("toy", Toy)  # the one registration
    yield
    registry.KINDS.forget("toy")


def test_a_new_kind_is_its_file_and_one_registration(toy_registered: None, tmp_path: Path) -> None:
    flags = {k.name: False for k in registry.kinds()} | {
        "toy": True,
        "fp16": False,
        "toy_strict": True,
        "keep_fp32": (),
        "auto_keep_fp32": False,
    }
    flags |= {
        "int8_float": (),
        "int8_all_matmuls": False,
        "fp8_float": (),
        "int4_block": "128",
        "int4_method": "gptq",
        "int4_float": (),
        "int4_all_matmuls": False,
    }
    assert Precision.from_flags(flags) is Precision.of(Toy(strict=True)) and Precision.parse("toy").value == "toy"
    assert Precision.parse("toy+fp16") is Precision.of(Fp16(), Toy())
    with pytest.raises(ConfigError, match="^config: --toy-strict needs --max-batch 4 or less$"):
        plan(ExportOptions(precision=Precision.of(Toy(strict=True))))
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    result = export(
        ckpt,
        tmp_path / "out",
        ExportOptions.from_flags(precision=Precision.of(Toy(strict=True)), max_batch=4, parity_tokens=8),
    )
    assert result.parity.passed and result.parity.precision == "toy" and result.parity.tolerance == TOY_TOLERANCE
    manifest = result.manifest.to_json()
    assert manifest["precision"] == "toy" and manifest["kv_cache"]["dtype"] == "float32"
    counts = {kind: graph["passes"]["toy"]["matmuls"] for kind, graph in manifest["graphs"].items()}
    assert set(counts) == {"prefill", "decode", "model"} and min(counts.values()) > 0
    assert manifest["export"]["quantization"] == {"format": "toy", "matmuls": sum(counts.values())}
    again = check_dir(tmp_path / "out")
    assert again.passed and again.precision == "toy" and again.tolerance == TOY_TOLERANCE
