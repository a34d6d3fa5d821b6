"""``--int4``: weight-only int4 MatMul weights, symmetric blocks along K, quantized once per
export (GPTQ on calibration data, or round to nearest) and written as block DequantizeLinear at
opset 21 (``--target ort`` also writes them as MatMulNBits, the same numbers); with ``--fp16`` the
rest of the graph is fp16. Its machinery (the quantizer and the pass) is ``int4.quantize``."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, ClassVar

from kiln.errors import ConfigError
from kiln.exporter.precision.kinds.base import Asked, Flag, Needs, PrecisionKind, Role
from kiln.exporter.tolerance import Tolerance

if TYPE_CHECKING:
    from kiln.plugins.base import DecoderSpec

__all__ = [
    "Int4",
    "Int4Method",
    "DEFAULT_INT4_METHOD",
    "INT4_BLOCKS",
    "TENSORRT_INT4_BLOCKS",
    "GPTQ_SAMPLES",
    "MIN_INT4_OPSET",
]


class Int4Method(str, enum.Enum):
    RTN = "rtn"  # round to nearest, scale amax/7 per block; no data
    GPTQ = "gptq"  # GPTQ (error feedback through the inputs' Hessian) with a clip search, on --calib-data


DEFAULT_INT4_METHOD = Int4Method.GPTQ  # the one that measured best (docs/benchmarks.md, the demo model's accuracy)
INT4_BLOCKS = (16, 32, 64, 128, 256)  # MatMulNBits' blocks are powers of two >= 16
# The blocks TensorRT builds (``lowbit_check.tensorrt_int4_blocks`` reads them from the graphs):
# NVIDIA's ONNX-TensorRT operator table (docs/operators.md, TensorRT 10.15), DequantizeLinear, INT4
# weight-only quantization: "supported block sizes are {64, 128}", the blocked dim one of the last two;
# NvInfer.h, IDequantizeLayer: "For block quantization, the shape of scale tensor must match the shape of
# the input, except for one dimension (the last or second to last dimension) in which blocking occurs."
# Graphs with other blocks (--int4-block 16|32|256, or a smaller block for a K 64 does not divide) are
# ONNX Runtime's only: the export says so, kiln build and trtexec.sh refuse them.
TENSORRT_INT4_BLOCKS = (64, 128)
MIN_INT4_OPSET = 21  # DequantizeLinear's block_size
GPTQ_SAMPLES = 256  # default windows for GPTQ: with 16 it overfits the Hessians (measured on the demo in issue 16)


@dataclasses.dataclass(frozen=True)
class Int4(PrecisionKind):
    block: int = 128  # block size along K (a weight whose K it does not divide gets a smaller power of two)
    method: Int4Method = DEFAULT_INT4_METHOD
    float_rules: tuple[str, ...] = ()  # kept float besides the LM head
    all_matmuls: bool = False  # quantize the LM head too

    name: ClassVar[str] = "int4"
    role: ClassVar[Role] = Role.MATMULS
    machinery: ClassVar[str] = "kiln.exporter.int4.quantize"
    help: ClassVar[str] = (
        "Weight-only int4 MatMul weights (symmetric blocks along K: DequantizeLinear at opset 21; with --target "
        "ort also MatMulNBits, the same numbers); with --fp16 the rest is fp16."
    )
    flags: ClassVar[tuple[tuple[Flag, ...], ...]] = (
        (
            Flag(
                "--int4-method",
                "method",
                choices=tuple(m.value for m in Int4Method),
                default=DEFAULT_INT4_METHOD.value,
                convert=Int4Method,
                help="rtn = round to nearest (no data); gptq = GPTQ with a clip search on --calib-data (measured "
                "better).",
            ),
            Flag(
                "--int4-block",
                "block",
                choices=tuple(map(str, INT4_BLOCKS)),
                default="128",
                convert=int,
                help=(
                    "int4 block size along K (a weight whose K it does not divide gets the largest smaller power of two"
                    " that does); TensorRT builds blocks of 64 and 128 only, other blocks are for ONNX Runtime only."
                ),
            ),
        ),
        (
            Flag(
                "--int4-float",
                "float_rules",
                multiple=True,
                metavar="RULE",
                help="Also keep these nodes/modules/op types in float under --int4 (rules as for --keep-fp32). "
                "Repeatable.",
            ),
            Flag(
                "--int4-all-matmuls",
                "all_matmuls",
                is_flag=True,
                help="Quantize the LM head to int4 too (kept in float by default).",
            ),
        ),
    )
    # 16 levels a block: judged by agreement again, looser than int8's; the graphs are also proved
    # at their float precision's tolerances against PyTorch on these numbers (``weight_only``)
    tolerance: ClassVar[Tolerance] = Tolerance(
        logits_atol=3.0, logits_rtol=0.1, kv_atol=2.0, kv_rtol=0.1, min_cosine=0.97, min_token_match=0.7
    )
    bytes_per_weight: ClassVar[float] = 0.5
    min_opset: ClassVar[int] = MIN_INT4_OPSET
    min_compute_capability: ClassVar[tuple[int, int, str] | None] = (8, 0, "Ampere (A100, A10, RTX 30) or later")
    weight_only: ClassVar[bool] = True
    full_check: ClassVar[bool] = True
    lora_slots: ClassVar[bool] = True  # the slots stay float MatMuls beside its weights
    ways_out: ClassVar[str | None] = (
        "--int4-method gptq (with --calib-data), keep the sensitive MatMuls float (--int4-float RULE), "
        "a smaller --int4-block"
    )
    calibration_use: ClassVar[str | None] = "--int4 (method gptq)"
    default_windows: ClassVar[int] = GPTQ_SAMPLES

    def __post_init__(self) -> None:
        if self.block not in INT4_BLOCKS:
            raise ConfigError(f"--int4-block must be one of {', '.join(map(str, INT4_BLOCKS))}, found {self.block}")

    @property
    def gptq(self) -> bool:
        return self.method is Int4Method.GPTQ

    @property
    def weight_block(self) -> int | None:
        return self.block

    def needs(self) -> Needs:
        return Needs.HESSIANS if self.gptq else Needs.NOTHING

    def reasons(self, spec: DecoderSpec | None, options: Asked) -> list[str]:
        found = []
        if self.gptq and options.calibration.data is None:
            found.append(
                "--int4-method gptq (the default) needs --calib-data: a text file, .jsonl (field 'text') or "
                ".npy/.npz token ids; or pass --int4-method rtn"
            )
        if spec is not None and self.gptq and spec.has_encoder:  # RTN reads no data: every graph is quantized alike
            found.append(
                "--int4-method gptq is not supported for encoder-decoders yet: its calibration runs decoder-only "
                "prompts, with no encoder inputs; use --int4-method rtn"
            )
        elif spec is not None and self.gptq and spec.encoder_dim is not None:
            found.append(
                "--int4-method gptq is not supported for cross-attention decoders yet: its calibration runs "
                "prompts without"
                " encoder_hidden_states; use --int4-method rtn"
            )
        return found
