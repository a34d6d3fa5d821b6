"""``--target ort``: ONNX Runtime-target copies of the portable graphs, beside them.

Each portable graph ``onnx/<kind>.onnx`` is reloaded (its weights stay in ``weights.bin``,
memory-mapped, never read unless a pass needs them) and rewritten for ONNX Runtime's fused CPU
contrib kernels into ``onnx/<kind>.ort.onnx``:

- attention -> ``RotaryEmbedding`` + ``GroupQueryAttention`` (prefill and decode; see
  ``ort_attention`` for why model.onnx keeps its portable attention),
- q/k/v projections -> one MatMul on the concatenated weight and a Split, and so any other
  MatMuls that read one input (a SwiGLU MLP's gate and up projections: ``ort_pack``),
- RMSNorm -> ``SimplifiedLayerNormalization``, with the residual Add before it
  ``SkipSimplifiedLayerNormalization``,
- decode: the family's mask subgraph -> a four-op padding bias when probes prove them equal
  (``decode_mask``),
- with ``int8``: every constant-weight MatMul -> ``MatMulNBits`` (8 bits, weight-only).

The copies sit in the same directory as the portable graphs because ONNX Runtime refuses
external data outside a model's directory; they share ``weights.bin`` for every weight they
keep, and what the rewrite adds (cos/sin caches, int8 weights) goes to one more file,
``weights.ort.bin``, shared by the three ORT graphs (same names, same offsets). The I/O contract
is unchanged, so parity checks these graphs exactly as it checks the portable ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from kiln.errors import ExportError
from kiln.exporter.io_contract import GraphKind
from kiln.exporter.targets.decode_mask import compact_decode_bias
from kiln.exporter.targets.ort_attention import fuse_attention
from kiln.exporter.targets.ort_int8 import ACCURACY_LEVEL, BLOCK_SIZE, quantize_matmul_nbits
from kiln.exporter.targets.ort_norm import fuse_rms_norm, fuse_skip_rms_norm
from kiln.exporter.targets.ort_pack import pack_shared_input_matmuls
from kiln.exporter.targets.rotary_tables import graph_tables
from kiln.plugins.base import DecoderSpec

__all__ = ["OrtTarget", "write_ort_target", "ort_graph_file", "shares_kv_buffer", "ORT_WEIGHTS_FILE"]

ORT_WEIGHTS_FILE = "weights.ort.bin"
_ALIGN = 64
_INLINE_LIMIT = 1024


def ort_graph_file(kind: GraphKind) -> str:
    return f"{kind.value}.ort.onnx"


@dataclasses.dataclass(frozen=True)
class OrtTarget:
    graphs: dict[GraphKind, Path]
    precision: str  # "fp32" or "int8" (weight-only MatMulNBits)
    weights: Path
    weights_bytes: int
    report: dict[str, dict[str, Any]]  # per graph: what each pass rewrote

    def manifest_entry(self, root: Path) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "int8": {"op": "MatMulNBits", "bits": 8, "block_size": BLOCK_SIZE, "accuracy_level": ACCURACY_LEVEL} if self.precision == "int8" else None,
            "graphs": {kind.value: {"file": path.relative_to(root).as_posix(), **self.report[kind.value]} for kind, path in self.graphs.items()},
            "weights": {"file": self.weights.relative_to(root).as_posix(), "bytes": self.weights_bytes},
        }


class _TargetWeights:
    """Moves the tensors a rewrite created (in memory, not yet external) into one file; the
    same name in another graph must have the same content and reuses its offset, and so does
    the same content under another name (model.onnx's generically packed q/k/v and the attention
    pass's packed q/k/v of prefill and decode are the same bytes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "wb")  # noqa: SIM115 (closed in close())
        self._offsets: dict[str, tuple[int, int, bytes]] = {}
        self._by_content: dict[bytes, tuple[int, int, bytes]] = {}

    def externalize(self, model: ir.Model) -> None:
        for value in list(model.graph.initializers.values()):
            tensor = value.const_value
            if tensor is None or isinstance(tensor, ir.ExternalTensor) or tensor.nbytes < _INLINE_LIMIT:
                continue
            data = tensor.tobytes()
            digest = hashlib.sha256(data).digest()
            name = value.name or ""
            if name not in self._offsets and digest in self._by_content:  # the same bytes under another name
                self._offsets[name] = self._by_content[digest]
            if name not in self._offsets:
                offset = self._file.tell()
                pad = -offset % _ALIGN
                self._file.write(b"\0" * pad)
                self._file.write(data)
                self._offsets[name] = (offset + pad, len(data), digest)
                self._by_content[digest] = self._offsets[name]
            offset, length, known = self._offsets[name]
            if known != digest:
                raise ExportError(f"ORT target: tensor {name} differs between graphs; cannot share {self.path.name}")
            value.const_value = ir.ExternalTensor(
                self.path.name, offset, length, tensor.dtype, shape=ir.Shape(tensor.shape.numpy()), name=name, base_dir=self.path.parent
            )

    def close(self) -> int:
        size = self._file.tell()
        self._file.close()
        return size


def rewrite_for_ort(model: ir.Model, kind: GraphKind, spec: DecoderSpec, tables_dir: Path, max_context: int, int8: bool) -> dict[str, Any]:
    """Apply the ORT-target passes to ``model`` in place; returns what they rewrote."""
    fused: list[int] = []
    compact_mask = False
    if kind is not GraphKind.UNIFIED:  # GQA's CPU kernel refuses batch > 1 with past and seq > 1
        tables = graph_tables(model, tables_dir, max_context, spec.head_dim)
        fused = fuse_attention(model, n_kv_heads=spec.n_kv_heads, head_dim=spec.head_dim, tables=tables, decode=kind is GraphKind.DECODE)
        if fused and kind is GraphKind.DECODE:
            compact_mask = compact_decode_bias(model, tables_dir, max_context)
    norms = fuse_rms_norm(model)
    skip_norms = fuse_skip_rms_norm(model)
    RemoveUnusedNodesPass()(model)  # before packing and quantizing: the replaced q/k/v MatMuls are dead now
    packed = pack_shared_input_matmuls(model)
    RemoveUnusedNodesPass()(model)  # the MatMuls packed away are dead now
    int8_nodes = quantize_matmul_nbits(model) if int8 else []
    RemoveUnusedNodesPass()(model)
    model.graph.sort()
    return {
        "fused_attention_layers": fused,
        "compact_decode_mask": compact_mask,
        "fused_rms_norms": norms,
        "fused_skip_norms": skip_norms,
        "packed_matmuls": packed,
        "int8_nodes": int8_nodes,
    }


def write_ort_target(
    onnx_dir: Path, graphs: dict[GraphKind, Path], spec: DecoderSpec, *, max_context: int, int8: bool
) -> OrtTarget:
    """Write ``<kind>.ort.onnx`` beside each portable graph in ``onnx_dir``."""
    weights = _TargetWeights(onnx_dir / ORT_WEIGHTS_FILE)
    out: dict[GraphKind, Path] = {}
    report: dict[str, dict[str, Any]] = {}
    try:
        for kind, path in graphs.items():
            model = ir.load(path)
            report[kind.value] = rewrite_for_ort(model, kind, spec, onnx_dir, max_context, int8)
            weights.externalize(model)
            out[kind] = onnx_dir / ort_graph_file(kind)
            ir.save(model, out[kind])
            del model
    finally:
        size = weights.close()
    return OrtTarget(graphs=out, precision="int8" if int8 else "fp32", weights=weights.path, weights_bytes=size, report=report)


def shares_kv_buffer(manifest: dict[str, Any]) -> bool:
    """True when the export's ``--target ort`` decode graph has every layer's attention fused
    into GroupQueryAttention (a layer left portable grows its cache with Concat)."""
    ort = (manifest.get("targets") or {}).get("ort")
    if ort is None:
        return False
    fused = ort["graphs"]["decode"].get("fused_attention_layers", [])
    return sorted(fused) == list(range(int(manifest["model"]["n_layers"])))
