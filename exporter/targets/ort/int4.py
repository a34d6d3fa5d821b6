"""Passes: the portable graphs' int4 weights as ONNX Runtime's ``MatMulNBits`` (bits=4), the same numbers.

The ``--int4`` portable graphs hold ``MatMul(x, DequantizeLinear(W_int4, scale, axis=0,
block_size=B))`` (``int4.quantize``). The ORT target does not quantize again: it reads those
``(q, scale)`` back from ``weights.bin`` and writes them in MatMulNBits' layout, so both forms
compute with identical weights.

- ``unfold_int4_weights`` (first): each int4 DQ feeding a MatMul becomes a ``BlockInt4``
  constant, a lazy float weight that keeps its ``(q, scale)``, so the other rewrites (q/k/v and
  gate/up packing, attention fusion) see a constant weight as in an fp32 graph; packing puts
  ``BlockInt4`` weights side by side and stays int4 (``pack``: blocks run along K, so the
  columns keep their blocks).
- ``int4_matmul_nbits`` (last): every MatMul on a ``BlockInt4`` -> ``MatMulNBits`` bits=4
  (``q + 8`` as uint4 with the default zero point 8, scales ``[N * K/B]``), ``accuracy_level``
  ``ACCURACY_LEVEL``.

No ``BlockInt4`` is ever written: one that is still read at the end is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir

from kiln.errors import ExportError
from kiln.exporter.int4.numbers import dequantize, pack_nbits
from kiln.exporter.passes.ir_utils import read_uncached, use_ms_domain
from kiln.exporter.targets.ort.nbits import replace_with_nbits

__all__ = ["BlockInt4", "register", "unfold_int4_weights", "int4_matmul_nbits", "ACCURACY_LEVEL", "INT4_FORMAT"]

# Measured (issue 16; docs/benchmarks.md, the demo model's accuracy): on this x86 CPU
# levels 0-2 run one fp32 kernel (a [1, 896] x [896, 4864] step 0.30 ms, 2x faster than fp32
# MatMul) and level 4 quantizes the activations to int8 per block (0.083 ms, 7x), costing under
# 0.01 perplexity on the demo; 4, as --ort-int8 uses.
ACCURACY_LEVEL = 4


def INT4_FORMAT(block: int) -> dict[str, object]:  # noqa: N802 (a constant of the block)
    return {"op": "MatMulNBits", "bits": 4, "block_size": block, "accuracy_level": ACCURACY_LEVEL}


class BlockInt4(ir.LazyTensor):
    """A float ``[K, N]`` weight that is ``q * scale`` (blocks of ``block`` along K)."""

    def __init__(self, name: str, q: Callable[[], np.ndarray], scale: np.ndarray, shape: tuple[int, int]) -> None:
        super().__init__(
            lambda: ir.tensor(dequantize(self.q(), self.scale)), ir.DataType.FLOAT, ir.Shape(list(shape)), name=name
        )
        self.q, self.scale = q, np.asarray(scale, dtype=np.float32)
        self.block = shape[0] // self.scale.shape[0]

    @classmethod
    def side_by_side(cls, name: str, parts: Sequence[BlockInt4]) -> BlockInt4:
        if len({p.block for p in parts}) != 1:
            raise ExportError(f"{name}: int4 weights of different block sizes cannot be packed into one MatMul")

        def q() -> np.ndarray:
            return np.concatenate([p.q() for p in parts], axis=1)

        k = parts[0].shape.numpy()[0]
        return cls(
            name, q, np.concatenate([p.scale for p in parts], axis=1), (k, sum(p.shape.numpy()[1] for p in parts))
        )


def register(graph: ir.Graph, tensor: ir.TensorProtocol) -> ir.Value:
    value = ir.Value(
        name=tensor.name, type=ir.TensorType(tensor.dtype), shape=ir.Shape(tensor.shape.numpy()), const_value=tensor
    )
    graph.register_initializer(value)
    return value


def _int4_weight(dq: ir.Node) -> BlockInt4 | None:
    """A ``DequantizeLinear(INT4 [K, N], fp32 scale [K/B, N], axis=0)`` as a ``BlockInt4``."""
    if dq.op_type != "DequantizeLinear" or dq.domain != "" or len(dq.inputs) < 2:
        return None
    weight, scale = dq.inputs[0], dq.inputs[1]
    if (
        weight is None
        or scale is None
        or weight.dtype != ir.DataType.INT4
        or weight.const_value is None
        or scale.const_value is None
    ):
        return None
    if scale.dtype != ir.DataType.FLOAT:
        raise ExportError(
            f"{dq.name}: the ONNX Runtime target's int4 weights need fp32 scales (an fp32 graph), found {scale.dtype}"
        )
    tensor = weight.const_value
    k, n = tensor.shape.numpy()

    def q() -> np.ndarray:
        return read_uncached(tensor, np.dtype(np.int8))

    return BlockInt4(
        f"ort_int4/{(dq.outputs[0].name or dq.name or 'weight').removeprefix('weights/')}",
        q,
        scale.const_value.numpy(),
        (k, n),
    )


def unfold_int4_weights(model: ir.Model) -> list[str]:
    """Every int4 DQ that only MatMuls read -> a ``BlockInt4`` constant; the MatMuls it fed."""
    graph = model.graph
    unfolded: list[str] = []
    for node in list(graph):
        weight = _int4_weight(node)
        uses = list(node.outputs[0].uses()) if weight is not None else []
        if weight is None or not uses or any(u.node.op_type != "MatMul" or u.idx != 1 for u in uses):
            continue
        value = register(graph, weight)
        for use in uses:
            use.node.replace_input_with(1, value)
            unfolded.append(use.node.name or "")
        graph.remove(node, safe=True)
    return unfolded


def int4_matmul_nbits(model: ir.Model) -> list[str]:
    """Every MatMul on a ``BlockInt4`` -> ``MatMulNBits`` bits=4; the replaced nodes' names."""
    graph = model.graph
    replaced: list[str] = []
    for node in list(graph):
        weight = node.inputs[1] if node.op_type == "MatMul" and node.domain == "" and len(node.inputs) == 2 else None
        tensor = weight.const_value if weight is not None else None
        if not isinstance(tensor, BlockInt4) or node.inputs[0] is None:
            continue
        k, n = tensor.shape.numpy()
        base = (tensor.name or node.name or "matmul").removeprefix("ort_int4/")
        packed = pack_nbits(tensor.q(), tensor.block)
        scales = np.ascontiguousarray(tensor.scale.T).reshape(-1)  # [N * K/B], column by column
        replace_with_nbits(
            graph,
            node,
            node.inputs[0],
            f"ort_int4/{base}",
            packed,
            scales,
            k=k,
            n=n,
            bits=4,
            block=tensor.block,
            accuracy_level=ACCURACY_LEVEL,
        )
        replaced.append(node.name or "")
    if replaced:
        use_ms_domain(model)
    left = [v.name for v in graph.initializers.values() if isinstance(v.const_value, BlockInt4) and v.uses()]
    if left:
        raise ExportError(f"int4 weights {left[:3]} are still read as float after the MatMulNBits rewrite")
    return replaced
