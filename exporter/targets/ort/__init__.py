"""``--target ort``: ONNX Runtime-target copies of the portable graphs, beside them.

Each portable graph ``onnx/<kind>.onnx`` is reloaded (its weights stay in ``weights.bin``,
memory-mapped, never read unless a pass needs them) and rewritten for ONNX Runtime's fused CPU
contrib kernels into ``onnx/<kind>.ort.onnx`` by the passes ``ort_passes`` lists:

- attention (found by ``attention``) -> ``RotaryEmbedding`` + ``GroupQueryAttention`` (prefill
  and decode; see ``gqa`` for why model.onnx keeps its portable attention),
- decode: mixture-of-experts blocks -> one ``MoE`` per layer (``moe``: SwiGLU experts with
  softmax top-k routing, renormalised or not; other blocks, and every block of the prompt graphs,
  where the CPU kernel was measured slower, keep their per-expert MatMuls),
- q/k/v projections -> one MatMul on the concatenated weight and a Split, and so any other
  MatMuls that read one input (a SwiGLU MLP's gate and up projections: ``pack``),
- RMSNorm -> ``SimplifiedLayerNormalization``, with the residual Add before it
  ``SkipSimplifiedLayerNormalization`` (``norm``),
- decode: the family's mask subgraph -> a four-op padding bias when probes prove them equal, or
  equal but for a sliding window of W keys, which becomes GQA's ``local_window_size = W``
  (``decode_mask``),
- with ``int8``: every constant-weight MatMul -> ``MatMulNBits`` (8 bits, weight-only: ``nbits``);
- ``--int4`` graphs: their int4 weights -> ``MatMulNBits`` (4 bits, the portable graphs' own
  numbers, read back from ``weights.bin``: ``int4``).

Each fusion is an onnxscript rewrite rule (pattern / check / rewrite) or, where a pattern cannot
say it, a hand-written matcher of the same shape; every candidate a fusion leaves says why in the
graph's manifest entry (``not_fused``: fusion -> "layer i: reason"; ``rules``).

The copies sit in the same directory as the portable graphs because ONNX Runtime refuses
external data outside a model's directory; they share ``weights.bin`` for every weight they
keep, and what the rewrite adds (cos/sin caches, packed and int8 weights) goes to one more file,
``weights.ort.bin``, shared by the three ORT graphs (same names, same offsets). The I/O contract
is unchanged (every rewrite checks it as a postcondition), so parity checks these graphs exactly
as it checks the portable ones.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import onnx_ir as ir
from kiln.exporter.artifacts.layout import ONNX_DIR
from kiln.exporter.artifacts.manifest import OrtGraphEntry
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.passes import (
    ExternalizeWeights,
    GraphRewrite,
    SharedWeights,
    WeightsWriter,
    run_passes,
)
from kiln.exporter.targets.ort.decode_mask import DecodeMask, compact_decode_bias
from kiln.exporter.targets.ort.gqa import fuse_attention
from kiln.exporter.targets.ort.int4 import int4_matmul_nbits, unfold_int4_weights
from kiln.exporter.targets.ort.moe import MoeRewrite, fuse_moe
from kiln.exporter.targets.ort.nbits import (
    ACCURACY_LEVEL,
    BLOCK_SIZE,
    quantize_matmul_nbits,
)
from kiln.exporter.targets.ort.norm import fuse_rms_norm, fuse_skip_rms_norm
from kiln.exporter.targets.ort.pack import pack_shared_input_matmuls
from kiln.exporter.targets.ort.rotary_tables import graph_tables
from kiln.exporter.targets.ort.rules import NotFused
from kiln.plugins.base import DecoderSpec
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

__all__ = ["INT8_FORMAT", "ORT_WEIGHTS_FILE", "OrtTarget", "ort_graph_file", "ort_passes", "write_ort_target"]

ORT_WEIGHTS_FILE = "weights.ort.bin"
INT8_FORMAT = {"op": "MatMulNBits", "bits": 8, "block_size": BLOCK_SIZE, "accuracy_level": ACCURACY_LEVEL}


def ort_graph_file(kind: GraphKind) -> str:
    return f"{kind.value}.ort.onnx"


@dataclasses.dataclass(frozen=True)
class OrtTarget:
    graphs: dict[GraphKind, OrtGraphEntry]  # what each graph's passes rewrote, as the manifest records it
    paths: dict[GraphKind, Path]
    precision: str  # "fp32", "int8" or "int4" (weight-only MatMulNBits)
    weights: SharedWeights


@dataclasses.dataclass(frozen=True)
class _Rewrites:
    """The passes of one graph whose results the manifest reports."""

    attention: GraphRewrite[list[int]] | None
    mask: GraphRewrite[DecodeMask] | None
    norms: GraphRewrite[int]
    skip_norms: GraphRewrite[int]
    packed: GraphRewrite[list[str]]
    int8: GraphRewrite[list[str]] | None
    moe: GraphRewrite[MoeRewrite]
    int4: tuple[GraphRewrite[list[str]], GraphRewrite[list[str]]] | None = None  # unfold first, MatMulNBits last
    not_fused: NotFused = dataclasses.field(default_factory=NotFused)  # what the fusions left, and why

    def record(self, path: Path) -> OrtGraphEntry:
        def names(rewrite: GraphRewrite[list[str]] | None) -> tuple[str, ...]:
            return tuple(rewrite.result or ()) if rewrite is not None else ()

        moe = self.moe.result
        windows = self.mask.result.local_windows if self.mask is not None and self.mask.result is not None else ()
        has_moe = moe is not None and bool(moe.layers or moe.not_fused)
        return OrtGraphEntry(
            file=f"{ONNX_DIR}/{path.name}",
            fused_attention_layers=tuple(self.attention.result or ()) if self.attention is not None else (),
            compact_decode_mask=self.mask.result.compact if self.mask is not None and self.mask.result is not None else False,
            fused_rms_norms=self.norms.result or 0,
            fused_skip_norms=self.skip_norms.result or 0,
            packed_matmuls=names(self.packed),
            int8_nodes=names(self.int8),
            int4_nodes=names(self.int4[1]) if self.int4 is not None else None,
            moe_layers=moe.layers if moe is not None and has_moe else None,
            moe_not_fused=moe.not_fused if moe is not None and has_moe else None,
            local_window_layers=tuple(layer for layer, _ in windows) if windows else None,
            not_fused=self.not_fused.record(),
        )


def _rewrites(kind: GraphKind, spec: DecoderSpec, base_dir: Path, max_context: int, int8: bool, int4: bool) -> _Rewrites:
    attention = mask = None
    log = NotFused()
    if kind is not GraphKind.UNIFIED:  # GQA's CPU kernel refuses batch > 1 with past and seq > 1

        def fuse(model: ir.Model) -> list[int]:
            tables = graph_tables(model, base_dir, max_context, spec.head_dim)
            return fuse_attention(model, n_kv_heads=spec.n_kv_heads, head_dim=spec.head_dim, tables=tables, decode=kind is GraphKind.DECODE, not_fused=log)

        attention = GraphRewrite(functools.update_wrapper(fuse, fuse_attention))
        if kind is GraphKind.DECODE:

            def compact(model: ir.Model) -> DecodeMask:
                found = compact_decode_bias(model, base_dir, max_context) if attention.result else DecodeMask(False)
                log.add("decode_mask", found.not_fused)
                return found

            mask = GraphRewrite(functools.update_wrapper(compact, compact_decode_bias))
    return _Rewrites(
        attention,
        mask,
        GraphRewrite(_logging(fuse_rms_norm, log)),
        GraphRewrite(_logging(fuse_skip_rms_norm, log)),
        GraphRewrite(_logging(pack_shared_input_matmuls, log)),
        GraphRewrite(quantize_matmul_nbits) if int8 else None,
        GraphRewrite(functools.update_wrapper(functools.partial(fuse_moe, prompts=kind is not GraphKind.DECODE), fuse_moe)),
        (GraphRewrite(unfold_int4_weights), GraphRewrite(int4_matmul_nbits)) if int4 else None,
        log,
    )


R = TypeVar("R")


def _logging(fusion: Callable[..., R], log: NotFused) -> Callable[[ir.Model], R]:
    """``fusion(model, not_fused=log)``, named as ``fusion`` (the pass's name)."""
    return functools.update_wrapper(functools.partial(fusion, not_fused=log), fusion)


def ort_passes(rewrites: _Rewrites, writer: WeightsWriter) -> list[ir.passes.PassBase]:
    """The ORT target's passes of one graph, in order."""
    unused = RemoveUnusedNodesPass
    return [
        *((rewrites.int4[0],) if rewrites.int4 is not None else ()),
        *(p for p in (rewrites.attention, rewrites.mask) if p is not None),
        rewrites.moe,
        rewrites.norms,
        rewrites.skip_norms,
        unused(),  # before packing and quantizing: the replaced q/k/v MatMuls are dead now
        rewrites.packed,
        unused(),  # the MatMuls packed away are dead now
        *((rewrites.int8, unused()) if rewrites.int8 is not None else ()),
        *((rewrites.int4[1], unused()) if rewrites.int4 is not None else ()),
        TopologicalSortPass(),
        ExternalizeWeights(writer),
    ]


def write_ort_target(onnx_dir: Path, graphs: dict[GraphKind, Path], spec: DecoderSpec, *, max_context: int, int8: bool, int4: bool = False) -> OrtTarget:
    """Write ``<kind>.ort.onnx`` beside each portable graph in ``onnx_dir``."""
    out: dict[GraphKind, OrtGraphEntry] = {}
    paths: dict[GraphKind, Path] = {}
    with WeightsWriter(onnx_dir / ORT_WEIGHTS_FILE, rename=False) as writer:
        for kind, path in graphs.items():
            rewrites = _rewrites(kind, spec, onnx_dir, max_context, int8, int4)
            model = run_passes(ir.load(path), ort_passes(rewrites, writer), graph=f"{kind.value} (ORT target)")
            target = onnx_dir / ort_graph_file(kind)
            ir.save(model, target)
            del model
            out[kind], paths[kind] = rewrites.record(target), target
        weights = writer.close()
    return OrtTarget(graphs=out, paths=paths, precision="int8" if int8 else "int4" if int4 else "fp32", weights=weights)
