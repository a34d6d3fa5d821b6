"""The plan stage: every refusal of an export, asked in one loop through one signature, and what
the export then writes.

    options ──► ExportOptions(...)          value_reasons: ranges, names, flags among themselves
                     │
                     ▼
    plan(options, spec=None) ──► ExportPlan(options, spec, targets)
          │  each refusal's reasons(spec, options) -> list[str], in this order:
          │    each precision kind of the export   (precision.kinds.*: check and model refusals)
          │    calibration data                    (--calib-data without a kind that reads it)
          │    the target's name                   (--target NAME registered)
          │    each registered target              (targets.*: its flags, and the structures it rewrites)
          │    LoRA slots                          (the precisions and targets slots are built on)
          │    parity                              (--parity-agreement record)
          │    the model family                    (cross-attention: slots, Triton)
          ▼
    first without the model (spec None): the CLI before any import of torch, ``export`` before
    anything is read; then with it: the config's spec before the weights load, the loaded spec
    after. Every reason of a round is one ``ConfigError``, its lines joined by `` | ``.

A new refusal is one function of this signature in ``_refusals``; a kind or a target says its
own in its ``reasons`` (``precision.kinds.base``, ``targets.base``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from kiln.errors import ConfigError
from kiln.exporter.precision.kinds import kinds
from kiln.exporter.precision.kinds.base import Needs, RangesKind
from kiln.exporter.targets import PORTABLE, names, target, targets

if TYPE_CHECKING:
    from kiln.exporter.options import ExportOptions
    from kiln.exporter.targets.base import Target
    from kiln.plugins.base import DecoderSpec

__all__ = ["ExportPlan", "Refusal", "SEPARATOR", "plan", "reasons"]

Refusal = Callable[
    ["DecoderSpec | None", "ExportOptions"], list[str]
]  # (spec or None: the options alone, options) -> one line a reason
SEPARATOR = " | "  # between the reasons of one error


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """An export every refusal has taken: its options, the model's structure when it was asked
    with one, and the registered targets it writes besides the portable graphs."""

    options: ExportOptions
    spec: DecoderSpec | None
    targets: tuple[Target, ...]


def plan(options: ExportOptions, spec: DecoderSpec | None = None) -> ExportPlan:
    """The plan of an export of ``options`` (of a model of ``spec``, when known); every reason to
    refuse it is one ``ConfigError``: the options' own first, then (all taken) the model's."""
    for asked in (None,) if spec is None else (None, spec):
        if found := reasons(options, asked):
            raise ConfigError(SEPARATOR.join(found))
    return ExportPlan(options, spec, tuple(t for t in targets() if t.wanted(options)))


def reasons(options: ExportOptions, spec: DecoderSpec | None = None) -> list[str]:
    """Every refusal's reasons, in order (``spec`` None: those the options alone give)."""
    return [reason for refusal in _refusals(options) for reason in refusal(spec, options)]


def _refusals(options: ExportOptions) -> list[Refusal]:
    return [
        *(k.reasons for k in options.precision.kinds),
        _calibration,
        _target_name,
        *(t.reasons for t in targets()),
        _lora,
        _parity,
        _family,
    ]


def _calibration(spec: DecoderSpec | None, options: ExportOptions) -> list[str]:
    if options.calib_data is None or options.precision.needs(Needs.RANGES) or options.precision.needs(Needs.HESSIANS):
        return []
    uses = [k.calibration_use for k in kinds() if k.calibration_use is not None]
    return [f"--calib-data only applies to {', '.join(uses[:-1])} and {uses[-1]} exports"]


def _target_name(spec: DecoderSpec | None, options: ExportOptions) -> list[str]:
    if options.target == PORTABLE:
        return []
    try:
        target(options.target)
    except ConfigError as exc:  # an unknown name: the registry's own line
        return [str(exc.args[0])]
    return []


def _lora(spec: DecoderSpec | None, options: ExportOptions) -> list[str]:
    """What ``--lora-slots`` is built for so far: the portable graphs of the kinds that say so
    (``lora_slots``: fp32, fp16 or an int4 base) and the targets that say so (``--target ort``'s),
    decoders without cross-attention (its flags among themselves: ``options.value_reasons``)."""
    if options.lora_slots is None:
        return []
    found = []
    if not options.precision.lora_slots:
        found.append(
            f"--lora-slots with {options.precision.value}: slots are built on float and int4 (weight-only) bases "
            "only; int8 and fp8 quantize the activations the adapters would read"
        )
    if options.target != PORTABLE and not (options.target in names() and target(options.target).lora_slots):
        found.append(
            f"--lora-slots with --target {options.target}: slots are built on the portable graphs and --target ort only"
        )
    if spec is not None and spec.encoder_dim is not None:
        found.append(
            "--lora-slots: cross-attention decoders are not built with slots yet; merge the adapter with --adapter"
        )
    return found


def _parity(spec: DecoderSpec | None, options: ExportOptions) -> list[str]:
    """--parity-agreement: only where the graphs are also checked against the quantized model
    (int4's weights, int8's and fp8's Q/DQ scales: ``parity.quantized``, ``parity.qdq_model``)."""
    if (
        options.parity_agreement is None
        or options.precision.weight_only_float is not None
        or options.precision.needs(Needs.RANGES)
    ):
        return []
    flags = [k.flag() for k in kinds() if k.weight_only or issubclass(k, RangesKind)]
    return [
        f"--parity-agreement {options.parity_agreement} only applies to {', '.join(flags[:-1])} or {flags[-1]} "
        "exports, whose graphs are also checked against PyTorch on their own quantized numbers; "
        f"a {options.precision.value} export's only proof is its agreement with the checkpoint's model"
    ]


def _family(spec: DecoderSpec | None, options: ExportOptions) -> list[str]:
    if spec is None or spec.encoder_dim is None or options.triton is None:
        return []
    return [
        "triton: cross-attention decoders are not supported yet (the ensemble would need encoder_hidden_states"
        " and a cross cache that is written once); serve prefill.onnx and decode.onnx from your own host"
    ]
