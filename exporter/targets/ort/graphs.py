"""``--target ort``'s graphs: ONNX Runtime-target copies of the portable graphs, beside them.

Each portable graph ``onnx/<kind>.onnx`` is reloaded (its weights stay in ``weights.bin``,
memory-mapped, never read unless a pass needs them) and rewritten for ONNX Runtime's fused CPU
contrib kernels into ``onnx/<kind>.ort.onnx`` by the passes ``ort_passes`` lists:

- attention (found by ``patterns.attention``) -> ``RotaryEmbedding`` + ``GroupQueryAttention`` (prefill
  and decode; see ``gqa`` for why model.onnx keeps its portable attention),
- decode: mixture-of-experts blocks -> one ``MoE`` per layer (``moe``: SwiGLU experts with
  softmax top-k routing, renormalised or not; other blocks, and every block of the prompt graphs,
  where the CPU kernel was measured slower, keep their per-expert MatMuls),
- q/k/v projections -> one MatMul on the concatenated weight and a Split, and so any other
  MatMuls that read one input (a SwiGLU MLP's gate and up projections: ``pack``),
- RMSNorm -> ``SimplifiedLayerNormalization``, with the residual Add before it
  ``SkipSimplifiedLayerNormalization`` (``patterns.norm``, ``skip_norm``),
- decode: the family's mask subgraph -> a four-op padding bias when probes prove them equal, or
  equal but for a sliding window of W keys, which becomes GQA's ``local_window_size = W``
  (``decode_mask``),
- with ``int8``: every constant-weight MatMul -> ``MatMulNBits`` (8 bits, weight-only: ``nbits``);
- ``--int4`` graphs: their int4 weights -> ``MatMulNBits`` (4 bits, the portable graphs' own
  numbers, read back from ``weights.bin``: ``int4``).

Each fusion is an onnxscript rewrite rule (pattern / check / rewrite) or, where a pattern cannot
say it, a hand-written matcher of the same shape; every candidate a fusion leaves says why in the
graph's manifest entry (its ``not_fused`` report: fusion -> "layer i: reason"; ``patterns.rules``).

The copies sit in the same directory as the portable graphs because ONNX Runtime refuses
external data outside a model's directory; they share ``weights.bin`` for every weight they
keep, and what the rewrite adds (cos/sin caches, packed and int8 weights) goes to one more file,
``weights.ort.bin``, shared by the three ORT graphs (same names, same offsets). The I/O contract
is unchanged (every rewrite checks it as a postcondition), so parity checks these graphs exactly
as it checks the portable ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from kiln.exporter.contract.io import CacheUpdate, GraphKind
from kiln.exporter.contract.shared_buffer import reads_past_length
from kiln.exporter.passes import (
    ExternalizeWeights,
    GraphRewrite,
    WeightsWriter,
    run_passes,
)
from kiln.exporter.passes.reports import Report, pass_reports
from kiln.exporter.patterns.norm import fuse_rms_norm
from kiln.exporter.patterns.rotary_tables import graph_tables
from kiln.exporter.patterns.rules import NotFused
from kiln.exporter.precision.kinds.plan import Precision
from kiln.exporter.targets.base import TargetGraphs
from kiln.exporter.targets.ort.decode_mask import DecodeMask, compact_decode_bias
from kiln.exporter.targets.ort.gqa import fuse_attention, leave_encoder_attention
from kiln.exporter.targets.ort.int4 import INT4_FORMAT, int4_matmul_nbits, unfold_int4_weights
from kiln.exporter.targets.ort.moe import MoeRewrite, fuse_moe
from kiln.exporter.targets.ort.nbits import (
    ACCURACY_LEVEL,
    BLOCK_SIZE,
    quantize_matmul_nbits,
)
from kiln.exporter.targets.ort.pack import pack_shared_input_matmuls
from kiln.exporter.targets.ort.skip_norm import fuse_skip_rms_norm
from kiln.plugins.base import DecoderSpec

__all__ = ["INT8_FORMAT", "ORT_WEIGHTS_FILE", "ort_graph_file", "ort_passes", "write_ort_target"]

ORT_WEIGHTS_FILE = "weights.ort.bin"
INT8_FORMAT = {"op": "MatMulNBits", "bits": 8, "block_size": BLOCK_SIZE, "accuracy_level": ACCURACY_LEVEL}


def ort_graph_file(kind: GraphKind) -> str:
    return f"{kind.value}.ort.onnx"


def _named(key: str) -> Any:
    """A reporter: ``{key: the result}`` (lists and tuples as lists)."""
    return lambda result: {key: list(result) if isinstance(result, (list, tuple)) else result}


def _mask_report(mask: DecodeMask) -> Report:
    windows = [layer for layer, _ in mask.local_windows]
    return {"compact": mask.compact, **({"local_window_layers": windows} if windows else {})}


def _moe_report(moe: MoeRewrite) -> Report | None:
    return {"layers": list(moe.layers), "not_fused": list(moe.not_fused)} if moe.layers or moe.not_fused else None


def _logging(fusion: Callable[..., Any], log: NotFused) -> Callable[[ir.Model], Any]:
    """``fusion(model, not_fused=log)``, named as ``fusion`` (the pass's name)."""
    return functools.update_wrapper(functools.partial(fusion, not_fused=log), fusion)


def _other_shapes(spec: DecoderSpec) -> dict[int, tuple[int, int]]:
    """The layers whose keys are not ``n_kv_heads`` x ``head_dim`` (a ``per_layer`` cache: Gemma 4's
    global layers): their attention stays portable."""
    if spec.cache is None or spec.cache.kind not in ("per_layer", "shared_kv"):
        return {}
    return {
        layer: (t.heads, t.width)
        for layer, t in spec.cache.tensors()
        if t.suffix == "key" and (t.heads, t.width) != (spec.n_kv_heads, spec.head_dim)
    }


def _attention(
    kind: GraphKind, spec: DecoderSpec, base_dir: Path, max_context: int, log: NotFused
) -> list[GraphRewrite[Any]]:
    """Prefill and decode: attention -> RotaryEmbedding + GroupQueryAttention, and decode's mask
    compacted (GQA's CPU kernel refuses batch > 1 with past and seq > 1: model.onnx keeps its own)."""
    if kind is GraphKind.UNIFIED:
        return []
    if kind is GraphKind.ENCODER:  # an encoder-decoder's encoder: its attention stays portable, reported
        return [GraphRewrite(_logging(leave_encoder_attention, log), "attention", _named("layers"))]

    def fuse(model: ir.Model) -> list[int]:
        tables = graph_tables(model, base_dir, max_context, spec.head_dim)
        return fuse_attention(
            model,
            n_kv_heads=spec.n_kv_heads,
            head_dim=spec.head_dim,
            tables=tables,
            decode=kind is GraphKind.DECODE,
            not_fused=log,
            other_shapes=_other_shapes(spec),
        )

    attention: GraphRewrite[list[int]] = GraphRewrite(
        functools.update_wrapper(fuse, fuse_attention), "attention", _named("layers")
    )
    if kind is not GraphKind.DECODE:
        return [attention]

    def compact(model: ir.Model) -> DecodeMask:
        found = compact_decode_bias(model, base_dir, max_context) if attention.result else DecodeMask(False)
        log.add("decode_mask", found.not_fused)
        return found

    return [
        attention,
        GraphRewrite(functools.update_wrapper(compact, compact_decode_bias), "decode_mask", _mask_report),
    ]


def ort_passes(
    kind: GraphKind,
    spec: DecoderSpec,
    base_dir: Path,
    max_context: int,
    writer: WeightsWriter,
    *,
    int8: bool,
    int4: bool,
    log: NotFused,
) -> list[ir.passes.PassBase]:
    """The ORT target's passes of one graph, in order; ``log`` collects why candidates did not fuse."""
    unused = RemoveUnusedNodesPass
    moe = functools.update_wrapper(functools.partial(fuse_moe, prompts=kind is not GraphKind.DECODE), fuse_moe)
    return [
        *((GraphRewrite(unfold_int4_weights, "int4_unfold"),) if int4 else ()),
        *_attention(kind, spec, base_dir, max_context, log),
        GraphRewrite(moe, "moe", _moe_report),
        GraphRewrite(_logging(fuse_rms_norm, log), "rms_norm", _named("fused")),
        GraphRewrite(_logging(fuse_skip_rms_norm, log), "skip_rms_norm", _named("fused")),
        unused(),  # before packing and quantizing: the replaced q/k/v MatMuls are dead now
        GraphRewrite(_logging(pack_shared_input_matmuls, log), "pack", _named("matmuls")),
        unused(),  # the MatMuls packed away are dead now
        *((GraphRewrite(quantize_matmul_nbits, "nbits_int8", _named("nodes")), unused()) if int8 else ()),
        *((GraphRewrite(int4_matmul_nbits, "nbits_int4", _named("nodes")), unused()) if int4 else ()),
        TopologicalSortPass(),
        ExternalizeWeights(writer),
    ]


def _cache_update(
    passes: dict[GraphKind, dict[str, Report]], spec: DecoderSpec, past_lengths_unread: bool
) -> CacheUpdate:
    """GroupQueryAttention writes the new key/value in place when past and present are one
    buffer: only when every layer's decode attention fused (a layer left portable grows its
    cache with Concat) and no node reads a past's length (``_past_lengths_unread``). An
    encoder-decoder's cache stays grown: its cross cache is no such buffer (``runtime.kv_strategies``'
    shared buffers are the self-attention's only)."""
    fused = passes.get(GraphKind.DECODE, {}).get("attention", {}).get("layers", [])
    every = sorted(fused) == list(range(spec.n_layers))
    return CacheUpdate.SHARED if every and past_lengths_unread and spec.encoder_dim is None else CacheUpdate.GROWN


def _past_lengths_unread(graph: ir.Graph) -> bool:
    """No node reads a ``past_key_values.*`` input's sequence length (``contract.shared_buffer``):
    such a reader (the Shape of a family mask the decode_mask pass could not replace, Llama 4's
    chunks; a position counted from the cache's length, its NoPE layers' temperature) would read
    a shared buffer's capacity, not the tokens in it."""
    pasts = [v for v in graph.inputs if v.name is not None and v.name.startswith("past_key_values.")]
    return not any(
        reads_past_length(use.node.op_type, {k: a.value for k, a in use.node.attributes.items()})
        for value in pasts
        for use in value.uses()
    )


def write_ort_target(
    onnx_dir: Path,
    graphs: dict[GraphKind, Path],
    spec: DecoderSpec,
    *,
    max_context: int,
    int8: bool,
    int4_block: int | None = None,
) -> TargetGraphs:
    """Write ``<kind>.ort.onnx`` beside each portable graph in ``onnx_dir`` (``int4_block``: the
    portable graphs' int4 weights become MatMulNBits bits=4)."""
    reports: dict[GraphKind, dict[str, Report]] = {}
    paths: dict[GraphKind, Path] = {}
    in_place = True
    with WeightsWriter(onnx_dir / ORT_WEIGHTS_FILE, rename=False) as writer:
        for kind, path in graphs.items():
            log = NotFused()
            passes = ort_passes(
                kind, spec, onnx_dir, max_context, writer, int8=int8, int4=int4_block is not None, log=log
            )
            model = run_passes(ir.load(path), passes, graph=f"{kind.value} (ORT target)")
            paths[kind] = onnx_dir / ort_graph_file(kind)
            ir.save(model, paths[kind])
            in_place = in_place and (kind is not GraphKind.DECODE or _past_lengths_unread(model.graph))
            del model
            left = log.record()  # fusion -> "layer i: why" for each candidate left unfused
            reports[kind] = pass_reports(passes) | (
                {"not_fused": {fusion: list(why) for fusion, why in left.items()}} if left else {}
            )
        weights = writer.close()
    precision = Precision.INT8 if int8 else Precision.INT4 if int4_block is not None else Precision.FP32
    record = (
        {"int8": dict(INT8_FORMAT)} if int8 else {"int4": INT4_FORMAT(int4_block)} if int4_block is not None else None
    )
    return TargetGraphs("ort", precision, paths, weights, reports, _cache_update(reports, spec, in_place), record)
