"""``--target onnx``'s graphs: copies of the portable graphs in ONNX's own operators (opset 24),
with the KV cache a static buffer written in place (``contract.static_cache``), beside them.

Each portable graph ``onnx/<kind>.onnx`` is reloaded (its weights stay in ``weights.bin``) and
rewritten into ``onnx/<kind>.std.onnx`` by the passes ``onnx_passes`` lists:

- the graph converted to opset 24 (onnxscript's version converter),
- each attention's q and k rotary -> ``RotaryEmbedding`` (``rotary``),
- attention -> ``TensorScatter`` into the static cache + ``Attention`` with an explicit mask
  (``cache``, ``mask``),
- RMSNorm -> ``RMSNormalization`` (the rule ``--target ort`` uses too, writing ONNX's op: ``patterns.norm``;
  in fp16 graphs the fp16 pass's island first, computed over fp32 casts of it: ``norm_fp16``),
- int8 Q/DQ in the form ONNX Runtime loads at opset 24 (``precision.int8_form``: no zero point,
  the QuantizeLinear's ``output_dtype`` INT8),
- a recurrent-state model's graph checked for ops TensorRT's parser imports, its op types reported
  (``states.standard_ops``).

What a pass leaves as traced is said in each graph's ``not_fused`` report. What the graphs add
(the rotary tables, the mask's slot numbers) goes to ``weights.std.bin``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, ShapeInferencePass, TopologicalSortPass

from kiln.exporter.contract.io import CacheUpdate, GraphKind
from kiln.exporter.contract.static_cache import static_io
from kiln.exporter.passes import ExternalizeWeights, GraphRewrite, WeightsWriter, run_passes
from kiln.exporter.passes.reports import Report, pass_reports
from kiln.exporter.patterns.norm import fuse_rms_norm
from kiln.exporter.patterns.rules import NotFused
from kiln.exporter.precision.int8_form import int8_type_attribute_form
from kiln.exporter.precision.kinds.base import Needs, Role
from kiln.exporter.precision.kinds.plan import Precision
from kiln.exporter.precision.lowbit_check import CheckLowBit
from kiln.exporter.targets.base import TargetGraphs
from kiln.exporter.targets.onnx.cache import StaticCache
from kiln.exporter.targets.onnx.norm_fp16 import fuse_fp16_rms_norm
from kiln.exporter.targets.onnx.rotary import onnx_rotary
from kiln.exporter.targets.onnx.states import standard_ops
from kiln.exporter.targets.onnx.windows import layer_windows
from kiln.plugins.base import DecoderSpec

__all__ = ["OPSET", "ONNX_WEIGHTS_FILE", "onnx_graph_file", "onnx_passes", "write_onnx_target"]

OPSET = 24  # Attention (23), RMSNormalization (23), TensorScatter (24)
IR_VERSION = 11  # what opset 24 needs (onnx 1.19)
ONNX_WEIGHTS_FILE = "weights.std.bin"


def onnx_graph_file(kind: GraphKind) -> str:
    return f"{kind.value}.std.onnx"


def to_opset(model: ir.Model) -> int:
    """The graph in opset ``OPSET`` (its default domain; nodes whose form changed are rewritten)."""
    from onnxscript.version_converter import convert_version

    convert_version(model, OPSET)
    model.ir_version = max(model.ir_version, IR_VERSION)
    return OPSET


def onnx_passes(
    kind: GraphKind,
    spec: DecoderSpec,
    base_dir: Path,
    max_context: int,
    writer: WeightsWriter,
    *,
    kv_dtype: str,
    last_logits_only: bool,
    log: NotFused,
    precision: Precision = Precision.FP32,
) -> list[ir.passes.PassBase]:
    """The target's passes of one graph of ``precision``, in order. An int8 or fp8 graph gets
    ONNX's shape inference first (it comes back from ONNX Runtime's quantizer without the shapes
    the attention pattern reads: its heads' static dims); an int8 graph's Q/DQ get the type-attribute
    form (``int8_form``); every low-bit graph is checked again by TensorRT's Q/DQ rules
    (``lowbit_check``) once rewritten."""
    infer_shapes = precision.needs(Needs.RANGES)  # int8, fp8
    low_bit = any(k.role is Role.MATMULS for k in precision.kinds)  # int8, fp8, int4
    rotary = functools.update_wrapper(
        functools.partial(
            onnx_rotary, base_dir=base_dir, max_context=max_context, head_dim=spec.head_dim, not_fused=log
        ),
        onnx_rotary,
    )
    norm = functools.update_wrapper(
        functools.partial(fuse_rms_norm, not_fused=log, op_type="RMSNormalization"), fuse_rms_norm
    )
    return [
        GraphRewrite(to_opset, "opset", lambda opset: {"version": opset}),
        *([ShapeInferencePass()] if infer_shapes else []),
        GraphRewrite(rotary, "rotary", lambda layers: {"layers": list(layers)}),
        StaticCache(
            spec, kind, max_context, windows=layer_windows(spec), kv_dtype=kv_dtype, last_logits_only=last_logits_only
        ),
        *(
            [GraphRewrite(fuse_fp16_rms_norm, "rms_norm_fp16", lambda fused: {"fused": fused})]
            if precision.float16
            else []
        ),
        GraphRewrite(norm, "rms_norm", lambda fused: {"fused": fused}),
        *(
            [GraphRewrite(int8_type_attribute_form, "int8_form", lambda count: {"qdq": count})]
            if "int8" in precision
            else []
        ),
        *([CheckLowBit()] if low_bit else []),
        RemoveUnusedNodesPass(),
        *(
            [GraphRewrite(standard_ops, "standard_ops", lambda ops: {"op_types": ops})]
            if spec.cache_layout.kind in ("state", "hybrid")
            else []
        ),  # a recurrent mixer's trace: ONNX's own ops only (``states``)
        TopologicalSortPass(),
        ExternalizeWeights(writer),
    ]


def write_onnx_target(
    onnx_dir: Path,
    graphs: dict[GraphKind, Path],
    spec: DecoderSpec,
    *,
    max_context: int,
    precision: Precision = Precision.FP32,
    kv_dtype: str = "float32",
    last_logits_only: bool = False,
) -> TargetGraphs:
    """Write ``<kind>.std.onnx`` beside each portable graph in ``onnx_dir`` (of ``precision``,
    its cache ``kv_dtype``: the portable graphs' own)."""
    reports: dict[GraphKind, dict[str, Report]] = {}
    paths: dict[GraphKind, Path] = {}
    with WeightsWriter(onnx_dir / ONNX_WEIGHTS_FILE, rename=False) as writer:
        for kind, path in graphs.items():
            log = NotFused()
            passes = onnx_passes(
                kind,
                spec,
                onnx_dir,
                max_context,
                writer,
                kv_dtype=kv_dtype,
                last_logits_only=last_logits_only,
                log=log,
                precision=precision,
            )
            model = run_passes(ir.load(path), passes, graph=f"{kind.value} (onnx target)")
            paths[kind] = onnx_dir / onnx_graph_file(kind)
            ir.save(model, paths[kind])
            del model
            left = log.record()
            reports[kind] = pass_reports(passes) | (
                {"not_fused": {fusion: list(why) for fusion, why in left.items()}} if left else {}
            )
        weights = writer.close()
    io = {
        kind: static_io(spec, kind, max_context=max_context, kv_dtype=kv_dtype, last_logits_only=last_logits_only)
        for kind in paths
    }
    return TargetGraphs("onnx", precision, paths, weights, reports, CacheUpdate.STATIC, None, io)
