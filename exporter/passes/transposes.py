"""Pass: ``Transpose(weight)`` -> the transposed weight, as a lazy initializer.

The exporter writes ``nn.Linear`` as ``MatMul(x, Transpose(W))``. TensorRT's explicit
quantization, ONNX Runtime's fused kernels and the precision rules all want the MatMul's weight
as a ``[K, N]`` constant, so the transpose is folded here, lazily: the ``[K, N]`` tensor is
computed from the module's own ``[N, K]`` one only when it is written (``passes.bind``).

A tied embedding (the input embedding's ``Gather`` and the LM head's ``MatMul`` read one
``[V, d]`` tensor) is stored once too, as the head's ``[d, V]``: the embedding then gathers its
columns, ``Transpose(Gather(W^T, ids, axis=1))``, which moves only the rows it looks up (a
second copy of the embedding of a 0.5B Qwen2 would be 544 MB in fp32). The graphs of one
export share a ``transposed`` set of the module tensors stored transposed: an encoder-decoder's
encoder graph, which gathers from the tied embedding but has no head, then gathers the columns
of the decoder's transposed table too, so the embedding is stored once for all four graphs.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.exporter.passes.bind import ModuleWeight, Transform

__all__ = ["FoldWeightTransposes", "TRANSPOSE", "TRANSPOSED"]

TRANSPOSED = "val_transposed."  # a made-up constant's prefix: the weights writer names it after its reader
TRANSPOSE = Transform(
    "T", lambda w: w.t(), lambda shape: (shape[1], shape[0]), slices="view"
)  # a view: made contiguous once, at the end


def _gathers_rows(node: ir.Node) -> bool:
    return node.op_type == "Gather" and node.domain == "" and node.attributes.get_int("axis", 0) == 0


def _transposed(graph: ir.Graph, source: ir.Value, weight: ModuleWeight) -> ir.Value:
    name = f"{TRANSPOSED}{source.name}"
    if name not in graph.initializers:
        tensor = weight.then(TRANSPOSE)
        graph.register_initializer(
            ir.Value(name=name, type=ir.TensorType(tensor.dtype), shape=tensor.shape, const_value=tensor)
        )
    return graph.initializers[name]


def _gather_columns(graph: ir.Graph, node: ir.Node, table: ir.Value) -> None:
    """``Gather(W, ids)`` -> ``Transpose(Gather(W^T, ids, axis=1))``: the same [*ids, d] rows."""
    ids = node.inputs[1]
    assert ids is not None and ids.shape is not None, "the exporter types every Gather's indices"
    rank = len(ids.shape)
    columns = ir.node("Gather", [table, ids], {"axis": 1}, name=node.name)  # the embedding's lookup, under its name
    back = ir.node("Transpose", [columns.outputs[0]], {"perm": [*range(1, rank + 1), 0]}, name=f"{node.name}/Transpose")
    columns.outputs[0].type = ir.TensorType(table.dtype or ir.DataType.FLOAT)
    graph.insert_before(node, [columns, back])
    back.outputs[0].type, back.outputs[0].shape = node.outputs[0].type, node.outputs[0].shape
    node.outputs[0].replace_all_uses_with(back.outputs[0], replace_graph_outputs=True)
    graph.remove(node, safe=True)


def _identity(weight: ModuleWeight) -> int:
    """The module tensor itself (tied parameters are one Parameter object under several names;
    not its storage address: every meta or empty tensor has address 0)."""
    return id(weight.source.tensor(weight.module_name))


class FoldWeightTransposes(ir.passes.InPlacePass):
    def __init__(self, transposed: set[int] | None = None) -> None:
        super().__init__()
        self.transposed = transposed if transposed is not None else set()  # shared by the graphs of one export

    def _gather_transposed_elsewhere(self, graph: ir.Graph) -> int:
        """Row gathers of a table another graph already stores transposed: gather its columns."""
        moved = 0
        for node in list(graph):
            table = node.inputs[0] if _gathers_rows(node) else None
            weight = table.const_value if table is not None else None
            if (
                table is None
                or not isinstance(weight, ModuleWeight)
                or len(weight.shape) != 2
                or _identity(weight) not in self.transposed
            ):
                continue
            if all(_gathers_rows(use.node) and use.idx == 0 for use in table.uses()):
                _gather_columns(graph, node, _transposed(graph, table, weight))
                moved += 1
        return moved

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        folded = 0
        for node in list(graph):
            source = node.inputs[0] if node.op_type == "Transpose" and node.domain == "" and node.inputs else None
            weight = source.const_value if source is not None else None
            if source is None or not isinstance(weight, ModuleWeight) or len(weight.shape) != 2:
                continue
            if list(node.attributes.get_ints("perm", [1, 0])) != [1, 0]:
                continue
            readers = [use for use in source.uses() if use.node is not node]
            if any(
                not (_gathers_rows(use.node) and use.idx == 0) and use.node.op_type != "Transpose" for use in readers
            ):
                continue  # read as it is by something else: keep the one tensor and its Transpose
            table = _transposed(graph, source, weight)
            for use in readers:
                if _gathers_rows(use.node):
                    _gather_columns(graph, use.node, table)
            node.outputs[0].replace_all_uses_with(table)
            graph.remove(node, safe=True)
            self.transposed.add(_identity(weight))
            folded += 1
        folded += self._gather_transposed_elsewhere(graph)
        return ir.passes.PassResult(model, modified=bool(folded))
