"""The plan stage: every refusal of an export, asked in one loop through one signature, and what
the export then writes.

    flags ──► Precision.chosen(flags)         given: a kind's flags without it, two kinds of one role
          ──► ExportOptions.from_flags(...)  groups (graphs, ple, calibration, parity, lora); value_reasons:
                     │                       ranges, names, flags among themselves
                     ▼
    plan(options, given) ──► ExportPlan(options, None, targets, None)   the options alone, with ``given``
    of_model(planned, spec) ──► ExportPlan(options, spec, targets, max_context)   once the model is known
          │  each refusal's reasons(spec, options) -> list[str], in this order:
          │    each precision kind of the export   (precision.kinds.*: check and model refusals)
          │    calibration data                    (--calib-data without a kind that reads it)
          │    the target's name                   (--target NAME registered)
          │    each registered target              (targets.*: its flags, and the structures it rewrites)
          │    LoRA slots                          (the precisions and targets slots are built on)
          │    parity                              (--parity-agreement record)
          │    parity's device                     (--parity-device cuda where CUDA is missing)
          │    the model family                    (cross-attention: slots, Triton)
          │    with the model, sized:
          │    the exported context                (context_limit: --max-context against the model)
          │    the static cache                    (static_fit: --target onnx's buffers on this machine)
          ▼
    each round once: the options alone (the CLI before any import of torch, ``export`` when not
    given a plan), the config's spec before the weights load, the loaded spec (``export_loaded``,
    which passes the plan down: its targets are the ones written, its ``max_context`` the one
    traced). Every reason of a round is one error, its lines joined by `` | ``: an ``ExportError``
    when only the sized refusals give reasons (their stage), else a ``ConfigError``.

A new refusal is one function of this signature in ``_refusals``; a kind or a target says its
own in its ``reasons`` (``precision.kinds.base``, ``targets.base``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kiln.errors import ConfigError, ExportError
from kiln.exporter.context_limit import context_reasons, exported_context
from kiln.exporter.precision.kinds import kinds
from kiln.exporter.precision.kinds.base import Needs, RangesKind
from kiln.exporter.targets import PORTABLE, names, target, targets

if TYPE_CHECKING:
    from kiln.exporter.options import ExportOptions
    from kiln.exporter.targets.base import Target
    from kiln.plugins.base import DecoderSpec

__all__ = ["ExportPlan", "Refusal", "SEPARATOR", "of_model", "plan", "reasons"]

Refusal = Callable[
    ["DecoderSpec | None", "ExportOptions"], list[str]
]  # (spec or None: the options alone, options) -> one line a reason
SEPARATOR = " | "  # between the reasons of one error


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """An export every refusal has taken: its options, the model's structure when it was asked
    with one, the registered targets it writes besides the portable graphs, and the context it is
    written for (None until a model is known, or when not sized)."""

    options: ExportOptions
    spec: DecoderSpec | None
    targets: tuple[Target, ...]
    max_context: int | None = None


def plan(
    options: ExportOptions, spec: DecoderSpec | None = None, *, sized: bool = False, given: Sequence[str] = ()
) -> ExportPlan:
    """The plan of an export of ``options`` (of a model of ``spec``, when known): the options' own
    round first, then (all taken) the model's (``of_model``; ``sized``: its context and buffers too,
    as the pipeline asks, not only what its structure supports, as ``kiln plugins``' table asks).
    ``given``: reasons found while the options were made, reported first in the options' round (the
    CLI's: a precision kind's flags without the kind, ``Precision.chosen``)."""
    _refuse(options, None, sized=False, given=given)
    planned = ExportPlan(options, None, tuple(t for t in targets() if t.wanted(options)))
    return planned if spec is None else of_model(planned, spec, sized=sized)


def of_model(planned: ExportPlan, spec: DecoderSpec, *, sized: bool = True) -> ExportPlan:
    """``planned`` (its options' round taken) for a model of ``spec``: the model's round, the
    sized refusals among them unless ``sized`` is False (what its structure supports, not what the
    context and this machine fit)."""
    _refuse(planned.options, spec, sized=sized)
    context = exported_context(spec, planned.options) if sized else None
    return dataclasses.replace(planned, spec=spec, max_context=context)


def reasons(options: ExportOptions, spec: DecoderSpec | None = None, *, sized: bool = False) -> list[str]:
    """Every refusal's reasons, in order (``spec`` None: those the options alone give)."""
    return [reason for _, reason in _found(options, spec, sized)]


def _found(options: ExportOptions, spec: DecoderSpec | None, sized: bool) -> list[tuple[Refusal, str]]:
    asked = [*_refusals(options), *(_SIZED if sized and spec is not None else ())]
    return [(refusal, reason) for refusal in asked for reason in refusal(spec, options)]


def _refuse(options: ExportOptions, spec: DecoderSpec | None, sized: bool, given: Sequence[str] = ()) -> None:
    """One error of every reason of the round: the sized refusals' own stage when only they refuse."""
    found: list[tuple[Refusal | None, str]] = [(None, reason) for reason in given]
    if found := [*found, *_found(options, spec, sized)]:
        error = ExportError if all(refusal in _SIZED for refusal, _ in found) else ConfigError
        raise error(SEPARATOR.join(reason for _, reason in found))


def _refusals(options: ExportOptions) -> list[Refusal]:
    return [
        *(k.reasons for k in options.precision.kinds),
        _calibration,
        _target_name,
        *(t.reasons for t in targets()),
        _lora,
        _parity,
        _parity_device,
        _family,
    ]


def _calibration(spec: DecoderSpec | None, options: ExportOptions) -> list[str]:
    if (
        options.calibration.data is None
        or options.precision.needs(Needs.RANGES)
        or options.precision.needs(Needs.HESSIANS)
    ):
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
    if options.lora.slots is None:
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
        options.parity.agreement is None
        or options.precision.weight_only_float is not None
        or options.precision.needs(Needs.RANGES)
    ):
        return []
    flags = [k.flag() for k in kinds() if k.weight_only or issubclass(k, RangesKind)]
    return [
        f"--parity-agreement {options.parity.agreement} only applies to {', '.join(flags[:-1])} or {flags[-1]} "
        "exports, whose graphs are also checked against PyTorch on their own quantized numbers; "
        f"a {options.precision.value} export's only proof is its agreement with the checkpoint's model"
    ]


def _parity_device(spec: DecoderSpec | None, options: ExportOptions) -> list[str]:
    """--parity-device cuda: refused before any work where torch sees no GPU or ONNX Runtime offers
    no CUDA provider (``runners.device``; auto falls back to the CPU there)."""
    from kiln.exporter.runners.device import refusal

    return refusal(options.parity.device)


def _static_cache(spec: DecoderSpec | None, options: ExportOptions) -> list[str]:
    """--target onnx's static cache against this machine (``static_fit``: it imports parity's plan
    and torch, which the options' round, the CLI's, never asks)."""
    from kiln.exporter.static_fit import static_cache_reasons

    return static_cache_reasons(spec, options)


_SIZED: tuple[Refusal, ...] = (context_reasons, _static_cache)  # asked with a model only: its context, its buffers


def _family(spec: DecoderSpec | None, options: ExportOptions) -> list[str]:
    if spec is None or spec.encoder_dim is None or options.triton is None:
        return []
    return [
        "triton: cross-attention decoders are not supported yet (the ensemble would need encoder_hidden_states"
        " and a cross cache that is written once); serve prefill.onnx and decode.onnx from your own host"
    ]
