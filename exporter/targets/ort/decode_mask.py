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

Hand-written, not a rewrite rule: what is matched is a value (the bias), proven by running its
subgraph, not a pattern of nodes. Its checks name why a bias is not proven (``DecodeMask.not_fused``).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from kiln.exporter.passes.ir_utils import MS_DOMAIN, constant, set_dtype
from kiln.exporter.passes.subgraph import cut_subgraph, proto_for_cuts
from kiln.exporter.runners.ort_runner import ort_session

__all__ = ["DecodeMask", "compact_decode_bias"]

_BIAS_INPUT = 10  # GroupQueryAttention's attention_bias
_LAYER = re.compile(r"/layers\.(\d+)\.")


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
        elif (
            value.name.startswith("past_key_values.")
            and len(dims) == 4
            and isinstance(dims[1], int)
            and isinstance(dims[3], int)
        ):
            length = dims[2] if isinstance(dims[2], int) else total - 1  # a recurrent state's is fixed
            feeds[value.name] = np.zeros((batch, dims[1], length, dims[3]), dtype=np.float32)
        else:
            return None
    return feeds


@dataclasses.dataclass(frozen=True)
class DecodeMask:
    """What ``compact_decode_bias`` did to one decode graph."""

    compact: bool  # the family's bias replaced by the padding-only Where
    local_windows: tuple[tuple[int, int], ...] = ()  # (layer, window): GQA's local_window_size set on that layer
    not_fused: tuple[str, ...] = ()  # not compact: "layer i: why" for each bias not proven


def _window(got: np.ndarray, mask: np.ndarray, fill: float) -> int | None | bool:
    """The bias of one probe ([B, T]) -> None when it is the padding-only bias, the window W when
    it is padding and the last W keys only, False when it is neither (or W cannot be told)."""
    total = mask.shape[1]
    if np.array_equal(got, np.where(mask == 1, np.float32(0.0), np.float32(fill))):
        return None
    seen = int((got[1] == 0.0).sum())  # row 1 of every probe is unpadded
    if not 0 < seen < total:
        return False
    window = np.where((mask == 1) & (np.arange(total)[None] >= total - seen), np.float32(0.0), np.float32(fill))
    return seen if np.array_equal(got, window) else False


def _classify(session: Any, inputs: list[onnx.ValueInfoProto], max_context: int) -> tuple[float, int | None] | str:
    """Run one bias subgraph on the probes -> (its fill, None for padding-only or the window W
    that every probe agrees on), or why not."""
    fill: float | None = None
    results: list[tuple[np.ndarray, np.ndarray]] = []
    for mask in _probes(max_context):
        feeds = _feeds(inputs, mask)
        if feeds is None:
            return "its bias reads an input the probes do not feed"
        (got,) = session.run(None, feeds)
        if got.shape != (mask.shape[0], 1, 1, mask.shape[1]) or got.dtype != np.float32:
            return f"its bias is not a float32 [B, 1, 1, T] (found {got.dtype} {list(got.shape)})"
        masked = got[:, 0, 0, :][got[:, 0, 0, :] != 0.0]
        if fill is None and masked.size:
            fill = float(masked[0])
        results.append((got[:, 0, 0, :], mask))
    if fill is None or fill == 0.0:
        return "its bias masks no key on the probes"
    kinds = [(_window(got, mask, fill), mask.shape[1]) for got, mask in results]
    if any(kind is False for kind, _ in kinds):
        total = next(t for kind, t in kinds if kind is False)
        return f"on the probe of {total} keys its bias is neither the padding mask nor padding and one sliding window"
    windows = {kind for kind, _ in kinds if kind is not None}
    if len(windows) > 1:
        return f"its bias shows sliding windows of different sizes on the probes ({sorted(windows)})"
    window = int(windows.pop()) if windows else None
    if window is not None and any(kind != window for kind, total in kinds if total > window):
        return f"a probe longer than its window of {window} saw more keys"
    return fill, window


def _layers(nodes: list[ir.Node]) -> str:
    found = sorted({int(m.group(1)) for n in nodes if (m := _LAYER.search(n.name or ""))})
    return f"layer {', '.join(map(str, found))}" if found else ", ".join(n.name or n.op_type for n in nodes)


def _proven(
    model: ir.Model, gqa: list[ir.Node], base_dir: Path, max_context: int
) -> dict[int, tuple[float, int | None]] | str:
    """Each GQA bias (by value id) -> (fill, window) proven on the probes, or "layer i: why not"."""
    biases: dict[int, ir.Value] = {}
    for node in gqa:
        value = node.inputs[_BIAS_INPUT]
        if value is None or value.name is None or value.is_graph_input():
            return (
                f"{_layers([node])}: its bias is "
                f"{'a graph input' if value is not None and value.is_graph_input() else 'missing'}"
            )
        if node.attributes.get_int("causal", 1) != 1:
            return f"{_layers([node])}: its GroupQueryAttention is not causal=1 (a prompt graph)"
        biases[id(value)] = value
    proto = proto_for_cuts(model)
    found: dict[int, tuple[float, int | None]] = {}
    for key, bias in biases.items():
        assert bias.name is not None
        readers = [n for n in gqa if n.inputs[_BIAS_INPUT] is bias]
        sub = cut_subgraph(
            proto, [bias.name], base_dir, name="decode_mask", max_external_bytes=1 << 20
        )  # a mask reads no weights
        got = (
            _classify(ort_session(sub.SerializeToString()), list(sub.graph.input), max_context)
            if sub is not None
            else "its bias subgraph reads more than the graph's inputs and small constants"
        )
        if isinstance(got, str):
            return f"{_layers(readers)}: {got}"
        found[key] = got
    if len({fill for fill, _ in found.values()}) != 1:
        return f"{_layers(gqa)}: the biases fill masked keys with different values"
    return found


def compact_decode_bias(model: ir.Model, base_dir: Path, max_context: int) -> DecodeMask:
    """Replace the GQA nodes' biases in a decode graph by the padding-only mask when the probes
    prove each one is the padding-only mask, or (sliding-window layers) the padding mask and the
    last W keys only, which then becomes that node's ``local_window_size = W`` (ONNX Runtime 1.32's
    CPU kernel lets a query see its last W keys, itself included, measured: transformers'
    ``sliding_window`` W); returns what it did (nothing unless every bias is proven)."""
    graph = model.graph
    gqa = [
        n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN and len(n.inputs) > _BIAS_INPUT
    ]
    if not gqa:
        return DecodeMask(False)
    found = _proven(model, gqa, base_dir, max_context)
    if isinstance(found, str):
        return DecodeMask(False, not_fused=(found,))
    fill = next(iter(found.values()))[0]
    attention_mask = next(v for v in graph.inputs if v.name == "attention_mask")
    cond = ir.node("Cast", [attention_mask], {"to": ir.DataType.BOOL}, name="/ort/decode_mask/Cast")
    where = ir.node(
        "Where",
        [
            cond.outputs[0],
            constant(graph, "ort/zero_f32", np.array(0.0, dtype=np.float32)),
            constant(graph, "ort/decode_mask_fill", np.array(fill, dtype=np.float32)),
        ],
        name="/ort/decode_mask/Where",
    )
    axes = constant(graph, "ort/decode_mask_axes", np.array([1, 2], dtype=np.int64))
    unsqueeze = ir.node("Unsqueeze", [where.outputs[0], axes], name="/ort/decode_mask/Unsqueeze")  # [B, 1, 1, T]
    set_dtype(unsqueeze.outputs[0], ir.DataType.FLOAT)
    graph.extend([cond, where, unsqueeze])
    windows: list[tuple[int, int]] = []
    for node in gqa:
        window = found[id(node.inputs[_BIAS_INPUT])][1]
        node.replace_input_with(_BIAS_INPUT, unsqueeze.outputs[0])
        if window is not None:
            node.attributes["local_window_size"] = ir.AttrInt64("local_window_size", window)
            layer = _LAYER.search(node.name or "")
            windows.append((int(layer.group(1)) if layer else -1, window))
    return DecodeMask(True, tuple(sorted(windows)))
