"""Export options: one frozen dataclass of grouped plain data (``exporter.option_groups``: the
graphs' shape, the PLE tables, calibration, parity, LoRA) that the CLI fills (``from_flags``) and each
stage reads its group of.

Plain data: building one refuses only values that are wrong whatever else is asked
(``value_reasons``: ranges, names, flags given without the flag they belong to). What needs the
precision kinds or the targets to judge is the plan stage's (``exporter.plan``), which asks every
refusal of an export at once; nothing here imports a target or asks a kind."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError
from kiln.exporter.option_groups import (
    FLAGS,
    GROUPS,
    Adapter,
    CalibrationOptions,
    GraphOptions,
    LogitsMode,
    LoraOptions,
    ParityOptions,
    PLEOptions,
)
from kiln.exporter.precision.kinds.plan import (
    Precision,  # the type of a field (its value composes the kinds; nothing here asks one)
)
from kiln.plugins.base import PLEExtendMode, PLETables

__all__ = [
    "Adapter",
    "GraphOptions",
    "PLEOptions",
    "CalibrationOptions",
    "ParityOptions",
    "LoraOptions",
    "FLAGS",
    "Precision",
    "LogitsMode",
    "PLEExtendMode",
    "PLETables",
    "ExportOptions",
    "value_reasons",
    "MIN_OPSET",
    "MAX_OPSET",
    "TRITON_NAME",
    "LORA_TRITON_REASON",
]

MIN_OPSET, MAX_OPSET = 18, 23
TRITON_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a Triton model name (and a directory name)
# Why a slotted export gets no Triton repository (exporter/serving/triton.py, "LoRA slots"): refused
# by kiln export --triton and by kiln triton alike.
LORA_TRITON_REASON = (
    "every model kiln writes for Triton batches requests (max_batch_size > 0: Triton adds a batch dim to each "
    "input and its backends"
    " require the graph's first dim to be that batch), but a slot's A [in, r] and B [r, out] have none and one "
    "run applies one adapter"
    " to the whole batch, so a per-request adapter cannot be declared; serve it with ONNX Runtime (kiln generate "
    "--adapter, GenAI og.Adapters)"
)


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """One export's options, grouped by the stage that reads them (as ExecuTorch's LLM export configs
    are): the graphs' shape, the PLE tables, calibration, parity and LoRA, beside the precision, the
    target and the outputs. ``from_flags`` builds one from kiln export's flags."""

    precision: Precision = Precision.FP32  # its kinds, each with its own options (``precision.plan``)
    # "portable" (the portable graphs only), or a registered target's name (``exporter.targets``)
    target: str = "portable"
    # the targets' own flags' values, by field (``targets.base.Target.flags``: --ort-int8 is ort's)
    target_flags: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    graphs: GraphOptions = GraphOptions()
    ple: PLEOptions = PLEOptions()
    calibration: CalibrationOptions = CalibrationOptions()
    parity: ParityOptions = ParityOptions()
    lora: LoraOptions = LoraOptions()
    triton: str | None = None  # also write a Triton model repository under this model name
    force: bool = False  # replace a non-empty output directory

    def __post_init__(self) -> None:
        if found := value_reasons(self):
            raise ConfigError(" | ".join(found))

    @classmethod
    def from_flags(cls, **flags: Any) -> ExportOptions:
        """The options of kiln export's flags by their click names (``max_batch``, ``calib_data``,
        ``parity_tokens``: ``FLAGS``), each into its group; every reason a value is wrong is reported
        together."""
        grouped: dict[str, dict[str, Any]] = {}
        own: dict[str, Any] = {}
        for flag, value in flags.items():
            if flag in FLAGS:
                group, field = FLAGS[flag]
                grouped.setdefault(group, {})[field] = value
            else:
                own[flag] = value
        return cls(**own, **{group: GROUPS[group](**fields) for group, fields in grouped.items()})

    @property
    def samples(self) -> int:
        """Calibration windows: ``--calib-samples``, or the default of the kind that reads them."""
        given = self.calibration.samples
        return given if given is not None else self.precision.default_windows

    @property
    def data_inputs(self) -> tuple[Path, ...]:
        """The files and folders besides the checkpoint that an export reads (never replaced by its output)."""
        data = self.calibration.data
        found: tuple[Path, ...] = (Path(data),) if data not in (None, "synthetic") else ()
        found += (self.parity.eval_data,) if self.parity.eval_data is not None else ()
        found += (self.calibration.cache,) if self.calibration.cache is not None else ()
        return found + tuple(a.path for a in self.lora.adapters)

    @property
    def graph_opset(self) -> int:
        """The opset the graphs are written at: ``--opset``, raised to what a kind needs (int4: 21,
        DequantizeLinear's ``block_size``)."""
        return self.precision.graph_opset(self.graphs.opset)


def value_reasons(options: ExportOptions) -> list[str]:
    """What is wrong with ``options`` on their own, one line each (the kinds and targets judge the rest:
    ``exporter.plan``)."""
    found = []
    if options.graphs.max_batch < 1:
        found.append(f"--max-batch must be at least 1, found {options.graphs.max_batch}")
    if options.graphs.max_context is not None and options.graphs.max_context < 2:
        found.append(f"--max-context must be at least 2, found {options.graphs.max_context}")
    if not MIN_OPSET <= options.graphs.opset <= MAX_OPSET:
        found.append(f"--opset must be between {MIN_OPSET} and {MAX_OPSET}, found {options.graphs.opset}")
    if options.ple.extend is not None and options.ple.extend < 2:
        found.append(f"--ple-extend must be at least 2 rows, found {options.ple.extend}")
    if options.calibration.samples is not None and options.calibration.samples < 1:
        found.append(f"--calib-samples must be at least 1, found {options.calibration.samples}")
    if options.triton is not None and not TRITON_NAME.match(options.triton):
        found.append(
            f"triton: model name {options.triton!r} must start with a letter or digit and hold only letters, "
            "digits, '_', '.' and '-'"
        )
    found += _lora_reasons(options)
    if options.parity.tokens < 1:
        found.append(f"parity tokens must be at least 1, found {options.parity.tokens}")
    if not _quality_gate_ok(options.parity.quality_gate):
        found.append(
            f"--quality-gate must be auto, off or a top-1 agreement in (0, 1], found {options.parity.quality_gate!r}"
        )
    if options.parity.device not in ("auto", "cpu", "cuda"):
        found.append(f"--parity-device must be auto, cpu or cuda, found {options.parity.device!r}")
    if options.parity.agreement not in (None, "gate", "record"):
        found.append(f"--parity-agreement must be gate or record, found {options.parity.agreement!r}")
    return found


def _quality_gate_ok(value: str) -> bool:
    """``--quality-gate``: auto, off, or an agreement in (0, 1]."""
    if value in ("auto", "off"):
        return True
    try:
        return 0 < float(value) <= 1
    except ValueError:
        return False


def _lora_reasons(options: ExportOptions) -> list[str]:
    """``--lora-slots``' flags among themselves (what it is built on: ``exporter.plan``)."""
    if options.lora.slots is None:
        return ["--lora-targets only applies with --lora-slots RANK"] if options.lora.targets else []
    found = []
    if options.lora.slots < 1:
        found.append(
            f"--lora-slots must be at least 1 (the largest adapter rank the graphs take), found {options.lora.slots}"
        )
    if options.lora.adapters:
        found.append(
            "--lora-slots with --adapter: either merge the adapters (--adapter) or export slots and convert each "
            "adapter with kiln adapter, not both"
        )
    if options.triton is not None:
        found.append(f"--lora-slots with --triton: {LORA_TRITON_REASON}")
    return found
