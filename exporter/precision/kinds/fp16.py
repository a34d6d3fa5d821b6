"""``--fp16``: weights, activations and KV cache in fp16, with fp32 islands from a policy
(``precision.policy``: norm statistics, softmax, rotary angles; the logits stay fp32), widened
by ``--keep-fp32`` and what ``--auto-keep-fp32``'s search finds (``precision.sensitivity``).
Its machinery is ``precision.islands`` (the conversion pass: ``precision.fp16``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

from kiln.exporter.precision.kinds.base import Asked, Flag, PrecisionKind, Role
from kiln.exporter.tolerance import Tolerance
from kiln.plugins.base import PLETables

if TYPE_CHECKING:
    from kiln.plugins.base import DecoderSpec

__all__ = ["Fp16"]


@dataclasses.dataclass(frozen=True)
class Fp16(PrecisionKind):
    keep_fp32: tuple[str, ...] = ()  # op types, node names or modules added to the policy
    auto_keep_fp32: bool = False  # search for modules that must stay fp32 for parity

    name: ClassVar[str] = "fp16"
    role: ClassVar[Role] = Role.FLOAT
    machinery: ClassVar[str] = "kiln.exporter.precision.islands"
    help: ClassVar[str] = (
        "fp16 weights, activations and KV cache, with fp32 islands (norm statistics, softmax, rotary angles, logits)."
    )
    flags: ClassVar[tuple[tuple[Flag, ...], ...]] = (
        (
            Flag(
                "--keep-fp32",
                "keep_fp32",
                multiple=True,
                metavar="OP_TYPE|NODE_NAME",
                help="Also keep these op types, node names (/layers.0.attn/MatMul) or modules (/layers.0.mlp.fc2/, "
                "*.fc2: the nodes of exactly that module) in fp32. Repeatable.",
            ),
            Flag(
                "--auto-keep-fp32",
                "auto_keep_fp32",
                is_flag=True,
                help="With --fp16: search (bisection on ONNX Runtime) for modules that must stay fp32 for parity, and "
                "keep them.",
            ),
        ),
    )
    # fp16 weights, activations and KV (10-bit mantissa) against fp32 PyTorch: the former absolute
    # figures stay as atol, rtol is 5 fp16 ulps of the row's scale (the cache is itself rounded to
    # fp16: half an ulp, 4.9e-4 of it; measured rows reach 2e-3 of their scale)
    tolerance: ClassVar[Tolerance] = Tolerance(
        logits_atol=5e-2, logits_rtol=5e-3, kv_atol=2e-2, kv_rtol=5e-3, min_cosine=0.9999
    )
    bytes_per_weight: ClassVar[float] = 2.0
    lora_slots: ClassVar[bool] = True

    def reasons(self, spec: DecoderSpec | None, options: Asked) -> list[str]:
        found = []
        if self.auto_keep_fp32 and options.ple.tables is PLETables.INPUT:
            found.append("--auto-keep-fp32 cannot be combined with --ple-tables input")
        if spec is not None and spec.has_encoder and self.auto_keep_fp32:
            found.append(
                "--auto-keep-fp32 is not supported for encoder-decoders yet: its search runs the decoder's "
                "unified graph only, never the encoder; pass --keep-fp32 rules"
            )
        return found
