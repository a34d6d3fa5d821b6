"""Pass: convert a traced fp32 graph to fp16 with fp32 islands.

Weights, activations and the KV cache (past inputs, present outputs) become fp16; the nodes the
policy keeps (``policy``) and the op types ONNX Runtime's converter keeps
(``DEFAULT_OP_BLOCK_LIST``: Range, CumSum, Min, Max, TopK...) run in fp32 with Casts at their
borders; ``logits`` stays an fp32 output. The rules are those of ONNX Runtime's converter
(``onnxruntime.transformers.float16``), written here on onnx-ir because that converter works on a
whole ``ModelProto``: it would read every weight into memory, in fp32, at once. Here a weight's
conversion is one more step of its lazy recipe (``passes.bind``), run when it is written. Like
ONNX Runtime's, the conversion clamps to fp16's range (the attention mask's fp32 minimum becomes
-65504, not -inf, so fully masked padding rows stay finite) and keeps a weight fp32 when only
fp32 nodes read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx_ir as ir
import torch

from kiln.errors import ExportError
from kiln.exporter.passes.bind import ModuleWeight, Transform
from kiln.exporter.passes.ir_utils import set_dtype
from kiln.exporter.passes.reports import Report
from kiln.exporter.precision.policy import Fp16Policy, resolve_kept_nodes

__all__ = ["ConvertFp16", "Fp16Result", "convert_to_fp16", "FP16", "FP16_MAX"]

FP16_MAX = 65504.0
FP16_TINY = 5.96e-08  # fp16's smallest subnormal


@dataclasses.dataclass(frozen=True)
class Fp16Result:
    kept_fp32: tuple[str, ...]  # node names that run in fp32
    fp32_tables: tuple[str, ...]  # folded PLE tables kept fp32 because their range exceeds fp16


def _wide_tables(graph: ir.Graph) -> list[str]:
    """Gather nodes reading a float table whose values do not fit fp16 (e.g. a PLE table)."""
    names = []
    for node in graph:
        if node.op_type == "Gather" and node.inputs and node.inputs[0] is not None:
            table = node.inputs[0].const_value
            if table is not None and table.dtype == ir.DataType.FLOAT and _abs_max(table) > FP16_MAX:
                names.append(node.name or "")
    return names


def _drop_cast_round_trips(graph: ir.Graph) -> int:
    """Remove ``Cast(to fp16) -> Cast(to fp32)`` pairs, in place.

    The converter wraps every kept node in Casts (fp16 in, fp32 compute, fp16 out), so between
    two kept nodes a value goes fp32 -> fp16 -> fp32: an fp32 island would still round (and
    overflow) through fp16 at each of its edges. ONNX Runtime removes such pairs when it
    optimises; a strongly typed TensorRT build honours them. Wiring the second Cast's
    consumers to the first Cast's fp32 input keeps the island in fp32 as the policy means."""
    removed = 0
    for node in list(graph):
        if node.op_type != "Cast" or node.attributes.get_int("to") != ir.DataType.FLOAT16:
            continue
        source = node.inputs[0]
        if source is None or source.dtype != ir.DataType.FLOAT:
            continue
        for user, _ in list(node.outputs[0].uses()):
            if (
                user.op_type == "Cast"
                and user.attributes.get_int("to") == ir.DataType.FLOAT
                and not user.outputs[0].is_graph_output()
            ):
                user.outputs[0].replace_all_uses_with(source)
                graph.remove(user, safe=True)
                removed += 1
        if not node.outputs[0].uses() and not node.outputs[0].is_graph_output():
            graph.remove(node, safe=True)
    return removed


def _to_fp16(values: torch.Tensor) -> torch.Tensor:
    """float -> float16 without changing sign or finiteness (ONNX Runtime's rule): magnitudes
    below fp16's smallest subnormal become it, finite magnitudes above its max become the max.
    The plain cast into a new contiguous tensor; then, a slice at a time (no full-size mask), the
    positions the cast made ±0 or ±inf are found from the bits, and of those only the ones whose
    source is finite and non-zero are fixed (an underflow is common: a few in a million normal
    weights; a reduction pass to detect one costs as much as finding it)."""
    if values.dim() == 0:
        return _to_fp16(values.reshape(1)).reshape(())
    half = torch.empty(values.shape, dtype=torch.float16).copy_(values)
    bits = half.view(torch.int16).numpy().reshape(-1)
    found = [start + _zero_or_inf(bits[start : start + _SLICE]) for start in range(0, bits.size, _SLICE)]
    where = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    if where.size:
        index = tuple(torch.from_numpy(i) for i in np.unravel_index(where, tuple(half.shape)))
        source = values[index].float()
        fix = (source != 0) & torch.isfinite(source)
        magnitude = torch.where(half[index] == 0, FP16_TINY, FP16_MAX)
        half[tuple(i[fix] for i in index)] = (torch.sign(source[fix]) * magnitude[fix]).to(torch.float16)
    return half


_SLICE = 1 << 22  # elements whose mask exists at once


def _zero_or_inf(bits: np.ndarray) -> np.ndarray:
    """Positions of ±0 and ±inf among fp16 bit patterns."""
    magnitude = bits & 0x7FFF
    return np.flatnonzero((magnitude == 0) | (magnitude == 0x7C00))


FP16 = Transform("fp16", _to_fp16, dtype=ir.DataType.FLOAT16, slices="values")  # each value alone


def _fp16_tensor(tensor: ir.TensorProtocol) -> ir.TensorProtocol:
    if isinstance(tensor, ModuleWeight):
        return tensor.then(FP16)
    return ir.tensor(_to_fp16(torch.from_numpy(np.array(tensor.numpy(), dtype=np.float32))).numpy(), name=tensor.name)


def _abs_max(tensor: ir.TensorProtocol) -> float:
    if isinstance(tensor, ModuleWeight):
        return tensor.abs_max()
    return float(np.abs(tensor.numpy()).max(initial=0.0))


def _convert_attributes(node: ir.Node) -> None:
    """An fp16 node's attributes: Cast to fp16, float constant tensors in fp16."""
    if node.op_type == "Cast" and node.attributes.get_int("to") == ir.DataType.FLOAT:
        node.attributes["to"] = ir.AttrInt64("to", ir.DataType.FLOAT16)
    for name, attr in list(node.attributes.items()):
        if attr.type is ir.AttributeType.TENSOR and attr.value.dtype == ir.DataType.FLOAT:
            node.attributes[name] = ir.AttrTensor(name, _fp16_tensor(attr.value))
        elif attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            raise ExportError(f"--fp16: {node.name} holds a subgraph, which the fp16 conversion does not handle")
    if node.op_type == "ConstantOfShape" and "value" not in node.attributes:
        node.attributes["value"] = ir.AttrTensor("value", ir.tensor(np.zeros(1, dtype=np.float16)))


class _Casts:
    """One Cast per (value, dtype), inserted before the first node that needs it."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self._made: dict[tuple[int, ir.DataType], ir.Value] = {}

    def of(self, value: ir.Value, dtype: ir.DataType, before: ir.Node) -> ir.Value:
        key = (id(value), dtype)
        if key not in self._made:
            suffix = "fp32" if dtype == ir.DataType.FLOAT else "fp16"
            cast = ir.node("Cast", [value], {"to": dtype}, name=f"{value.name}_cast_to_{suffix}")
            cast.outputs[0].name = f"{value.name}_cast_to_{suffix}"
            set_dtype(cast.outputs[0], dtype)
            cast.outputs[0].shape = value.shape
            self.graph.insert_before(before, cast)
            self._made[key] = cast.outputs[0]
        return self._made[key]


def _convert_initializers(graph: ir.Graph, blocked: Callable[[ir.Node], bool]) -> None:
    for value in graph.initializers.values():
        tensor = value.const_value
        if (
            tensor is not None
            and value.dtype == ir.DataType.FLOAT
            and any(not blocked(use.node) for use in value.uses())
        ):
            value.const_value = _fp16_tensor(tensor)
            set_dtype(value, ir.DataType.FLOAT16)


def _keep_blocked_fp32(graph: ir.Graph, node: ir.Node, casts: _Casts) -> None:
    """A blocked node reads fp32 (its fp16 inputs cast up) and what reads it in fp16 gets a Cast down."""
    for index, value in enumerate(node.inputs):
        if value is not None and value.dtype == ir.DataType.FLOAT16:
            node.replace_input_with(index, casts.of(value, ir.DataType.FLOAT, node))
    for out in node.outputs:
        if out.dtype != ir.DataType.FLOAT:
            continue
        down: ir.Value | None = None
        for use in list(out.uses()):
            if use.node.op_type == "Cast" and use.node.name == f"{out.name}_cast_to_fp16":
                continue
            down = down or casts.of(out, ir.DataType.FLOAT16, use.node)
            use.node.replace_input_with(use.idx, down)
        if out.is_graph_output() and out.name != "logits":  # a present of the contract is fp16
            _fp16_output(graph, out)


def _fp16_output(graph: ir.Graph, value: ir.Value) -> None:
    """A graph output an fp32 node makes becomes fp16 under its name."""
    name = value.name
    cast = ir.node("Cast", [value], {"to": ir.DataType.FLOAT16}, name=f"graph_output_cast_{name}")
    value.name = f"{name}_fp32"
    cast.outputs[0].name, cast.outputs[0].shape = name, value.shape
    set_dtype(cast.outputs[0], ir.DataType.FLOAT16)
    graph.append(cast)
    outputs = list(graph.outputs)
    graph.outputs[outputs.index(value)] = cast.outputs[0]


def _fp32_logits(graph: ir.Graph) -> None:
    """``logits`` stays an fp32 output: the last fp16 value is cast up under the output's name."""
    for index, value in enumerate(graph.outputs):
        if value.name == "logits" and value.dtype == ir.DataType.FLOAT16:
            cast = ir.node("Cast", [value], {"to": ir.DataType.FLOAT}, name="graph_output_cast_logits")
            value.name = "logits_fp16"
            cast.outputs[0].name, cast.outputs[0].shape = "logits", value.shape
            set_dtype(cast.outputs[0], ir.DataType.FLOAT)
            graph.append(cast)
            graph.outputs[index] = cast.outputs[0]


def convert_to_fp16(model: ir.Model, policy: Fp16Policy) -> tuple[ir.Model, Fp16Result]:
    """``model`` converted in place (and returned), and what stayed fp32."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST

    graph = model.graph
    kept = resolve_kept_nodes(graph, policy)
    tables = _wide_tables(graph)
    names, ops = set(kept) | set(tables), set(DEFAULT_OP_BLOCK_LIST)

    def blocked(node: ir.Node) -> bool:
        return node.op_type in ops or (node.name or "") in names

    _convert_initializers(graph, blocked)
    for value in graph.inputs:
        if value.dtype == ir.DataType.FLOAT:
            set_dtype(value, ir.DataType.FLOAT16)
    casts = _Casts(graph)
    for node in list(graph):
        if blocked(node):
            _keep_blocked_fp32(graph, node, casts)
            continue
        _convert_attributes(node)
        for out in node.outputs:
            if out.dtype == ir.DataType.FLOAT:
                set_dtype(out, ir.DataType.FLOAT16)
    _fp32_logits(graph)
    _drop_cast_round_trips(graph)
    graph.sort()
    return model, Fp16Result(tuple(kept), tuple(tables))


class ConvertFp16(ir.passes.InPlacePass):
    """``convert_to_fp16`` as a pass; ``result`` says which nodes and tables stayed fp32."""

    def __init__(self, policy: Fp16Policy) -> None:
        super().__init__()
        self.policy = policy
        self.result: Fp16Result | None = None

    report_name = "fp16"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        converted, self.result = convert_to_fp16(model, self.policy)
        return ir.passes.PassResult(converted, modified=True)

    @property
    def report(self) -> Report | None:
        """The manifest's ``passes.fp16``: the nodes kept in fp32 and the PLE tables kept fp32."""
        if self.result is None:
            return None
        return {"fp32_nodes": list(self.result.kept_fp32), "fp32_ple_tables": list(self.result.fp32_tables)}
