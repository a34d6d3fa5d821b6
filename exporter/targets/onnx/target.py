"""``--target onnx`` as a ``Target`` (``targets.base``): which exports it takes, how it writes its
graphs (``graphs.write_onnx_target``, imported when it runs) and how parity runs them
(``runner.StaticCacheRunner``: ONNX Runtime's CPU provider through the static contract)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.errors import ConfigError
from kiln.exporter.contract.io import CacheUpdate, GraphKind
from kiln.exporter.precision.kinds.plan import Precision
from kiln.exporter.targets.base import EngineGraphs
from kiln.registry import Flag

if TYPE_CHECKING:
    from kiln.exporter.options import ExportOptions
    from kiln.exporter.runners.base import Feeds, Runner
    from kiln.exporter.targets.base import TargetGiven, TargetGraphs
    from kiln.plugins.base import DecoderSpec

__all__ = ["ALL_MATMULS", "ENGINES", "ONNX", "OnnxTarget"]

# every precision is written (int8's Q/DQ in the form precision.int8_form gives them); the attention
# score MatMuls stay float: each layer's attention becomes one ONNX Attention (measured with
# --int8-all-matmuls: the attention pattern is not found behind their Q/DQ, and the export stops)
ALL_MATMULS = (
    "--target onnx does not take --int8-all-matmuls: it writes each layer's attention as one ONNX Attention, "
    "whose score MatMuls are float; "
    "drop --int8-all-matmuls, or export without --target onnx"
)

# kiln build --graphs onnx: TensorRT 10.15 is the first whose ONNX parser imports TensorScatter, RotaryEmbedding and
# RMSNormalization, and has IKVCacheUpdateLayer, the layer the static cache is written in place by
# (exporter/engine/graphs.py)
ENGINES = EngineGraphs(
    (10, 15),
    "TensorRT 10.15 or newer (the first whose ONNX parser imports TensorScatter, RotaryEmbedding and RMSNormalization)",
)


class OnnxTarget:
    name = "onnx"
    label = "ONNX-target"
    description = (
        "also write graphs in ONNX's own ops for TensorRT 10.15+ (onnx/*.std.onnx: Attention, RotaryEmbedding, "
        "RMSNormalization, a static KV cache written in place "
        "by TensorScatter), parity-checked like the portable ones"
    )
    kv_caches: tuple[CacheUpdate, ...] = (CacheUpdate.STATIC,)
    flags: tuple[Flag, ...] = ()
    letter = "x"
    lora_slots = False
    engines = ENGINES  # kiln build makes TensorRT engines of its graphs (--graphs onnx)

    def wanted(self, options: ExportOptions) -> bool:
        return options.target == self.name

    def reasons(self, spec: DecoderSpec | None, options: ExportOptions) -> list[str]:
        if not self.wanted(options):
            return []
        found = []
        if options.precision.quantizes_scores:
            found.append(ALL_MATMULS)
        if options.ple.tables.value == "input":
            found.append("--target onnx takes the PLE tables as constants; drop --ple-tables input")
        if spec is not None and spec.encoder_dim is not None:
            found.append(
                "--target onnx is not supported for cross-attention decoders: its static cache holds "
                "self-attention keys and values only"
            )
        elif spec is not None and spec.cache is not None and spec.cache.reads:
            found.append(
                "--target onnx is not supported for a shared_kv cache (layers that read another layer's keys and "
                "values): its static cache gives every layer a buffer of its own; the portable graphs export it"
            )
        elif spec is not None and spec.cache is not None and spec.cache.kind == "per_layer":
            found.append(
                "--target onnx is not supported for a per_layer cache (keys and values of each layer's own heads and "
                "width): its static cache is sized by one head count and head dim; the portable graphs (and "
                "--target ort) export it"
            )
        elif spec is not None and spec.cache is not None and spec.cache.kind in ("state", "hybrid"):
            from kiln.exporter.targets.onnx.states import refuse_state

            why = refuse_state(spec, options.precision.value)  # keys in the static cache, states plain inputs/outputs
            found += [why] if why else []
        elif spec is not None and spec.cache is not None:
            found.append(
                f"--target onnx is not supported for a {spec.cache.kind} cache (multi-head latent attention): "
                "its static cache and Attention op hold"
                " keys and values per KV head; the portable graphs (and --target ort, whose attention stays "
                "portable) export it"
            )
        elif spec is not None:
            from kiln.exporter.targets.onnx.windows import layer_windows

            try:
                layer_windows(spec)  # a window it cannot prove is refused here, before any work
            except ConfigError as exc:
                found.append(str(exc.args[0]))
        return found

    def write(self, given: TargetGiven) -> TargetGraphs:
        from kiln.exporter.targets.onnx.graphs import write_onnx_target

        with given.progress.stage("ONNX target graphs"):
            precision = given.options.precision
            return write_onnx_target(
                given.onnx_dir,
                given.portable,
                given.spec,
                max_context=given.max_context,
                precision=precision,
                kv_dtype=precision.kv_dtype,
                last_logits_only=given.options.graphs.last_logits_only,
            )

    def quantized_precision(self, precision: Precision) -> Precision | None:
        return precision.weight_only_judge  # the portable graphs' int4 DQ MatMuls, unchanged

    def serves_genai(self, precision: Precision) -> bool:
        return False  # GenAI runs the portable unified graph

    def runner(
        self, paths: dict[GraphKind, Path], extra_feeds: Feeds | None
    ) -> Callable[[], contextlib.AbstractContextManager[Runner]]:
        from kiln.exporter.targets.onnx.runner import StaticCacheRunner

        return StaticCacheRunner.opener(paths, extra_feeds)


ONNX = OnnxTarget()
