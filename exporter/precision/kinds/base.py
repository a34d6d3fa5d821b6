"""What a precision kind is (docs/precisions.md): one kind of number the graphs compute in, with
its own options, checks, passes, calibration needs, tolerances, manifest record and GPU need.

An export's precision (``plan.Precision``) composes at most one kind per ``Role``: what the
MatMuls compute in (``int8``, ``fp8``: Q/DQ; ``int4``: weight-only) and the graphs' float type
(``fp16``; none: fp32). A kind is a frozen dataclass whose fields are its own options (its CLI
flags fill them: ``flags``), registered in ``kinds`` (one line each); nothing outside its files
names it. Its declaration is light (the CLI reads it before anything heavy is imported); its
machinery (``machinery``: the module of its passes) is imported by ``prepare``.

Its life in an export:

- ``check(options)`` refuses, in one ``ConfigError``, what it cannot do with the export's other
  options; ``refuse(spec)`` a model it cannot be applied to, before any work is done;
- ``needs()`` says which calibration data it reads (the pipeline prepares activation ranges
  once for every kind that needs them);
- ``prepare(context)`` computes what it needs once per export with the model at hand (the fp16
  policy widened by the sensitivity search, int4's quantizer, ...) as a ``Prepared``, whose
  ``passes(kind)`` are its graph passes for one graph (the plan runs the MatMuls' kind first,
  then the float type), ``checks(kind)`` its checks after every kind's passes, and ``record``
  and ``extras`` what the manifest's ``export`` section and the parity report show of it;
- ``tolerance`` are the figures its graphs are judged by; ``min_compute_capability`` the GPUs
  TensorRT builds it for; ``bytes_per_weight`` the fewest bytes a weight takes in its graphs.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from kiln.errors import ConfigError
from kiln.exporter.tolerance import Tolerance

if TYPE_CHECKING:
    import onnx_ir as ir
    from kiln.exporter.contract.io import GraphIO, GraphKind
    from kiln.exporter.load import Reference
    from kiln.exporter.options import ExportOptions
    from kiln.exporter.precision.kinds.plan import Precision
    from kiln.exporter.progress import Progress
    from kiln.plugins.base import DecoderSpec

__all__ = ["Role", "Needs", "Flag", "PrecisionKind", "PrecisionContext", "Prepared", "GraphReports", "Ranges", "RangesKind", "check_ranges", "refuse_encoder"]

GraphReports = Mapping["GraphKind", Mapping[str, Any]]  # per graph, what its passes report (``passes.reports``)
Ranges = dict[str, tuple[float, float]]  # tensor -> calibrated (lo, hi)
_CALIB_METHODS = ("max", "percentile", "entropy", "mse")
_MIN_RANGES_OPSET = 19  # Q/DQ with fp16 scales


class Role(enum.Enum):
    MATMULS = "matmuls"  # what the MatMuls compute in: int8/fp8 Q/DQ, int4 weight-only (one kind at most)
    FLOAT = "float"  # the graphs' float type: fp16 (none: fp32)


class Needs(enum.Enum):
    """The calibration data a kind reads."""

    NOTHING = "nothing"
    RANGES = "ranges"  # each graph's activation ranges (``calibration.Calibration``)
    HESSIANS = "hessians"  # each weight's input Hessian through PyTorch (GPTQ)


@dataclasses.dataclass(frozen=True)
class Flag:
    """One CLI option of a kind besides ``--NAME``, filling one field of it (``cli_options``
    makes it a click option; its click parameter is ``dest``)."""

    option: str  # "--int8-float"
    field: str  # the kind's field it fills
    help: str
    multiple: bool = False
    is_flag: bool = False
    choices: tuple[str, ...] = ()
    default: str | None = None  # a choice's default, as typed
    metavar: str | None = None
    convert: Callable[[Any], Any] | None = None  # the typed text -> the field's value

    @property
    def dest(self) -> str:
        return self.option.removeprefix("--").replace("-", "_")

    def given(self, value: Any) -> bool:
        """Whether ``value`` (click's) is more than the option's default."""
        return bool(value) if self.multiple or self.is_flag else value is not None and value != self.default


@dataclasses.dataclass(frozen=True)
class PrecisionContext:
    """What a kind's ``prepare`` is given: the model and what the pipeline has made of it."""

    reference: Reference
    options: ExportOptions
    progress: Progress
    ranges: Callable[[GraphKind, ir.Model], Ranges] | None  # ``Needs.RANGES``: a graph's calibrated activation ranges
    contract_io: Callable[[GraphKind, str], GraphIO]  # a graph's contract I/O at a KV dtype
    fp32_graph: Callable[[GraphKind], ir.Model]  # a graph in fp32, as the portable set derives it

    @property
    def precision(self) -> Precision:
        return self.options.precision


class Prepared(abc.ABC):
    """A kind prepared for one export."""

    @abc.abstractmethod
    def passes(self, kind: GraphKind) -> list[ir.passes.PassBase]:
        """Its passes of one graph."""

    def checks(self, kind: GraphKind) -> list[ir.passes.PassBase]:
        """Its checks of one graph, after every kind's passes."""
        return []

    def record(self, reports: GraphReports) -> Mapping[str, Any]:
        """What the manifest's ``export`` section records of it (``keep_fp32``, ``quantization``)."""
        return {}

    def extras(self, reports: GraphReports) -> Mapping[str, Any]:
        """What the parity report shows of it besides the checks."""
        return {}


@dataclasses.dataclass(frozen=True)
class PrecisionKind(abc.ABC):
    """One precision kind; its fields are its options."""

    name: ClassVar[str]  # --NAME, its passes' report name and its part of the precision's name
    role: ClassVar[Role]
    machinery: ClassVar[str]  # the module whose ``prepare(kind, context)`` prepares it (its passes live there)
    help: ClassVar[str]  # --NAME's help
    flags: ClassVar[tuple[tuple[Flag, ...], ...]] = ()  # its options, in groups (given without --NAME, a group is refused in one line)
    tolerance: ClassVar[Tolerance]
    bytes_per_weight: ClassVar[float]  # the fewest bytes a weight takes in its graphs (the disk precheck)
    implies: ClassVar[tuple[str, ...]] = ()  # kinds it comes with (fp8: fp16), not named in the precision's name
    min_opset: ClassVar[int] = 0  # its graphs are written at this opset at least (int4: 21)
    min_compute_capability: ClassVar[tuple[int, int, str] | None] = None  # TensorRT builds it on these GPUs only
    weight_only: ClassVar[bool] = False  # activations stay float: its graphs are also judged against PyTorch on its numbers
    full_check: ClassVar[bool] = False  # onnx.checker's full check on every graph it wrote
    calibration_use: ClassVar[str | None] = None  # how --calib-data's refusal names it ("--int4 (method gptq)")
    default_windows: ClassVar[int] = 32  # calibration windows when --calib-samples is not given

    def needs(self) -> Needs:
        return Needs.NOTHING

    def check(self, options: ExportOptions) -> None:
        """Refuse, in one ``ConfigError``, what it cannot do with ``options``."""

    def refuse(self, spec: DecoderSpec, options: ExportOptions) -> None:
        """Refuse, in one ``ConfigError``, a model it cannot be applied to."""

    def prepare(self, context: PrecisionContext) -> Prepared:
        """What it computes once per export (the model at hand), as a ``Prepared``: its machinery
        module's ``prepare(kind, context)``, imported only now (the declaration stays light, and
        the machinery, which reads the model and the passes, sits above what imports the options)."""
        prepared: Prepared = importlib.import_module(self.machinery).prepare(self, context)
        return prepared

    @classmethod
    def flag(cls) -> str:
        return f"--{cls.name}"


class RangesKind(PrecisionKind):
    """A kind that quantizes activations by calibrated ranges (int8, fp8): it reads them, checks
    the calibration options, and refuses encoder-decoders and cross-attention decoders."""

    def needs(self) -> Needs:
        return Needs.RANGES

    def check(self, options: ExportOptions) -> None:
        check_ranges(self.flag(), options)

    def refuse(self, spec: DecoderSpec, options: ExportOptions) -> None:
        refuse_encoder(spec, options)
        if spec.encoder_dim is not None:  # --fp8 was not refused here: its calibration failed with a traceback (no encoder_hidden_states)
            raise ConfigError(
                f"{self.flag()} is not supported for cross-attention decoders yet: calibration needs encoder_hidden_states"
                " samples, which kiln's calibration data formats do not carry; export --fp16 or fp32"
            )


def check_ranges(flag: str, options: ExportOptions) -> None:
    """The calibration options of a kind that reads activation ranges (``Needs.RANGES``)."""
    if options.calib_data is None:
        raise ConfigError(f"{flag} needs --calib-data: a text file, .jsonl (field 'text'), .npy/.npz token ids, or 'synthetic'")
    if options.opset < _MIN_RANGES_OPSET:
        raise ConfigError(f"{flag} needs --opset {_MIN_RANGES_OPSET} or later (fp16 Q/DQ scales), found {options.opset}")
    if options.calib_method not in _CALIB_METHODS:
        raise ConfigError(f"--calib-method must be one of {', '.join(_CALIB_METHODS)}, found {options.calib_method!r}")
    if not 0.0 < options.calib_percentile <= 100.0:
        raise ConfigError(f"--calib-percentile must be in (0, 100], found {options.calib_percentile}")


def refuse_encoder(spec: DecoderSpec, options: ExportOptions) -> None:
    """A kind that reads calibration data (ranges or GPTQ's) refuses encoder-decoders."""
    if spec.has_encoder:
        raise ConfigError(
            f"{options.precision.value} exports are not supported for encoder-decoders yet: calibration and GPTQ run decoder-only"
            " prompts, with no encoder inputs; export --fp16 or fp32"
        )
