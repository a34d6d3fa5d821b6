"""``--fp8``: fp8 E4M3 Q/DQ before MatMul inputs (weights per output channel, activations per
tensor, calibrated), the rest of the graph fp16 (it implies ``--fp16``); for TensorRT on Ada,
Hopper and later. Its machinery (the pass) is ``precision.fp8``."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from kiln.exporter.precision.kinds.base import Flag, RangesKind, Role
from kiln.exporter.precision.kinds.int8 import EIGHT_BIT
from kiln.exporter.tolerance import Tolerance

__all__ = ["Fp8"]


@dataclasses.dataclass(frozen=True)
class Fp8(RangesKind):
    float_rules: tuple[str, ...] = ()  # MatMuls kept fp16 besides the LM head and attention scores

    name: ClassVar[str] = "fp8"
    role: ClassVar[Role] = Role.MATMULS
    machinery: ClassVar[str] = "kiln.exporter.precision.fp8"
    help: ClassVar[str] = (
        "fp8 E4M3 Q/DQ before MatMul inputs (weights per channel, activations per tensor from --calib-data), the "
        "rest fp16: for TensorRT on Ada/Hopper and later."
    )
    flags: ClassVar[tuple[tuple[Flag, ...], ...]] = (
        (
            Flag(
                "--fp8-float",
                "float_rules",
                multiple=True,
                metavar="RULE",
                help="Also keep these nodes/modules/op types fp16 under --fp8 (rules as for --keep-fp32: "
                "/layers.0.mlp.fc2/, *.q_proj). Repeatable.",
            ),
        ),
    )
    tolerance: ClassVar[Tolerance] = EIGHT_BIT  # 3 mantissa bits: int8's agreement
    bytes_per_weight: ClassVar[float] = 1.0
    implies: ClassVar[tuple[str, ...]] = ("fp16",)  # fp8 graphs are fp16 around the fp8 MatMuls
    min_compute_capability: ClassVar[tuple[int, int, str] | None] = (
        8,
        9,
        "Ada (L4, L40S, RTX 40) or Hopper (H100, H200) or later",
    )
    full_check: ClassVar[bool] = True
    calibration_use: ClassVar[str | None] = "--fp8"
    ways_out: ClassVar[str | None] = (
        "keep the sensitive MatMuls fp16 (--fp8-float RULE), other calibration data (--calib-data, --calib-method)"
    )
