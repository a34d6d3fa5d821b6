"""Export options: one frozen dataclass that the CLI fills and every stage reads."""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from pathlib import Path

from kiln.errors import ConfigError
from kiln.plugins.base import PLEExtendMode

__all__ = ["Adapter", "Precision", "Int4Method", "LogitsMode", "PLEExtendMode", "PLETables", "ExportOptions", "MIN_OPSET", "MAX_OPSET", "TRITON_NAME"]

MIN_OPSET, MAX_OPSET = 18, 23
TRITON_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a Triton model name (and a directory name)


class Precision(str, enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"  # weights, activations and KV cache fp16; fp32 islands from a policy
    INT8 = "int8"  # Q/DQ int8 MatMuls, the rest fp32
    INT8_FP16 = "int8+fp16"  # Q/DQ int8 MatMuls, the rest fp16 (the usual TensorRT combination)
    INT4 = "int4"  # weight-only int4 block DQ MatMul weights, the rest fp32
    INT4_FP16 = "int4+fp16"  # the same, the rest fp16
    FP8 = "fp8"  # fp8 E4M3 Q/DQ MatMul inputs, the rest fp16

    @classmethod
    def of(cls, fp16: bool, int8: bool, int4: bool = False, fp8: bool = False) -> Precision:
        chosen = [flag for flag, on in (("--int8", int8), ("--int4", int4), ("--fp8", fp8)) if on]
        if len(chosen) > 1:
            raise ConfigError(f"{' and '.join(chosen)} are different precisions of the same MatMuls; choose one")
        if fp8:
            return cls.FP8  # fp8 graphs are fp16 around the fp8 MatMuls (--fp16 is implied)
        if int4:
            return cls.INT4_FP16 if fp16 else cls.INT4
        return {(False, False): cls.FP32, (True, False): cls.FP16, (False, True): cls.INT8, (True, True): cls.INT8_FP16}[(fp16, int8)]

    @property
    def has_fp16(self) -> bool:
        return self in (Precision.FP16, Precision.INT8_FP16, Precision.INT4_FP16, Precision.FP8)

    @property
    def has_int8(self) -> bool:
        return self in (Precision.INT8, Precision.INT8_FP16)

    @property
    def has_int4(self) -> bool:
        return self in (Precision.INT4, Precision.INT4_FP16)

    @property
    def has_fp8(self) -> bool:
        return self is Precision.FP8

    @property
    def needs_ranges(self) -> bool:
        """Whether the graphs need calibrated activation ranges (int8 and fp8 activation Q/DQ)."""
        return self.has_int8 or self.has_fp8

    @property
    def weight_only_float(self) -> str | None:
        """A weight-only precision's float precision (int4: fp32, int4+fp16: fp16): the tolerances a
        graph of it meets against PyTorch on its own quantized weights (``parity.quantized``); None
        for any other (its activations are quantized too, or nothing is)."""
        return {Precision.INT4: "fp32", Precision.INT4_FP16: "fp16"}.get(self)

    @property
    def kv_dtype(self) -> str:
        return "float16" if self.has_fp16 else "float32"

    @property
    def min_bytes_per_weight(self) -> float:
        """The fewest bytes a weight takes in the graphs (what stays float takes more): a lower
        bound of the weights file's size per parameter, to refuse a disk that cannot hold it."""
        return 0.5 if self.has_int4 else 1.0 if self.has_int8 or self.has_fp8 else 2.0 if self.has_fp16 else 4.0


class Int4Method(str, enum.Enum):
    RTN = "rtn"  # round to nearest, scale amax/7 per block; no data
    GPTQ = "gptq"  # GPTQ (error feedback through the inputs' Hessian) with a clip search, on --calib-data


DEFAULT_INT4_METHOD = Int4Method.GPTQ  # the one that measured best (docs/benchmarks.md, the demo model's accuracy)
INT4_BLOCKS = (16, 32, 64, 128, 256)  # MatMulNBits' blocks are powers of two >= 16
GPTQ_SAMPLES = 256  # default windows for GPTQ: with 16 it overfits the Hessians (measured on the demo in issue 16)
CALIB_SAMPLES = 32  # default windows for int8/fp8 activation ranges


class LogitsMode(str, enum.Enum):
    ALL = "all"  # logits for every prompt position
    LAST = "last"  # prefill computes the LM head for the last position only


class PLETables(str, enum.Enum):
    CONSTANT = "constant"  # folded tables are initializers in the weights file
    INPUT = "input"  # folded tables are graph inputs (serving stacks that swap them)


@dataclasses.dataclass(frozen=True)
class Adapter:
    """``--adapter DIR[:WEIGHT]``: a PEFT LoRA adapter merged into the checkpoint with this weight."""

    path: Path  # as given
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.weight):
            raise ConfigError(f"--adapter {self.path}: its weight must be a finite number, found {self.weight}")


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    max_batch: int = 8
    max_context: int | None = None  # None: the model's own limit (its PLE table or max_context)
    logits: LogitsMode = LogitsMode.ALL
    opset: int = 19  # 19: fp16 Q/DQ scales need it; TensorRT 10 parses it
    ple_extend: int | None = None
    ple_extend_mode: PLEExtendMode = PLEExtendMode.CLAMP
    ple_tables: PLETables = PLETables.CONSTANT
    precision: Precision = Precision.FP32
    keep_fp32: tuple[str, ...] = ()  # op types, node names or modules added to the fp16 policy
    auto_keep_fp32: bool = False  # search for modules that must stay fp32 for fp16 parity
    calib_data: str | None = None  # text/.jsonl/.npy/.npz path, or "synthetic"
    calib_samples: int | None = None  # None: CALIB_SAMPLES, or GPTQ_SAMPLES for --int4-method gptq
    calib_method: str = "max"  # max | percentile | entropy | mse
    calib_percentile: float = 99.99
    calib_cache: Path | None = None  # directory of cached ranges; None: no cache
    int8_float: tuple[str, ...] = ()  # rules kept in float besides the LM head and attention scores
    int8_all_matmuls: bool = False  # quantize the LM head and attention scores too
    int4_block: int = 128  # int4 block size along K (a weight whose K it does not divide gets a smaller power of two)
    int4_method: Int4Method = DEFAULT_INT4_METHOD
    int4_float: tuple[str, ...] = ()  # rules kept in float besides the LM head
    fp8_float: tuple[str, ...] = ()  # rules kept fp16 under --fp8 besides the LM head and attention scores
    int4_all_matmuls: bool = False  # quantize the LM head too
    target: str = "portable"  # "portable" (the portable graphs only), or a registered target's name (``exporter.targets``)
    ort_int8: bool = False  # the ORT-target graphs with weight-only int8 MatMulNBits
    parity_tokens: int = 64  # greedy tokens generated by the parity check
    parity_agreement: str = "gate"  # int4: whether agreement with the checkpoint's model gates the export ("gate") or is recorded only ("record")
    triton: str | None = None  # also write a Triton model repository under this model name
    force: bool = False  # replace a non-empty output directory
    adapters: tuple[Adapter, ...] = ()  # PEFT LoRA adapters merged into a Hugging Face checkpoint (``plugins.hf.adapter``)

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ConfigError(f"--max-batch must be at least 1, found {self.max_batch}")
        if self.max_context is not None and self.max_context < 2:
            raise ConfigError(f"--max-context must be at least 2, found {self.max_context}")
        if not MIN_OPSET <= self.opset <= MAX_OPSET:
            raise ConfigError(f"--opset must be between {MIN_OPSET} and {MAX_OPSET}, found {self.opset}")
        if self.ple_extend is not None and self.ple_extend < 2:
            raise ConfigError(f"--ple-extend must be at least 2 rows, found {self.ple_extend}")
        flag = "--int8" if self.precision.has_int8 else "--fp8"
        if self.precision.needs_ranges:
            if self.calib_data is None:
                raise ConfigError(f"{flag} needs --calib-data: a text file, .jsonl (field 'text'), .npy/.npz token ids, or 'synthetic'")
            if self.opset < 19:
                raise ConfigError(f"{flag} needs --opset 19 or later (fp16 Q/DQ scales), found {self.opset}")
            if self.calib_method not in ("max", "percentile", "entropy", "mse"):
                raise ConfigError(f"--calib-method must be one of max, percentile, entropy, mse, found {self.calib_method!r}")
            if not 0.0 < self.calib_percentile <= 100.0:
                raise ConfigError(f"--calib-percentile must be in (0, 100], found {self.calib_percentile}")
        elif self.gptq:
            if self.calib_data is None:
                raise ConfigError(
                    "--int4-method gptq (the default) needs --calib-data: a text file, .jsonl (field 'text') or .npy/.npz token ids; or pass --int4-method rtn"
                )
        elif self.calib_data is not None:
            raise ConfigError("--calib-data only applies to --int8, --fp8 and --int4 (method gptq) exports")
        if self.calib_samples is not None and self.calib_samples < 1:
            raise ConfigError(f"--calib-samples must be at least 1, found {self.calib_samples}")
        if (self.int8_float or self.int8_all_matmuls) and not self.precision.has_int8:
            raise ConfigError("--int8-float and --int8-all-matmuls only apply to --int8 exports")
        if (self.int4_float or self.int4_all_matmuls) and not self.precision.has_int4:
            raise ConfigError("--int4-float and --int4-all-matmuls only apply to --int4 exports")
        if self.fp8_float and not self.precision.has_fp8:
            raise ConfigError("--fp8-float only applies to --fp8 exports")
        if self.int4_block not in INT4_BLOCKS:
            raise ConfigError(f"--int4-block must be one of {', '.join(map(str, INT4_BLOCKS))}, found {self.int4_block}")
        if (self.keep_fp32 or self.auto_keep_fp32) and not self.precision.has_fp16:
            raise ConfigError("--keep-fp32 and --auto-keep-fp32 only apply to --fp16 exports")
        if self.auto_keep_fp32 and self.ple_tables is PLETables.INPUT:
            raise ConfigError("--auto-keep-fp32 cannot be combined with --ple-tables input")
        from kiln.exporter.targets import PORTABLE, target, targets

        if self.target != PORTABLE:
            target(self.target)  # an unknown name is refused
        for each in targets():  # each target refuses what it cannot build (its own flags without it too)
            each.check(self)
        if self.triton is not None and not TRITON_NAME.match(self.triton):
            raise ConfigError(f"triton: model name {self.triton!r} must start with a letter or digit and hold only letters, digits, '_', '.' and '-'")
        if self.parity_tokens < 1:
            raise ConfigError(f"parity tokens must be at least 1, found {self.parity_tokens}")
        if self.parity_agreement not in ("gate", "record"):
            raise ConfigError(f"--parity-agreement must be gate or record, found {self.parity_agreement!r}")
        if self.parity_agreement == "record" and self.precision.weight_only_float is None:
            raise ConfigError(
                f"--parity-agreement record only applies to --int4 exports, whose graphs are also checked against PyTorch on their own int4 weights; "
                f"a {self.precision.value} export's only proof is its agreement with the checkpoint's model"
            )

    @property
    def gptq(self) -> bool:
        return self.precision.has_int4 and self.int4_method is Int4Method.GPTQ

    @property
    def samples(self) -> int:
        """Calibration windows: ``--calib-samples``, or the default of the method that reads them."""
        if self.calib_samples is not None:
            return self.calib_samples
        return GPTQ_SAMPLES if self.gptq else CALIB_SAMPLES

    @property
    def data_inputs(self) -> tuple[Path, ...]:
        """The files and folders besides the checkpoint that an export reads (never replaced by its output)."""
        data = (Path(self.calib_data),) if self.calib_data not in (None, "synthetic") else ()
        return data + ((self.calib_cache,) if self.calib_cache is not None else ()) + tuple(a.path for a in self.adapters)

    @property
    def graph_opset(self) -> int:
        """The opset the graphs are written at: ``--opset``, raised to 21 for int4 (DequantizeLinear's ``block_size``)."""
        return max(self.opset, 21) if self.precision.has_int4 else self.opset

    @property
    def last_logits_only(self) -> bool:
        return self.logits is LogitsMode.LAST
