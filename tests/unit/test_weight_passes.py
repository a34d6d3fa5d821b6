"""The passes that keep a graph's weights lazy, on tiny onnx-ir graphs run with ONNX Runtime
before and after: ``BindWeights`` (``passes.bind``), ``FoldWeightTransposes``
(``passes.transposes``) and ``FoldConstants`` (``passes.fold``)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch
from torch import nn

from kiln.errors import ExportError
from kiln.exporter.passes import run_passes
from kiln.exporter.passes.bind import BindWeights, ModuleWeight, WeightSource
from kiln.exporter.passes.fold import FoldConstants
from kiln.exporter.passes.transposes import TRANSPOSE, TRANSPOSED, FoldWeightTransposes
from kiln_testing import exact
from kiln_testing import run_graph as run

FLOAT, INT64 = ir.DataType.FLOAT, ir.DataType.INT64
OPSET = 19


def model_of(inputs: list[ir.Value], outputs: list[ir.Value], nodes: list[ir.Node], inits: list[ir.Value]) -> ir.Model:
    graph = ir.Graph(inputs, outputs, nodes=nodes, initializers=inits, opset_imports={"": OPSET}, name="g")
    return ir.Model(graph, ir_version=10)


def output(node: ir.Node, name: str) -> ir.Value:
    node.outputs[0].name = name
    return node.outputs[0]


def const(name: str, array: np.ndarray) -> ir.Value:
    return ir.val(name, const_value=ir.tensor(array, name=name))


def weight(source: WeightSource, name: str) -> ir.Value:
    """An initializer bound to the module tensor ``name``, as ``BindWeights`` leaves it."""
    tensor = ModuleWeight(source, name, FLOAT)
    return ir.val(name, FLOAT, list(tensor.shape.numpy()), const_value=tensor)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The module tensors whose values were computed (``ModuleWeight.array``), in order."""
    seen: list[str] = []
    original = ModuleWeight.array

    def counting(self: ModuleWeight) -> np.ndarray:
        seen.append(self.module_name)
        return original(self)

    monkeypatch.setattr(ModuleWeight, "array", counting)
    return seen


# ---------------------------------------------------------------- BindWeights


class Affine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)
        self.register_buffer("offset", torch.arange(3, dtype=torch.float32) / 4)


MODULE_NAMES = ["model.fc.weight", "model.fc.bias", "model.offset"]


def traced_affine(shapes: dict[str, list[int]] | None = None) -> ir.Model:
    """y = (x @ W^T + b + offset) * 2 as the exporter traces it from a meta-device module: its
    initializers hold meta tensors named after the module's (and one real constant, ``two``)."""
    want = {"model.fc.weight": [3, 4], "model.fc.bias": [3], "model.offset": [3], **(shapes or {})}
    metas = {
        name: ir.val(name, FLOAT, dims, const_value=ir.Tensor(torch.empty(dims, device="meta"), dtype=FLOAT, name=name))
        for name, dims in want.items()
    }
    two = const("two", np.array([2.0], dtype=np.float32))
    x = ir.val("x", FLOAT, [2, 4])
    t = ir.node("Transpose", [metas["model.fc.weight"]], {"perm": [1, 0]})
    mm = ir.node("MatMul", [x, t.outputs[0]])
    bias = ir.node("Add", [mm.outputs[0], metas["model.fc.bias"]])
    shift = ir.node("Add", [bias.outputs[0], metas["model.offset"]])
    scale = ir.node("Mul", [shift.outputs[0], two])
    y = output(scale, "y")
    y.dtype, y.shape = FLOAT, ir.Shape([2, 3])
    return model_of([x], [y], [t, mm, bias, shift, scale], [*metas.values(), two])


def affine_reference(module: Affine, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out: torch.Tensor = (module.fc(torch.from_numpy(x)) + module.offset) * 2
    return out.float().numpy()


def test_bind_weights_binds_lazily(reads: list[str]) -> None:
    module = Affine()
    model = traced_affine()
    two = model.graph.initializers["two"].const_value
    assert BindWeights(WeightSource(module))(model).modified
    assert reads == []  # bound, not read
    for name in MODULE_NAMES:
        tensor = model.graph.initializers[name].const_value
        assert isinstance(tensor, ModuleWeight) and tensor.module_name == name and tensor.dtype == FLOAT
        assert tensor.transforms == () and tensor.key == f"{name}|FLOAT"
    assert model.graph.initializers["two"].const_value is two  # not a module tensor: left as it was
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(run(model, {"x": x})["y"], affine_reference(module, x), rtol=1e-6, atol=1e-6)
    assert set(reads) == set(MODULE_NAMES)  # read when the graph was serialized
    bound = model.graph.initializers["model.fc.weight"].const_value
    assert isinstance(bound, ModuleWeight)
    assert np.shares_memory(bound.array(), module.fc.weight.detach().numpy())  # an fp32 tensor: its own memory, no copy


def test_bind_weights_converts_a_bf16_module_tensor_by_tensor() -> None:
    module = Affine().to(torch.bfloat16)
    model = traced_affine()
    BindWeights(WeightSource(module))(model)
    tensor = model.graph.initializers["model.fc.weight"].const_value
    assert isinstance(tensor, ModuleWeight) and tensor.dtype == FLOAT and tensor.module_tensor.dtype == torch.bfloat16
    np.testing.assert_array_equal(tensor.numpy(), module.fc.weight.detach().float().numpy())
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(run(model, {"x": x})["y"], affine_reference(module.float(), x), rtol=1e-6, atol=1e-6)


def test_bind_weights_refuses_a_tensor_the_model_lacks() -> None:
    model = traced_affine({"model.gone.weight": [3]})
    message = "the traced graph reads ['model.gone.weight'], which the model has no tensor of that name for"
    with pytest.raises(ExportError, match=exact(f"export: pass BindWeights on the prefill graph: {message}")):
        run_passes(model, [BindWeights(WeightSource(Affine()))], graph="prefill")


def test_bind_weights_refuses_a_mis_shaped_tensor() -> None:
    model = traced_affine({"model.fc.bias": [4]})
    message = "the traced graph reads model.fc.bias as [4], but the model's tensor of that name is [3]"
    with pytest.raises(ExportError, match=exact(f"export: pass BindWeights on the decode graph: {message}")):
        run_passes(model, [BindWeights(WeightSource(Affine()))], graph="decode")


# ---------------------------------------------------------------- FoldWeightTransposes


def linear_graph(source: WeightSource, *, also_read: bool = False) -> ir.Model:
    """y = x @ Transpose(W) (nn.Linear as the exporter writes it); ``also_read``: z = W + 1 too."""
    w = weight(source, "model.fc.weight")
    x = ir.val("x", FLOAT, [2, 4])
    t = ir.node("Transpose", [w], {"perm": [1, 0]}, name="/fc/Transpose")
    mm = ir.node("MatMul", [x, t.outputs[0]], name="/fc/MatMul")
    nodes, outputs, inits = [t, mm], [output(mm, "y")], [w]
    if also_read:
        one = const("one", np.ones((1,), dtype=np.float32))
        add = ir.node("Add", [w, one], name="/Add")
        nodes.append(add)
        outputs.append(output(add, "z"))
        inits.append(one)
    return model_of([x], outputs, nodes, inits)


def test_transpose_of_a_weight_becomes_a_transposed_lazy_weight(reads: list[str]) -> None:
    module = Affine()
    model = linear_graph(WeightSource(module))
    feeds = {"x": np.random.default_rng(2).standard_normal((2, 4)).astype(np.float32)}
    before = run(model, feeds)
    reads.clear()
    assert FoldWeightTransposes()(model).modified
    assert reads == []  # the transposed tensor is a recipe, computed when written
    assert [n.op_type for n in model.graph] == ["MatMul"]
    stored = model.graph.node("/fc/MatMul").inputs[1]
    assert stored is not None and stored.name == f"{TRANSPOSED}model.fc.weight"
    tensor = stored.const_value
    assert (
        isinstance(tensor, ModuleWeight)
        and tensor.module_name == "model.fc.weight"
        and tensor.transforms == (TRANSPOSE,)
    )
    assert list(tensor.shape) == [4, 3] and tensor.key == "model.fc.weight|FLOAT|T"
    np.testing.assert_array_equal(tensor.numpy(), module.fc.weight.detach().numpy().T)
    np.testing.assert_array_equal(run(model, feeds)["y"], before["y"])


def test_a_weight_read_as_it_is_keeps_its_transpose() -> None:
    model = linear_graph(WeightSource(Affine()), also_read=True)
    assert not FoldWeightTransposes()(model).modified
    assert [n.op_type for n in model.graph] == ["Transpose", "MatMul", "Add"]
    assert not any(name.startswith(TRANSPOSED) for name in model.graph.initializers)


class Tied(nn.Module):
    """An embedding and an LM head of one [V, d] parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def tied_graph(source: WeightSource, name: str, *, head: bool) -> ir.Model:
    """logits = 2 Gather(E, ids) @ Transpose(E) (``head``), else the embedding alone (an encoder)."""
    table = weight(source, name)
    ids = ir.val("input_ids", INT64, ["batch", 3])
    gather = ir.node("Gather", [table, ids], name="/emb/Gather")
    gather.outputs[0].dtype, gather.outputs[0].shape = FLOAT, ir.Shape(["batch", 3, 4])
    scale = ir.node("Mul", [gather.outputs[0], const("two", np.array(2.0, np.float32))], name="/emb/Mul")
    nodes = [gather, scale]
    if head:
        t = ir.node("Transpose", [table], {"perm": [1, 0]}, name="/head/Transpose")
        mm = ir.node("MatMul", [scale.outputs[0], t.outputs[0]], name="/head/MatMul")
        nodes += [t, mm]
    out = output(nodes[-1], "logits" if head else "hidden")
    return model_of([ids], [out], nodes, [table, scale.inputs[1]])


def test_a_tied_table_is_stored_once_for_every_graph() -> None:
    source = WeightSource(Tied())
    transposed: set[int] = set()
    feeds = {"input_ids": np.array([[0, 3, 9], [9, 1, 1]], dtype=np.int64)}
    decoder = tied_graph(source, "model.emb.weight", head=True)
    before = run(decoder, feeds)
    assert FoldWeightTransposes(transposed)(decoder).modified
    graph = decoder.graph
    read = [v for v in graph.initializers.values() if v.uses() and isinstance(v.const_value, ModuleWeight)]
    assert [v.name for v in read] == [f"{TRANSPOSED}model.emb.weight"]  # one [d, V] table for the head and the lookup
    assert sorted((u.node.op_type, u.node.attributes.get_int("axis", 0)) for u in read[0].uses()) == [
        ("Gather", 1),
        ("MatMul", 0),
    ]
    assert graph.node("/emb/Gather/Transpose").attributes.get_ints("perm") == (1, 2, 0)
    np.testing.assert_array_equal(run(decoder, feeds)["logits"], before["logits"])
    # another graph gathering from the same parameter (under its other name) gathers the stored columns
    encoder = tied_graph(source, "model.head.weight", head=False)
    alone = tied_graph(source, "model.head.weight", head=False)
    want = run(encoder, feeds)["hidden"]
    assert FoldWeightTransposes(transposed)(encoder).modified
    assert [
        v.name for v in encoder.graph.initializers.values() if v.uses() and isinstance(v.const_value, ModuleWeight)
    ] == [f"{TRANSPOSED}model.head.weight"]
    np.testing.assert_array_equal(run(encoder, feeds)["hidden"], want)
    assert not FoldWeightTransposes()(alone).modified  # without the shared set: a plain row gather
    assert [(n.op_type, n.attributes.get_int("axis", 0)) for n in alone.graph] == [("Gather", 0), ("Mul", 0)]


# ---------------------------------------------------------------- FoldConstants


class Wide(nn.Module):
    """A weight of more than 20 elements: onnxscript's folder reads constants up to 20 elements
    for its shape inference (a bias of a toy model), never a real weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.fc = nn.Linear(4, 6, bias=False)  # weight [6, 4]


def fold_graph(source: WeightSource) -> tuple[ir.Model, dict[str, ir.Node]]:
    """y = Reshape(x @ -W + (1 + 1), Shape(x @ -W)) + sum(8192 ones) + sum(8193 ones) + 3; z = sum(Expand(1,
    [512, 512])) + sum(Expand(1, [513, 512])); and a dead Relu. Returns the nodes by name."""
    x = ir.val("x", FLOAT, [2, 6])
    w = weight(source, "model.fc.weight")  # [6, 4]
    inits = [w, const("ok", np.ones(8192, np.float32)), const("big", np.ones(8193, np.float32))]
    inits += [
        const("s", np.ones(1, np.float32)),
        const("fits", np.array([512, 512], np.int64)),
        const("over", np.array([513, 512], np.int64)),
    ]
    by_name = {v.name: v for v in inits}
    specs: list[tuple[str, str, list[str], dict[str, object]]] = [
        ("one", "Constant", [], {"value": ir.tensor(np.ones(4, np.float32))}),
        ("two", "Add", ["one", "one"], {}),
        ("neg_w", "Neg", ["model.fc.weight"], {}),
        ("mm", "MatMul", ["x", "neg_w"], {}),
        ("plus_two", "Add", ["mm", "two"], {}),
        ("shape", "Shape", ["mm"], {}),
        ("reshape", "Reshape", ["plus_two", "shape"], {}),
        ("sum_ok", "ReduceSum", ["ok"], {"keepdims": 0}),
        ("sum_big", "ReduceSum", ["big"], {"keepdims": 0}),
        ("sums", "Add", ["sum_ok", "sum_big"], {}),
        ("with_sums", "Add", ["reshape", "sums"], {}),
        ("three", "Constant", [], {"value": ir.tensor(np.full(4, 3.0, np.float32))}),
        ("y", "Add", ["with_sums", "three"], {}),
        ("expand_fits", "Expand", ["s", "fits"], {}),
        ("expand_over", "Expand", ["s", "over"], {}),
        ("sum_fits", "ReduceSum", ["expand_fits"], {"keepdims": 0}),
        ("sum_over", "ReduceSum", ["expand_over"], {"keepdims": 0}),
        ("z", "Add", ["sum_fits", "sum_over"], {}),
        ("dead", "Relu", ["x"], {}),
    ]
    values: dict[str, ir.Value] = {"x": x, **by_name}
    nodes = {}
    for name, op, inputs, attributes in specs:
        node = ir.node(op, [values[i] for i in inputs], attributes or None, name=name)
        values[name] = output(node, name)
        nodes[name] = node
    return model_of([x], [values["y"], values["z"]], list(nodes.values()), inits), nodes


def test_fold_constants_folds_around_the_weights(reads: list[str]) -> None:
    model, nodes = fold_graph(WeightSource(Wide()))
    feeds = {"x": np.random.default_rng(3).standard_normal((2, 6)).astype(np.float32)}
    before = run(model, feeds)
    reads.clear()
    assert FoldConstants()(model).modified
    assert reads == []  # no weight was read to fold: -W stays a node on the lazy weight
    left = {n.name for n in model.graph}
    # folded: the constants' arithmetic, the static shape (and the Reshape it made a no-op), a sum
    # of 8192 elements and an Expand to 512 x 512; removed: the dead Relu
    assert left == {
        "neg_w",
        "mm",
        "plus_two",
        "sum_big",
        "sums",
        "with_sums",
        "y",
        "expand_over",
        "sum_fits",
        "sum_over",
        "z",
    }
    assert isinstance(nodes["neg_w"].inputs[0] and nodes["neg_w"].inputs[0].const_value, ModuleWeight)
    three = nodes["y"].inputs[1]
    assert three is not None and three.is_initializer()  # a Constant node lifted to an initializer
    folded = nodes["plus_two"].inputs[1]
    assert folded is not None and folded.is_initializer() and folded.const_value is not None
    np.testing.assert_array_equal(folded.const_value.numpy(), np.full(4, 2.0, np.float32))
    after = run(model, feeds)
    for name in ("y", "z"):
        np.testing.assert_array_equal(after[name], before[name])
    assert not FoldConstants()(model).modified  # nothing left to do
