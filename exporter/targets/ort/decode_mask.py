"""Pass (decode graphs): the family's attention mask -> a four-op padding bias, when provably the same.

At decode (one new, real token per row) a causal decoder's mask usually says only "key j is not
padding": ``bias[b, 0, 0, j] = 0 if attention_mask[b, j] else fill``. Families build it in far
more ops (Hugging Face's mask utilities trace to ~28 small kernels: Range, GatherND, Expand, ...),
which at decode cost about as much as all eight GQA kernels of the 33M Llama. This pass cuts the
graph's own bias subgraph out, runs it on probe inputs (every total length up to 64, then a
spread up to ``max_context``; left-padded and unpadded rows), and only when every probe equals
the padding-only formula exactly does it feed GQA ``Where(attention_mask, 0, fill)`` instead. A
family whose mask says more (a sliding window shorter than the context, say) fails a probe and
keeps its own mask.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from kiln.exporter.passes.ir_utils import MS_DOMAIN, constant, set_dtype
from kiln.exporter.passes.subgraph import cut_subgraph
from kiln.exporter.runners.ort_runner import ort_session

__all__ = ["compact_decode_bias"]

_BIAS_INPUT = 10  # GroupQueryAttention's attention_bias


def _probes(max_context: int) -> list[np.ndarray]:
    totals = sorted({*range(1, min(64, max_context) + 1), *np.linspace(1, max_context, 9).astype(int).tolist()})
    masks = []
    for total in totals:
        mask = np.ones((2, total), dtype=np.int64)
        mask[0, : (total - 1) * 2 // 3] = 0  # left padding (the new token is always real)
        masks.append(mask)
    return masks


def _feeds(inputs: list[onnx.ValueInfoProto], mask: np.ndarray) -> dict[str, np.ndarray] | None:
    batch, total = mask.shape
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)[:, -1:]
    feeds: dict[str, np.ndarray] = {}
    for value in inputs:
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value.type.tensor_type.shape.dim]
        if value.name == "attention_mask":
            feeds[value.name] = mask
        elif value.name == "position_ids":
            feeds[value.name] = positions.astype(np.int64)
        elif value.name == "input_ids":
            feeds[value.name] = np.zeros((batch, 1), dtype=np.int64)
        elif value.name.startswith("past_key_values.") and len(dims) == 4 and isinstance(dims[1], int) and isinstance(dims[3], int):
            feeds[value.name] = np.zeros((batch, dims[1], total - 1, dims[3]), dtype=np.float32)
        else:
            return None
    return feeds


def compact_decode_bias(model: ir.Model, base_dir: Path, max_context: int) -> bool:
    """Replace the GQA nodes' shared bias in a decode graph when the probes prove it is the
    padding-only mask; returns whether it did."""
    graph = model.graph
    gqa = [n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN and len(n.inputs) > _BIAS_INPUT]
    biases: dict[int, ir.Value] = {}
    for node in gqa:
        value = node.inputs[_BIAS_INPUT]
        if value is not None:
            biases[id(value)] = value
    if len(biases) != 1:
        return False
    bias = next(iter(biases.values()))
    if bias.name is None or bias.is_graph_input():
        return False
    sub = cut_subgraph(ir.to_proto(model), [bias.name], base_dir, name="decode_mask", max_external_bytes=1 << 20)  # a mask reads no weights
    if sub is None:
        return False
    session = ort_session(sub.SerializeToString())
    fill: float | None = None
    for mask in _probes(max_context):
        feeds = _feeds(list(sub.graph.input), mask)
        if feeds is None:
            return False
        (got,) = session.run(None, feeds)
        if got.shape != (mask.shape[0], 1, 1, mask.shape[1]) or got.dtype != np.float32:
            return False
        masked = got[:, 0, 0, :][mask == 0]
        if fill is None and masked.size:
            fill = float(masked[0])
        if fill is None or fill == 0.0:
            continue
        if not np.array_equal(got[:, 0, 0, :], np.where(mask == 1, np.float32(0.0), np.float32(fill))):
            return False
    if fill is None or fill == 0.0:
        return False
    attention_mask = next(v for v in graph.inputs if v.name == "attention_mask")
    cond = ir.node("Cast", [attention_mask], {"to": ir.DataType.BOOL}, name="/ort/decode_mask/Cast")
    where = ir.node(
        "Where",
        [cond.outputs[0], constant(graph, "ort/zero_f32", np.array(0.0, dtype=np.float32)), constant(graph, "ort/decode_mask_fill", np.array(fill, dtype=np.float32))],
        name="/ort/decode_mask/Where",
    )
    axes = constant(graph, "ort/decode_mask_axes", np.array([1, 2], dtype=np.int64))
    unsqueeze = ir.node("Unsqueeze", [where.outputs[0], axes], name="/ort/decode_mask/Unsqueeze")  # [B, 1, 1, T]
    set_dtype(unsqueeze.outputs[0], ir.DataType.FLOAT)
    graph.extend([cond, where, unsqueeze])
    for node in gqa:
        node.replace_input_with(_BIAS_INPUT, unsqueeze.outputs[0])
    return True
