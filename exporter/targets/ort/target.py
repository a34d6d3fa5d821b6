"""``--target ort`` as a ``Target`` (``targets.base``): which exports it takes, how it writes its
graphs (``graphs.write_ort_target``, imported when it runs) and how parity runs them (ONNX
Runtime's CPU provider, as the portable graphs)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.exporter.contract.io import CacheUpdate, GraphKind
from kiln.exporter.precision.kinds.base import Needs
from kiln.exporter.precision.kinds.plan import Precision
from kiln.registry import Flag, Writes

if TYPE_CHECKING:
    from kiln.exporter.options import ExportOptions
    from kiln.exporter.runners.base import Feeds, Runner
    from kiln.exporter.targets.base import TargetGiven, TargetGraphs
    from kiln.plugins.base import DecoderSpec

__all__ = ["INT8", "ORT", "OrtTarget"]

INT8 = Flag(
    "--ort-int8",
    "ort_int8",
    is_flag=True,
    help=(
        "With --target ort: the ORT-target graphs use weight-only int8 MatMulNBits (no calibration data); "
        "the portable graphs keep their precision."
    ),
    writes=Writes("int8", "only as --ort-int8 (weight-only int8 MatMulNBits; --int8 is refused)"),
)


class OrtTarget:
    name = "ort"
    label = "ONNX Runtime-target"
    description = (
        "also write ONNX Runtime-target graphs (onnx/*.ort.onnx: GroupQueryAttention, RotaryEmbedding, "
        "SimplifiedLayerNormalization), parity-checked like the portable ones"
    )
    # grown where a layer's attention did not fuse, another node reads a past, or a cross cache is carried
    # (``graphs._cache_update``)
    kv_caches: tuple[CacheUpdate, ...] = (CacheUpdate.SHARED, CacheUpdate.GROWN)
    flags: tuple[Flag, ...] = (INT8,)
    letter = "o"
    lora_slots = True  # the slots stay float MatMuls beside MatMulNBits weights

    def wanted(self, options: ExportOptions) -> bool:
        return options.target == self.name

    def reasons(self, spec: DecoderSpec | None, options: ExportOptions) -> list[str]:
        found = []
        int8 = _int8(options)
        if int8 and not self.wanted(options):
            found.append("--ort-int8 only applies to --target ort (it quantizes the ONNX Runtime-target graphs)")
        if int8 and options.precision.weight_only:
            found.append("--ort-int8 and --int4 both quantize the ONNX Runtime-target weights; choose one")
        if self.wanted(options) and (
            options.precision.float16 or options.precision.needs(Needs.RANGES)
        ):  # fp32 and int4 only
            found.append(
                "--target ort rewrites fp32 graphs and cannot be combined with --fp16/--int8/--fp8 (found "
                f"{options.precision.value}); "
                "for int8 on ONNX Runtime use --target ort --ort-int8, for int4 --target ort --int4"
            )
        if spec is not None and int8 and spec.encoder_dim is not None:
            found.append(
                "--ort-int8 is not supported for cross-attention decoders yet: parity judges its int8 weights against "
                "the float model, and the encoder's and the decoder's rounding together miss int8's tolerance (the "
                "tiny BART: prefill logits cosine 0.985 < 0.99); use --target ort --int4 --int4-method rtn or fp32"
            )
        return found

    def write(self, given: TargetGiven) -> TargetGraphs:
        from kiln.exporter.targets.ort.graphs import write_ort_target

        options = given.options
        int4 = options.precision.weight_block
        with given.progress.stage("ONNX Runtime target graphs"):
            int8 = _int8(options)
            return write_ort_target(
                given.onnx_dir, given.portable, given.spec, max_context=given.max_context, int8=int8, int4_block=int4
            )

    def quantized_precision(self, precision: Precision) -> Precision | None:
        """int4: int8's tolerances. Its MatMulNBits hold the portable graphs' int4 numbers but,
        at ``accuracy_level`` 4, quantize the activations to int8 per block: the approximation
        left between it and PyTorch on those weights (--ort-int8's own weights are not the
        portable graphs': None)."""
        return Precision.INT8 if precision.weight_only else None

    def serves_genai(self, precision: Precision) -> bool:
        """int4: MatMulNBits bits=4 is what is fast on ONNX Runtime (the portable graph's
        DequantizeLinear would also run; same I/O contract)."""
        return precision.weight_only

    def runner(
        self, paths: dict[GraphKind, Path], extra_feeds: Feeds | None
    ) -> Callable[[], contextlib.AbstractContextManager[Runner]]:
        from kiln.exporter.runners import OrtRunner

        return OrtRunner.opener(paths, extra_feeds)


def _int8(options: ExportOptions) -> bool:
    """``--ort-int8``: the ORT-target graphs' MatMuls as weight-only int8 MatMulNBits."""
    return bool(options.target_flags.get(INT8.field, False))


ORT = OrtTarget()
