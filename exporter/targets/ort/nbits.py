"""Pass: weight-only int8 for ONNX Runtime CPU: MatMul (or a plain Gemm) with a constant
weight -> MatMulNBits.

The portable ``--int8`` writes TensorRT-shaped Q/DQ graphs; ONNX Runtime's CPU runs those
slower than fp32 (it dequantizes and multiplies in float). ``com.microsoft.MatMulNBits`` with
``bits=8`` keeps the weights int8 in memory (a quarter of the bytes a decode step must read)
and, with ``accuracy_level=4``, quantizes the activations per block on the fly and multiplies
in int8 (MLAS's int8 kernels): a decode step is bound by weight bytes, so this is what makes it
fast. Weights are quantized symmetrically per block of ``block_size`` input channels (scale =
max|w| / 127, the implicit zero point 128 of ``bits=8``); no calibration data is needed.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.exporter.passes.ir_utils import (
    MS_DOMAIN,
    constant,
    copy_type,
    producer,
    use_ms_domain,
)
from kiln.exporter.targets.ort.lora import fixed_weight

__all__ = ["ACCURACY_LEVEL", "BLOCK_SIZE", "pack_int8_blocks", "quantize_matmul_nbits", "replace_with_nbits"]

BLOCK_SIZE = 128  # measured on the 33M Llama, decode past 256: 128 and 64 beat 32 (2.85 / 2.91 / 3.18 ms)
ACCURACY_LEVEL = 4  # int8 activations x int8 weights (MLAS); levels 0-2 dequantize and run 6-20x slower here


def pack_int8_blocks(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` [K, N] float -> (B [N, blocks, block_size] uint8, scales [N, blocks] float32)
    in MatMulNBits' layout: per output column, K split in blocks (the last one zero-padded)."""
    k, n = weight.shape
    blocks = -(-k // block_size)
    padded = np.zeros((blocks * block_size, n), dtype=np.float32)
    padded[:k] = weight
    w = padded.T.reshape(n, blocks, block_size)  # [N, blocks, block]
    scales = np.abs(w).max(axis=-1) / 127.0
    scales = np.where(scales == 0.0, 1.0, scales).astype(np.float32)
    q = np.clip(np.rint(w / scales[..., None]), -127, 127).astype(np.int16) + 128
    return q.astype(np.uint8), scales


def _plain_gemm(node: ir.Node) -> tuple[bool, ir.Value | None] | None:
    """A ``Gemm`` that is a MatMul plus a constant 1-D bias (GPT-2's Conv1D): (transB, bias)."""
    if node.op_type != "Gemm" or node.domain != "" or node.attributes.get_int("transA", 0) != 0:
        return None
    if node.attributes.get_float("alpha", 1.0) != 1.0 or node.attributes.get_float("beta", 1.0) != 1.0:
        return None
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    if bias is not None and (bias.const_value is None or len(bias.const_value.shape) != 1):
        return None
    return bool(node.attributes.get_int("transB", 0)), bias


def replace_with_nbits(
    graph: ir.Graph,
    node: ir.Node,
    a: ir.Value,
    prefix: str,
    packed: np.ndarray,
    scales: np.ndarray,
    *,
    k: int,
    n: int,
    bits: int,
    block: int,
    accuracy_level: int,
    bias: ir.Value | None = None,
) -> ir.Node:
    """``node`` -> ``MatMulNBits(a, packed, scales, bias)`` (tensors ``<prefix>.q``/``.scales``,
    named after the weight so that the three graphs share them); the output keeps its name and
    type (a graph output such as ``logits`` stays one). The MatMul is removed; the MatMulNBits returned
    (the caller declares the ``com.microsoft`` opset: ``use_ms_domain``)."""
    fused = ir.node(
        "MatMulNBits",
        [a, constant(graph, f"{prefix}.q", packed), constant(graph, f"{prefix}.scales", scales), None, None, bias],
        {"K": k, "N": n, "bits": bits, "block_size": block, "accuracy_level": accuracy_level},
        domain=MS_DOMAIN,
        name=f"{node.name}NBits",
    )
    out = fused.outputs[0]
    copy_type(out, node.outputs[0])
    graph.insert_before(node, fused)
    old = node.outputs[0]
    name = old.name
    old.replace_all_uses_with(out, replace_graph_outputs=True)
    if old.name == name and name is not None:
        old.name, out.name = f"{name}.float", name  # keep graph output names (logits)
    graph.remove(node, safe=True)
    return fused


def quantize_matmul_nbits(
    model: ir.Model, block_size: int = BLOCK_SIZE, accuracy_level: int = ACCURACY_LEVEL
) -> list[str]:
    """Replace every MatMul (and plain Gemm, its bias going to MatMulNBits' bias input) whose
    weight is a constant float32 matrix; returns the replaced nodes' names. The packed weights get names derived from
    the original ones, so the prefill, decode and unified graphs share them."""
    graph = model.graph
    replaced: list[str] = []
    for node in list(graph):
        gemm = _plain_gemm(node)
        is_matmul = node.op_type == "MatMul" and node.domain == "" and len(node.inputs) == 2
        if not is_matmul and gemm is None:
            continue
        a, b = node.inputs[0], node.inputs[1]
        transposed = producer(b, "Transpose")  # a tied LM head reads the embedding through a Transpose
        if (
            transposed is not None
            and list(transposed.attributes.get_ints("perm", [1, 0])) == [1, 0]
            and transposed.inputs[0] is not None
        ):
            b = transposed.inputs[0]
        tensor = fixed_weight(b)  # a LoRA slot's A and B stay float MatMuls, fed at run time
        if a is None or b is None or tensor is None or tensor.dtype != ir.DataType.FLOAT or len(tensor.shape) != 2:
            continue
        weight = tensor.numpy().T if (gemm is not None and gemm[0]) or transposed is not None else tensor.numpy()
        bias = gemm[1] if gemm is not None else None
        k, n = weight.shape
        packed, scales = pack_int8_blocks(weight, block_size)
        base = (b.name or node.name or "matmul").removeprefix("weights/")
        replace_with_nbits(
            graph,
            node,
            a,
            f"ort_int8/{base}",
            packed,
            scales.reshape(-1),
            k=k,
            n=n,
            bits=8,
            block=block_size,
            accuracy_level=accuracy_level,
            bias=bias,
        )
        replaced.append(node.name or "")
    if replaced:
        use_ms_domain(model)
    return replaced
