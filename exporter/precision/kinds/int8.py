"""``--int8``: explicit int8 Q/DQ before MatMul/Gemm inputs (weights per output channel,
activations per tensor, calibrated), the LM head and attention scores kept float by default;
with ``--fp16`` the rest of the graph is fp16. Its machinery (pass and policy) is ``precision.int8``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

from kiln.exporter.precision.kinds.base import Asked, Flag, RangesKind, Role
from kiln.exporter.tolerance import Tolerance

if TYPE_CHECKING:
    from kiln.plugins.base import DecoderSpec

__all__ = ["Int8", "EIGHT_BIT"]

# an approximation by design, judged by agreement (cosine, tokens); the bound a guard against gross
# breakage: the former absolute figures, plus 5% of the row's scale (fp8 shares them)
EIGHT_BIT = Tolerance(
    logits_atol=1.5, logits_rtol=0.05, kv_atol=1.0, kv_rtol=0.05, min_cosine=0.99, min_token_match=0.9
)


@dataclasses.dataclass(frozen=True)
class Int8(RangesKind):
    float_rules: tuple[str, ...] = ()  # kept float besides the LM head and attention scores
    all_matmuls: bool = False  # quantize the LM head and attention scores too

    name: ClassVar[str] = "int8"
    role: ClassVar[Role] = Role.MATMULS
    machinery: ClassVar[str] = "kiln.exporter.precision.int8"
    help: ClassVar[str] = (
        "int8 Q/DQ before MatMul/Gemm inputs (weights per channel, activations per tensor), calibrated on "
        "--calib-data; with --fp16 the rest is fp16."
    )
    flags: ClassVar[tuple[tuple[Flag, ...], ...]] = (
        (
            Flag(
                "--int8-float",
                "float_rules",
                multiple=True,
                metavar="RULE",
                help="Also keep these nodes/modules/op types in float (rules as for --keep-fp32). Repeatable.",
            ),
            Flag(
                "--int8-all-matmuls",
                "all_matmuls",
                is_flag=True,
                help="Quantize the LM head and attention-score MatMuls too (kept in float by default).",
            ),
        ),
    )
    tolerance: ClassVar[Tolerance] = EIGHT_BIT
    bytes_per_weight: ClassVar[float] = 1.0
    calibration_use: ClassVar[str | None] = "--int8"
    ways_out: ClassVar[str | None] = (
        "keep the sensitive MatMuls float (--int8-float RULE), other calibration data (--calib-data, --calib-method)"
    )

    @property
    def quantizes_scores(self) -> bool:
        return self.all_matmuls

    def reasons(self, spec: DecoderSpec | None, options: Asked) -> list[str]:
        found = super().reasons(spec, options)
        if spec is not None and any(t.suffix == "ssm" for _, t in spec.cache_layout.tensors()):
            found.append(state_reason(spec.cache_layout.kind))
        return found


def state_reason(kind: str) -> str:
    """Why --int8 refuses a cache with a recurrent state (Mamba, Mamba2, Gated DeltaNet; an LFM2
    conv window alone is taken): int8 quantizes every MatMul, so the mixers' state MatMuls (the
    SSM readout, the chunked delta rule), which read two activations, get per-tensor activation
    scales that the Q/DQ proof (``precision.qdq_scales``: constant weights only) cannot model; fp8
    quantizes constant weights only, and passes its proof on these mixers."""
    return (
        f"--int8 is not proved on recurrent-state ({kind}) caches: the mixers' state MatMuls read two "
        "activations, which int8 would quantize per tensor unproved; export it at --fp8, --int4 or --fp16"
    )
