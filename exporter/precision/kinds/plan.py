"""An export's precision: the registered kinds it composes (at most one per role), each with its
own options, and what follows from them for the rest of the export (its name in the manifest,
the KV cache's dtype, the tolerances its graphs are judged by, the opset, the GPUs that build
it). Nothing here names a kind: each says what it is (``base.PrecisionKind``).

    Precision.of(Int4(method=Int4Method.RTN), Fp16())   # "int4+fp16"
    Precision.parse("fp8")                              # fp8, and the fp16 it implies
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, ClassVar

from kiln.errors import ConfigError
from kiln.exporter.precision.kinds.base import Needs, PrecisionKind, Role
from kiln.exporter.precision.kinds.registry import kind, kinds
from kiln.exporter.tolerance import FP32, Tolerance

__all__ = ["Precision", "TOLERANCES", "names"]

FP32_NAME = "fp32"  # the name of a precision with no kind
_ROLES = tuple(Role)  # the order kinds run in (and are named in): the MatMuls' kind, then the float type


@dataclasses.dataclass(frozen=True)
class Precision:
    """Build with ``of`` or ``parse`` (equal precisions are one object, so ``is`` compares them)."""

    kinds: tuple[PrecisionKind, ...] = ()  # in role order

    FP32: ClassVar[Precision]
    FP16: ClassVar[Precision]
    INT8: ClassVar[Precision]
    INT8_FP16: ClassVar[Precision]
    INT4: ClassVar[Precision]
    INT4_FP16: ClassVar[Precision]
    FP8: ClassVar[Precision]

    @classmethod
    def of(cls, *chosen: PrecisionKind) -> Precision:
        """The precision of ``chosen`` kinds and those they imply (at their defaults)."""
        if clashes := _clashes(chosen):
            raise ConfigError(" | ".join(clashes))
        present = {k.name for k in chosen}
        implied = tuple(kind(name)() for k in chosen for name in k.implies if name not in present)
        return _interned(tuple(sorted((*chosen, *implied), key=lambda k: _ROLES.index(k.role))))

    @classmethod
    def parse(cls, name: str) -> Precision:
        """The precision a manifest names (``int8+fp16``), each kind at its defaults."""
        if name == FP32_NAME:
            return cls.of()
        known = {k.name: k for k in kinds()}
        parts = name.split("+")
        unknown = [p for p in parts if p not in known]
        if unknown or not parts:
            raise ConfigError(f"precision {name!r} is not one kiln writes; kiln writes {', '.join(names())}")
        return cls.of(*(known[p]() for p in parts))

    @classmethod
    def from_flags(cls, flags: dict[str, Any]) -> Precision:
        """The precision ``kiln export``'s flags choose (``chosen``); a kind's options given without it
        are refused, a group in one line, every group's lines in one error."""
        precision, stray = cls.chosen(flags)
        if stray:
            raise ConfigError(" | ".join(stray))
        return precision

    @classmethod
    def chosen(cls, flags: dict[str, Any]) -> tuple[Precision, list[str]]:
        """The precision ``kiln export``'s flags choose and why some of them are refused: each kind's
        ``--NAME`` and its own options are taken out of ``flags`` (click's values by ``Flag.dest``); a
        kind is chosen by its flag or implied by a chosen one; a kind's options given without it are
        left out, a line each group (the plan stage reports them: ``exporter.plan``'s ``given``)."""
        chosen = {k.name for k in kinds() if flags.pop(k.name)}
        chosen |= {name for k in kinds() if k.name in chosen for name in k.implies}
        made: list[PrecisionKind] = []
        stray: list[str] = []
        for each in kinds():
            values = {flag: flags.pop(flag.dest) for group in each.flags for flag in group}
            if each.name in chosen:
                made.append(
                    each(
                        **{
                            f.field: f.convert(v) if f.convert is not None and v is not None else v
                            for f, v in values.items()
                            if v is not None
                        }
                    )
                )
                continue
            for group in each.flags:
                if any(flag.given(values[flag]) for flag in group):
                    options = [flag.option for flag in group]
                    verb = "applies" if len(options) == 1 else "apply"
                    stray.append(f"{' and '.join(options)} only {verb} to {each.flag()} exports")
        if clashes := _clashes(made):  # reported with the rest by the plan; the first of each role goes on
            stray = [*clashes, *stray]
            made = [k for k in made if min((c for c in made if c.role is k.role), key=_registered_order) is k]
        return cls.of(*made), stray

    @property
    def value(self) -> str:
        """Its name, as the manifest and every report write it."""
        implied = {name for k in self.kinds for name in k.implies}
        return "+".join(k.name for k in self.kinds if k.name not in implied) or FP32_NAME

    def get(self, name: str) -> PrecisionKind | None:
        return next((k for k in self.kinds if k.name == name), None)

    def __contains__(self, name: object) -> bool:
        return any(k.name == name for k in self.kinds)

    @property
    def float16(self) -> bool:
        """Whether the graphs' float type is fp16 (weights, activations, KV cache)."""
        return any(k.role is Role.FLOAT for k in self.kinds)

    @property
    def kv_dtype(self) -> str:
        return "float16" if self.float16 else "float32"

    @property
    def tolerance(self) -> Tolerance:
        """The figures its graphs are judged by: the MatMuls' kind's, else the float type's, else fp32's."""
        return self.kinds[0].tolerance if self.kinds else FP32

    def needs(self, what: Needs) -> bool:
        return any(k.needs() is what for k in self.kinds)

    @property
    def default_windows(self) -> int:
        """Calibration windows when --calib-samples is not given (the kind that reads them decides)."""
        return next((k.default_windows for k in self.kinds if k.needs() is not Needs.NOTHING), 32)

    @property
    def weight_only_float(self) -> str | None:
        """A weight-only precision's float precision (``fp32``/``fp16``): the tolerances its graphs
        meet against PyTorch on their own quantized weights (``parity.quantized``); None for any
        other (its activations are quantized too, or nothing is)."""
        judge = self.weight_only_judge
        return judge.value if judge is not None else None

    @property
    def weight_only_judge(self) -> Precision | None:
        """``weight_only_float`` as the precision that judges (``candidates.candidate``'s ``quantized``)."""
        return (Precision.FP16 if self.float16 else Precision.FP32) if self.weight_only else None

    @property
    def min_bytes_per_weight(self) -> float:
        """The fewest bytes a weight takes in the graphs: a lower bound of the weights file's size
        per parameter, to refuse a disk that cannot hold it."""
        return min((k.bytes_per_weight for k in self.kinds), default=4.0)

    @property
    def min_compute_capability(self) -> tuple[int, int, str] | None:
        needs = [k.min_compute_capability for k in self.kinds if k.min_compute_capability is not None]
        return max(needs) if needs else None

    @property
    def full_check(self) -> bool:
        return any(k.full_check for k in self.kinds)

    @property
    def weight_only(self) -> bool:
        """Whether a kind quantizes the weights only (its activations stay float)."""
        return any(k.weight_only for k in self.kinds)

    @property
    def weight_block(self) -> int | None:
        """The block a weight-only kind quantizes the weights in along K (None: no such kind)."""
        return next((k.weight_block for k in self.kinds if k.weight_block is not None), None)

    @property
    def quantizes_scores(self) -> bool:
        """Whether a kind's options quantize the attention-score MatMuls too."""
        return any(k.quantizes_scores for k in self.kinds)

    @property
    def lora_slots(self) -> bool:
        """Whether --lora-slots can be built on these graphs (fp32: yes; else every kind says)."""
        return all(k.lora_slots for k in self.kinds)

    @property
    def ways_out(self) -> str | None:
        """What raises its quality on real text: its quantizing kind's own options."""
        return next((k.ways_out for k in self.kinds if k.ways_out is not None), None)

    def graph_opset(self, opset: int) -> int:
        """The opset the graphs are written at: ``opset``, raised to what a kind needs."""
        return max((opset, *(k.min_opset for k in self.kinds)))


def _clashes(chosen: Sequence[PrecisionKind]) -> list[str]:
    """A line for each role that more than one of ``chosen`` takes (``--int8 --fp8``: both quantize the
    MatMuls)."""
    found = []
    for role in _ROLES:
        same = sorted((c for c in chosen if c.role is role), key=_registered_order)
        if len(same) > 1:
            found.append(
                f"{' and '.join(c.flag() for c in same)} are different precisions of the same MatMuls; choose one"
            )
    return found


def _registered_order(chosen: PrecisionKind) -> int:
    registered = kinds()
    return registered.index(type(chosen)) if type(chosen) in registered else len(registered)


@functools.cache
def _interned(chosen: tuple[PrecisionKind, ...]) -> Precision:
    return Precision(chosen)


def names() -> tuple[str, ...]:
    """Every precision name kiln writes: fp32, each float type, each MatMuls' kind alone and with each float type."""
    floats = [k for k in kinds() if k.role is Role.FLOAT]
    return tuple(dict.fromkeys(Precision.of(*(k() for k in combo)).value for combo in _combinations(floats)))


def _combinations(floats: list[type[PrecisionKind]]) -> list[tuple[type[PrecisionKind], ...]]:
    matmuls = [k for k in kinds() if k.role is Role.MATMULS]
    return [(), *((f,) for f in floats), *((m,) for m in matmuls), *((m, f) for m in matmuls for f in floats)]


TOLERANCES: dict[str, Tolerance] = {name: Precision.parse(name).tolerance for name in names()}  # by precision name

Precision.FP32 = Precision.parse("fp32")
Precision.FP16 = Precision.parse("fp16")
Precision.INT8 = Precision.parse("int8")
Precision.INT8_FP16 = Precision.parse("int8+fp16")
Precision.INT4 = Precision.parse("int4")
Precision.INT4_FP16 = Precision.parse("int4+fp16")
Precision.FP8 = Precision.parse("fp8")
