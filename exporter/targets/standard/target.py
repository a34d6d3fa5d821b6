"""``--target onnx`` as a ``Target`` (``targets.base``): which exports it takes, how it writes its
graphs (``graphs.write_standard_target``, imported when it runs) and how parity runs them
(``runner.StaticCacheRunner``: ONNX Runtime's CPU provider through the static contract)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.errors import ConfigError
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.precision.kinds.plan import Precision

if TYPE_CHECKING:
    from kiln.exporter.options import ExportOptions
    from kiln.exporter.runners.base import Feeds, Runner
    from kiln.exporter.targets.base import TargetGiven, TargetGraphs
    from kiln.plugins.base import DecoderSpec

__all__ = ["BUILT", "STANDARD", "StandardTarget"]

# the precisions whose graphs it rewrites (fp16: with the portable graphs' fp32 islands; the low-bit
# forms: their Q/DQ and block-DequantizeLinear weights kept, the attention MatMuls being float)
BUILT = ("fp32", "fp16", "int4", "int4+fp16", "fp8")
# --int8 (with or without --fp16): the rewritten opset-24 graph is valid ONNX (onnx.checker's full
# check) and its parity passes with --fp16, but ONNX Runtime 1.32's QDQPropagationTransformer cannot
# load it in a default session: it propagates a QuantizeLinear across the prefill's present
# Reshape/Transpose with a uint8 zero point of its own against output_dtype INT8 (measured; it loads
# with that optimizer disabled). fp8's Q/DQ are not propagated and load.
QDQ_PROPAGATION = (
    "--target onnx does not write --int8 graphs yet: ONNX Runtime 1.32's QDQ propagation cannot load their opset-24 form "
    "(a QuantizeLinear it adds has a uint8 zero point against output_dtype INT8); export --int8 without --target onnx, or --fp8 with it"
)


class StandardTarget:
    name = "onnx"
    label = "standard-ONNX-target"
    description = (
        "also write graphs in ONNX's own ops for TensorRT 10.15+ (onnx/*.std.onnx: Attention, RotaryEmbedding, RMSNormalization, a static KV cache written in place "
        "by TensorScatter), parity-checked like the portable ones"
    )

    def wanted(self, options: ExportOptions) -> bool:
        return options.target == self.name

    def check(self, options: ExportOptions) -> None:
        if not self.wanted(options):
            return
        if "int8" in options.precision:
            raise ConfigError(QDQ_PROPAGATION)
        if options.precision.value not in BUILT:
            raise ConfigError(f"--target onnx writes {', '.join(BUILT)} graphs; not {options.precision.value}: export it without --target onnx")
        if options.ple_tables.value == "input":
            raise ConfigError("--target onnx takes the PLE tables as constants; drop --ple-tables input")

    def refuse(self, spec: DecoderSpec) -> None:
        if spec.encoder_dim is not None:
            raise ConfigError("--target onnx is not supported for cross-attention decoders: its static cache holds self-attention keys and values only")
        from kiln.exporter.targets.standard.windows import layer_windows

        layer_windows(spec)  # a window it cannot prove is refused here, before any work

    def write(self, given: TargetGiven) -> TargetGraphs:
        from kiln.exporter.targets.standard.graphs import write_standard_target

        with given.progress.stage("standard-ONNX target graphs"):
            precision = given.options.precision
            return write_standard_target(
                given.onnx_dir, given.portable, given.spec, max_context=given.max_context, precision=precision.value, kv_dtype=precision.kv_dtype, last_logits_only=given.options.last_logits_only
            )

    def quantized_precision(self, precision: str) -> str | None:
        return Precision.parse(precision).weight_only_float  # the portable graphs' int4 DQ MatMuls, unchanged

    def runner(self, paths: dict[GraphKind, Path], extra_feeds: Feeds | None) -> Callable[[], contextlib.AbstractContextManager[Runner]]:
        from kiln.exporter.targets.standard.runner import StaticCacheRunner

        return StaticCacheRunner.opener(paths, extra_feeds)


STANDARD = StandardTarget()
