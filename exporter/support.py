"""What a model structure exports, per precision and per target, asked of the export's own refusals
so that it cannot drift from them: ``kiln plugins`` prints it, docs/architectures.md holds it.

A cell is one precision (fp32 and each registered kind, at its defaults) on one target (the
portable graphs, which every export writes, and each registered target), asked of the plan stage
(``exporter.plan``): what no model takes (``--fp16 --target ort``), then what one structure cannot
take (``--int8`` of a cross-attention decoder); nothing is loaded or traced, and nothing heavy is
imported. Where the defaults are refused, the other flags that write that precision for that
target are asked (``alternatives``: a target's flag that says it writes that precision,
``Flag.writes``, and ``--int4-method rtn``); where options are taken, the config features that a refusal
also reads are asked (``FEATURES``: a sliding window, chunked attention): either makes the cell conditional.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kiln.errors import ConfigError
from kiln.exporter.options import ExportOptions
from kiln.exporter.plan import plan
from kiln.exporter.precision.kinds.base import Needs
from kiln.exporter.precision.kinds.int4 import Int4, Int4Method
from kiln.exporter.precision.kinds.plan import Precision
from kiln.exporter.precision.kinds.registry import kinds
from kiln.exporter.targets import PORTABLE, names, target
from kiln.plugins.base import DecoderSpec

__all__ = [
    "FEATURES", "INT4_RTN", "Alternative", "Cell", "Feature", "Support", "alternatives", "legend", "letter",
    "precisions", "refusal", "support", "target_names",
]  # fmt: skip

FP32 = "fp32"
REFUSED = "-"
PORTABLE_LETTER = "p"  # the portable graphs' letter in a cell's marks (each target declares its own)


@dataclasses.dataclass(frozen=True)
class Alternative:
    """Other flags that write ``precision``'s numbers, asked where its defaults are refused."""

    precision: str
    flags: str  # as a refused cell's refusal names them
    condition: str  # what the legend says of a cell taken only so
    fields: Mapping[str, Any]  # ExportOptions fields (a "precision" among them replaces the default's)


@dataclasses.dataclass(frozen=True)
class Feature:
    """A config feature that a refusal reads: a cell taken without it and refused with it is
    conditional. Asked only of a spec whose config has its fields (unset: None): a family's
    specs say which of its structures can have it."""

    condition: str  # what the legend says of a cell refused with it
    config: Mapping[str, Any]  # merged into the spec's config

    def possible(self, spec: DecoderSpec) -> bool:
        return all(field in spec.config for field in self.config)


INT4_RTN = Alternative(
    "int4", "--int4-method rtn", "only with --int4-method rtn (GPTQ is refused)",
    {"precision": Precision.of(Int4(method=Int4Method.RTN))},
)  # fmt: skip
FEATURES = (
    Feature("not with a sliding window: only the windows a test proves are applied", {"sliding_window": 4}),
    Feature("not with chunked attention (attention_chunk_size)", {"attention_chunk_size": 4}),
)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One precision on one target: taken or refused, and when taken only so, why."""

    taken: bool
    condition: str | None = None  # taken only with other flags or without a config feature
    # the refusal of the defaults (and of the alternatives' flags, where they are refused too);
    # of a conditional cell: the one its condition avoids
    refusal: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"taken": self.taken, "condition": self.condition, "refusal": self.refusal}


@dataclasses.dataclass(frozen=True)
class Support:
    """Every precision (``precisions()``) on every target (``target_names()``) of one structure."""

    cells: Mapping[str, Mapping[str, Cell]]  # precision -> target -> cell

    def marks(self) -> list[str]:
        """One mark per precision, a letter per target: lower case taken, upper case taken on a
        condition, ``-`` refused (``pox``, ``p-x``): what a terminal row has room for."""
        return ["".join(_mark(target, cell) for target, cell in row.items()) for row in self.cells.values()]

    def to_dict(self) -> dict[str, dict[str, dict[str, Any]]]:
        return {precision: {t: cell.to_dict() for t, cell in row.items()} for precision, row in self.cells.items()}


def alternatives() -> tuple[Alternative, ...]:
    """Each registered target's on/off flags that write a precision at the defaults (``Flag.writes``:
    ``--ort-int8``), in registration order, then ``INT4_RTN``."""
    flags = [(flag, writes) for t in names() for flag in target(t).flags if (writes := flag.writes) is not None]
    declared = [
        Alternative(
            writes.precision,
            flag.option,
            writes.condition,
            {"precision": Precision.of(), "target_flags": {flag.field: True}},
        )
        for flag, writes in flags
    ]
    return (*declared, INT4_RTN)


def precisions() -> tuple[str, ...]:
    """The precisions a cell is asked of: fp32 and each registered kind, in registration order."""
    return (FP32, *(k.name for k in kinds()))


def target_names() -> tuple[str, ...]:
    """The portable graphs and each registered target (``--target``'s choices)."""
    return (PORTABLE, *names())


def letter(name: str) -> str:
    """A target's letter in the marks: ``p`` for the portable graphs, else the one it declares (``Target.letter``)."""
    return PORTABLE_LETTER if name == PORTABLE else target(name).letter


def refusal(spec: DecoderSpec, fields: Mapping[str, Any]) -> str | None:
    """Why an export of ``spec`` with these flags (``ExportOptions.from_flags``) is refused (None: taken);
    calibration data is synthetic where the precision reads some (its own refusals aside)."""
    precision = fields.get("precision", Precision.of())
    calib = "synthetic" if precision.needs(Needs.RANGES) or precision.needs(Needs.HESSIANS) else None
    try:
        plan(ExportOptions.from_flags(**{"calib_data": calib, **fields}), spec)
    except ConfigError as exc:
        return str(exc).removeprefix(f"{exc.stage}: ")
    return None


def _cell(spec: DecoderSpec, precision: str, target: str) -> Cell:
    """One cell: the defaults, else an alternative's flags; then, with each feature, the same flags."""
    default = {"precision": Precision.parse(precision), "target": target}
    others = [(a.flags, a.condition, {**default, **a.fields}) for a in alternatives() if a.precision == precision]
    tries = [("", None, default), *others]
    refused: dict[str, str] = {}  # message -> the flags it answers ("": the defaults)
    for flags, condition, fields in tries:
        why = refusal(spec, fields)
        if why is not None:
            refused.setdefault(why, flags)
            continue
        for feature in filter(lambda f: f.possible(spec), FEATURES):
            avoided = refusal(dataclasses.replace(spec, config={**spec.config, **feature.config}), fields)
            if avoided is not None:
                return Cell(True, "; ".join(c for c in (condition, feature.condition) if c), avoided)
        return Cell(True, condition, next(iter(refused), None))
    return Cell(False, refusal="; ".join(f"with {flags}: {why}" if flags else why for why, flags in refused.items()))


def support(spec: DecoderSpec) -> Support:
    """What ``spec``'s structure exports, every precision on every target."""
    return Support({p: {t: _cell(spec, p, t) for t in target_names()} for p in precisions()})


def _mark(target: str, cell: Cell) -> str:
    if not cell.taken:
        return REFUSED
    return letter(target).upper() if cell.condition else letter(target)


def legend(supports: Iterable[Support]) -> list[str]:
    """The lines that read the marks of ``supports``: the letters, then each condition once, with
    the marks it explains (and the precisions, where it is not every one's)."""
    where = ", ".join(f"{letter(t)} {'portable graphs' if t == PORTABLE else f'--target {t}'}" for t in target_names())
    found: dict[str, dict[str, set[str]]] = {}  # condition -> mark -> precisions
    for each in supports:
        for precision, row in each.cells.items():
            for name, cell in row.items():
                if cell.taken and cell.condition:
                    found.setdefault(cell.condition, {}).setdefault(letter(name).upper(), set()).add(precision)
    head = f"{where}, {REFUSED} refused" + ("; a capital: only as below" if found else "")
    return [head, *(f"{_marked(marks)}: {condition}" for condition, marks in found.items())]


def _marked(marks: Mapping[str, set[str]]) -> str:
    """``O in int8`` (a mark in some precisions), ``X`` (in every one)."""
    order: Sequence[str] = precisions()
    parts = []
    for mark, where in marks.items():
        parts.append(mark if set(order) <= where else f"{mark} in {', '.join(p for p in order if p in where)}")
    return ", ".join(parts)
