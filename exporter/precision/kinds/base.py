"""What a precision kind is (docs/precisions.md): one kind of number the graphs compute in, with
its own options, checks, passes, calibration needs, tolerances, manifest record and GPU need.

An export's precision (``plan.Precision``) composes at most one kind per ``Role``: what the
MatMuls compute in (``int8``, ``fp8``: Q/DQ; ``int4``: weight-only) and the graphs' float type
(``fp16``; none: fp32). A kind is a frozen dataclass whose fields are its own options (its CLI
flags fill them: ``flags``), registered in ``kinds`` (one line each); nothing outside its files
names it. Its declaration is light (the CLI reads it before anything heavy is imported); its
machinery (``machinery``: the module of its passes) is imported by ``prepare``.

Its life in an export:

- ``reasons(spec, options)`` says, one line each, what it cannot do with the export's other
  options and (given the model's ``spec``) a model it cannot be applied to: the plan stage
  (``exporter.plan``) asks it with every other refusal, before any work is done;
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
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kiln.exporter.tolerance import Tolerance
from kiln.registry import Flag  # one CLI option of a kind besides --NAME, filling one of its fields

if TYPE_CHECKING:
    import onnx_ir as ir

    from kiln.exporter.contract.io import GraphKind
    from kiln.exporter.option_groups import CalibrationOptions, GraphOptions, PLEOptions
    from kiln.plugins.base import DecoderSpec

__all__ = [
    "Role",
    "Needs",
    "Flag",
    "Asked",
    "PrecisionKind",
    "Prepared",
    "GraphReports",
    "Ranges",
    "RangesKind",
    "encoder_reason",
    "ranges_reasons",
    "kind_options",
    "with_kind_options",
]

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


class Named(Protocol):
    @property
    def value(self) -> str: ...


class Asked(Protocol):
    """What a kind's ``reasons`` read of the export's options (``exporter.options.ExportOptions``
    is one): a protocol of its groups (``exporter.option_groups``), so that the kinds, which the
    options hold, do not import the options back. A kind that reads another group names it here."""

    @property
    def precision(self) -> Named: ...  # its name (``value``), as messages write it
    @property
    def graphs(self) -> GraphOptions: ...
    @property
    def calibration(self) -> CalibrationOptions: ...
    @property
    def ple(self) -> PLEOptions: ...


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
    flags: ClassVar[
        tuple[tuple[Flag, ...], ...]
    ] = ()  # its options, in groups (given without --NAME, a group is refused in one line)
    tolerance: ClassVar[Tolerance]
    bytes_per_weight: ClassVar[float]  # the fewest bytes a weight takes in its graphs (the disk precheck)
    implies: ClassVar[tuple[str, ...]] = ()  # kinds it comes with (fp8: fp16), not named in the precision's name
    min_opset: ClassVar[int] = 0  # its graphs are written at this opset at least (int4: 21)
    min_compute_capability: ClassVar[tuple[int, int, str] | None] = None  # TensorRT builds it on these GPUs only
    weight_only: ClassVar[bool] = (
        False  # activations stay float: its graphs are also judged against PyTorch on its numbers
    )
    full_check: ClassVar[bool] = False  # onnx.checker's full check on every graph it wrote
    calibration_use: ClassVar[str | None] = None  # how --calib-data's refusal names it ("--int4 (method gptq)")
    default_windows: ClassVar[int] = 32  # calibration windows when --calib-samples is not given
    lora_slots: ClassVar[bool] = False  # --lora-slots is built on its graphs (the slots read float activations)
    ways_out: ClassVar[str | None] = None  # what raises its quality on real text (its options): the gate's refusal says

    @property
    def weight_block(self) -> int | None:
        """The block its weight-only weights are quantized in along K (None: it is not weight-only by blocks)."""
        return None

    @property
    def quantizes_scores(self) -> bool:
        """Whether its options quantize the attention-score MatMuls too (a target that fuses attention refuses it)."""
        return False

    def needs(self) -> Needs:
        return Needs.NOTHING

    def reasons(self, spec: DecoderSpec | None, options: Asked) -> list[str]:
        """Why it cannot be built with ``options`` (and, given a ``spec``, of that model), one line each; none:
        taken."""
        return []

    def prepare(self, context: object) -> Prepared:
        """What it computes once per export (the model at hand), as a ``Prepared``: its machinery
        module's ``prepare(kind, context)``, imported only now (the declaration stays light, and
        the machinery, which reads the model and the passes, sits above what imports the options).
        ``context`` is a ``precision.context.PrecisionContext``, passed through: named here, it
        would tie the kinds to the options and the load stage, which hold them."""
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

    def reasons(self, spec: DecoderSpec | None, options: Asked) -> list[str]:
        found = ranges_reasons(self.flag(), options)
        if spec is not None and (encoder := encoder_reason(spec, options)) is not None:
            found.append(encoder)
        elif (
            spec is not None and spec.encoder_dim is not None
        ):  # --fp8 was not refused here: its calibration failed with a traceback (no encoder_hidden_states)
            found.append(
                f"{self.flag()} is not supported for cross-attention decoders yet: calibration needs "
                "encoder_hidden_states"
                " samples, which kiln's calibration data formats do not carry; export --fp16 or fp32"
            )
        return found


def ranges_reasons(flag: str, options: Asked) -> list[str]:
    """What is wrong with the calibration options of a kind that reads activation ranges (``Needs.RANGES``)."""
    found = []
    if options.calibration.data is None:
        found.append(
            f"{flag} needs --calib-data: a text file, .jsonl (field 'text'), .npy/.npz token ids, or 'synthetic'"
        )
    if options.graphs.opset < _MIN_RANGES_OPSET:
        found.append(
            f"{flag} needs --opset {_MIN_RANGES_OPSET} or later (fp16 Q/DQ scales), found {options.graphs.opset}"
        )
    if options.calibration.method not in _CALIB_METHODS:
        found.append(f"--calib-method must be one of {', '.join(_CALIB_METHODS)}, found {options.calibration.method!r}")
    if not 0.0 < options.calibration.percentile <= 100.0:
        found.append(f"--calib-percentile must be in (0, 100], found {options.calibration.percentile}")
    return found


def encoder_reason(spec: DecoderSpec, options: Asked) -> str | None:
    """A kind that reads activation ranges refuses encoder-decoders (int4 refuses GPTQ's alone: ``kinds.int4``)."""
    if not spec.has_encoder:
        return None
    return (
        f"{options.precision.value} exports are not supported for encoder-decoders yet: calibration runs "
        "decoder-only prompts, with no encoder inputs; export --fp16, fp32 or --int4 --int4-method rtn"
    )


def kind_options(kind: PrecisionKind) -> dict[str, Any]:
    """A kind's own options (its fields: strings, numbers, booleans and tuples of them) as JSON
    values: what the manifest records of a kind that ``kiln check`` makes again (``with_kind_options``)."""
    return {f.name: list(v) if isinstance(v := getattr(kind, f.name), tuple) else v for f in dataclasses.fields(kind)}


def with_kind_options(kind: PrecisionKind, recorded: Mapping[str, Any]) -> PrecisionKind | None:
    """``kind`` with the options ``kind_options`` recorded (lists back to tuples); None where
    ``recorded`` names an option it does not have (a manifest of another kiln)."""
    fields = {f.name for f in dataclasses.fields(kind)}
    if not set(recorded) <= fields:
        return None
    return dataclasses.replace(kind, **{k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items()})
