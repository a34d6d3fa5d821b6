"""The generic graph passes on tiny onnx-ir graphs, run with ONNX Runtime before and after:
``ApplyContract`` and ``run_passes``, ``GraphRewrite``'s postcondition, ``NameNodes`` and
``PleTablesToInputs``."""

from __future__ import annotations

import itertools
import re
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from kiln.errors import ExportError
from kiln.exporter.contract.io import DECODER_KINDS, GraphKind, graph_io
from kiln.exporter.passes import ApplyContract, GraphRewrite, NameNodes, PleTablesToInputs, run_passes
from kiln.exporter.passes.base import pass_name
from kiln.plugins.native import spec_of
from kiln_testing import tiny_config

SPEC = spec_of(tiny_config())  # vocab 101, 2 layers, 2 kv heads of 8
INT64, FLOAT = ir.DataType.INT64, ir.DataType.FLOAT
OPSET = 19


def exact(message: str) -> str:
    """A ``pytest.raises(match=...)`` pattern for exactly ``message``."""
    return "^" + re.escape(message) + "$"


def run(model: ir.Model | onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    proto = ir.serde.serialize_model(model) if isinstance(model, ir.Model) else model
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds), strict=True))


def model_of(graph: ir.Graph) -> ir.Model:
    return ir.Model(graph, ir_version=10)


def init(graph_inits: list[ir.Value], name: str, array: np.ndarray) -> ir.Value:
    value = ir.val(name, const_value=ir.tensor(array, name=name))
    graph_inits.append(value)
    return value


# ---------------------------------------------------------------- a graph with the contract's I/O


def traced_like(kind: GraphKind, *, seed: int = 0) -> ir.Model:
    """A runnable graph with the I/O ``graph_io(SPEC, kind)`` wants, dims named like torch's
    symbols (s0 = batch, s1 = seq, s2 = past, s3 = total): logits and new keys/values are rows of
    random tables gathered by ``input_ids``; presents are ``Concat(past, new)`` with a past."""
    rng = np.random.default_rng(seed)
    n_kv, head = SPEC.n_kv_heads, SPEC.head_dim
    seq: int | str = 1 if kind is GraphKind.DECODE else "s1"
    has_past = kind is not GraphKind.PREFILL
    total = "s3" if has_past else seq
    inits: list[ir.Value] = []
    ids = ir.val("input_ids", INT64, ["s0", seq])
    mask = ir.val("attention_mask", INT64, ["s0", total])
    pos = ir.val("position_ids", INT64, ["s0", seq])
    inputs = [ids, mask, pos]
    pasts = []
    if has_past:
        for i in range(SPEC.n_layers):
            for part in ("key", "value"):
                pasts.append(ir.val(f"past_key_values.{i}.{part}", FLOAT, ["s0", n_kv, "s2", head]))
        inputs += pasts
    emb = init(inits, "emb", rng.standard_normal((SPEC.vocab_size, SPEC.vocab_size)).astype(np.float32))
    shape = init(inits, "kv_shape", np.array([0, 0, n_kv, head], dtype=np.int64))
    nodes = [ir.node("Gather", [emb, ids], name="logits_gather")]
    logits = nodes[-1].outputs[0]
    logits.name, logits.dtype, logits.shape = "logits", FLOAT, ir.Shape(["s0", seq, SPEC.vocab_size])
    outputs = [logits]
    for i in range(SPEC.n_layers):
        for j, part in enumerate(("key", "value")):
            table = init(
                inits, f"kv.{i}.{part}", rng.standard_normal((SPEC.vocab_size, n_kv * head)).astype(np.float32)
            )
            gather = ir.node("Gather", [table, ids])
            reshape = ir.node("Reshape", [gather.outputs[0], shape])
            transpose = ir.node("Transpose", [reshape.outputs[0]], {"perm": [0, 2, 1, 3]})
            nodes += [gather, reshape, transpose]
            new = transpose.outputs[0]
            if has_past:
                concat = ir.node("Concat", [pasts[2 * i + j], new], {"axis": 2})
                nodes.append(concat)
                new = concat.outputs[0]
            new.name, new.dtype, new.shape = f"present.{i}.{part}", FLOAT, ir.Shape(["s0", n_kv, total, head])
            outputs.append(new)
    graph = ir.Graph(inputs, outputs, nodes=nodes, initializers=inits, opset_imports={"": OPSET}, name="main_graph")
    return model_of(graph)


def feeds_for(kind: GraphKind, batch: int = 2, seq: int = 3, past: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    seq = 1 if kind is GraphKind.DECODE else seq
    past = 0 if kind is GraphKind.PREFILL else past
    feeds = {
        "input_ids": rng.integers(0, SPEC.vocab_size, (batch, seq)).astype(np.int64),
        "attention_mask": np.ones((batch, past + seq), dtype=np.int64),
        "position_ids": np.tile(np.arange(past, past + seq, dtype=np.int64), (batch, 1)),
    }
    if kind is not GraphKind.PREFILL:
        for i in range(SPEC.n_layers):
            for part in ("key", "value"):
                feeds[f"past_key_values.{i}.{part}"] = rng.standard_normal(
                    (batch, SPEC.n_kv_heads, past, SPEC.head_dim)
                ).astype(np.float32)
    return feeds


def dims(value: ir.Value) -> list[Any]:
    assert value.shape is not None
    return [d if isinstance(d, int) else d.value for d in value.shape]


@pytest.mark.parametrize("kind", list(DECODER_KINDS))
def test_contract_names_the_dims_and_keeps_the_outputs(kind: GraphKind) -> None:
    model = traced_like(kind)
    feeds = feeds_for(kind)
    before = run(model, feeds)
    io = graph_io(SPEC, kind)
    out = run_passes(model, [ApplyContract(io, kind)], graph=kind.value)
    assert out is model  # in place
    assert model.graph.name == kind.value
    for value, spec in zip([*model.graph.inputs, *model.graph.outputs], [*io.inputs, *io.outputs], strict=True):
        assert value.name == spec.name
        assert dims(value) == list(spec.dims)
    # the dim names reach the serialized graph
    proto = ir.serde.serialize_model(model)
    logits = proto.graph.output[0].type.tensor_type.shape.dim
    want_seq = [1] if kind is GraphKind.DECODE else ["seq"]
    assert [d.dim_param or d.dim_value for d in logits] == ["batch", *want_seq, SPEC.vocab_size]
    after = run(proto, feeds)
    assert after.keys() == before.keys() == set(io.output_names)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])
    if kind is not GraphKind.PREFILL:
        assert dims(model.graph.inputs[1]) == ["batch", "total_seq"]
        assert dims(model.graph.inputs[3]) == ["batch", 2, "past_seq", 8]
        assert after["present.0.key"].shape == (2, 2, 4 + feeds["input_ids"].shape[1], 8)


def test_contract_with_last_logits_and_ple_table_inputs() -> None:
    model = traced_like(GraphKind.PREFILL)
    io = graph_io(SPEC, GraphKind.PREFILL, last_logits_only=True)
    with pytest.raises(
        ExportError,
        match=re.escape("prefill graph output logits has shape [s0,s1,101], the contract needs ['batch', 1, 101]"),
    ):
        ApplyContract(io, GraphKind.PREFILL)(model)
    # a graph that writes [s0, 1, vocab] passes and keeps the static 1
    model = traced_like(GraphKind.PREFILL)
    model.graph.outputs[0].shape = ir.Shape(["s0", 1, SPEC.vocab_size])
    ApplyContract(io, GraphKind.PREFILL)(model)
    assert dims(model.graph.outputs[0]) == ["batch", 1, 101]
    # ple table inputs must be there, with their static shapes
    tables = graph_io(SPEC, GraphKind.PREFILL, ple_tables=((48, 32),))
    with pytest.raises(
        ExportError,
        match=exact(
            "export: prefill graph inputs are ['input_ids', 'attention_mask', 'position_ids'], "
            "the contract needs ['input_ids', 'attention_mask', 'position_ids', 'ple.0.scale', 'ple.0.shift']"
        ),
    ):
        ApplyContract(tables, GraphKind.PREFILL)(traced_like(GraphKind.PREFILL))


def _broken(kind: GraphKind, how: str) -> ir.Model:
    model = traced_like(kind)
    graph = model.graph
    if how == "input name":
        graph.inputs[0].name = "ids"
    elif how == "input dtype":
        graph.inputs[1].dtype = ir.DataType.INT32
    elif how == "output dtype":
        graph.outputs[2].dtype = ir.DataType.FLOAT16
    elif how == "static dim":
        graph.outputs[1].shape = ir.Shape(["s0", 3, "s1", 8])
    elif how == "rank":
        graph.inputs[2].shape = ir.Shape(["s0", "s1", 1])
    elif how == "no shape":
        graph.outputs[0].shape = None
    elif how == "output order":
        graph.outputs[1], graph.outputs[2] = graph.outputs[2], graph.outputs[1]
    elif how == "missing output":
        graph.outputs.pop()
    elif how == "decode seq":
        graph.inputs[0].shape = ir.Shape(["s0", "s1"])
    return model


OUT = "['logits', 'present.0.key', 'present.0.value', 'present.1.key', 'present.1.value']"
BROKEN = [
    (
        GraphKind.PREFILL,
        "input name",
        "prefill graph inputs are ['ids', 'attention_mask', 'position_ids'], the contract needs ['input_ids', "
        "'attention_mask', 'position_ids']",
    ),
    (GraphKind.PREFILL, "input dtype", "prefill graph input attention_mask is INT32, the contract needs int64"),
    (GraphKind.PREFILL, "output dtype", "prefill graph output present.0.value is FLOAT16, the contract needs float32"),
    (
        GraphKind.PREFILL,
        "static dim",
        "prefill graph output present.0.key has shape [s0,3,s1,8], the contract needs ['batch', 2, 'seq', 8]",
    ),
    (
        GraphKind.PREFILL,
        "rank",
        "prefill graph input position_ids has shape [s0,s1,1], the contract needs ['batch', 'seq']",
    ),
    (
        GraphKind.PREFILL,
        "no shape",
        "prefill graph output logits has shape None, the contract needs ['batch', 'seq', 101]",
    ),
    (
        GraphKind.PREFILL,
        "output order",
        "prefill graph outputs are ['logits', 'present.0.value', 'present.0.key', 'present.1.key', "
        f"'present.1.value'], the contract needs {OUT}",
    ),
    (
        GraphKind.UNIFIED,
        "missing output",
        "model graph outputs are ['logits', 'present.0.key', 'present.0.value', 'present.1.key'], the contract "
        f"needs {OUT}",
    ),
    (GraphKind.DECODE, "decode seq", "decode graph input input_ids has shape [s0,s1], the contract needs ['batch', 1]"),
]


@pytest.mark.parametrize(("kind", "how", "message"), BROKEN, ids=[b[1] for b in BROKEN])
def test_a_graph_that_breaks_the_contract(kind: GraphKind, how: str, message: str) -> None:
    io = graph_io(SPEC, kind)
    with pytest.raises(ExportError, match=exact(f"export: {message}")):
        ApplyContract(io, kind)(_broken(kind, how))
    with pytest.raises(
        ExportError, match=exact(f"export: pass ApplyContract on the {kind.value} graph: {message}")
    ) as info:
        run_passes(_broken(kind, how), [NameNodes(), ApplyContract(io, kind), NameNodes()], graph=kind.value)
    assert isinstance(info.value.__cause__, ExportError)


def test_contract_is_checked_at_the_graphs_precision() -> None:
    """An fp32 graph against the fp16 contract (KV float16) fails on the first cache tensor."""
    io16 = graph_io(SPEC, GraphKind.DECODE, kv_dtype="float16")
    with pytest.raises(
        ExportError,
        match=exact("export: decode graph input past_key_values.0.key is FLOAT, the contract needs float16"),
    ):
        ApplyContract(io16, GraphKind.DECODE)(traced_like(GraphKind.DECODE))


# ---------------------------------------------------------------- GraphRewrite and run_passes


def _tiny() -> ir.Model:
    x = ir.val("x", FLOAT, [2, 3])
    node = ir.node("Relu", [x], name="relu")
    node.outputs[0].name, node.outputs[0].dtype, node.outputs[0].shape = "y", FLOAT, ir.Shape([2, 3])
    return model_of(ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": OPSET}, name="g"))


def rename_output(model: ir.Model) -> int:
    model.graph.outputs[0].name = "z"
    return 1


def negate(model: ir.Model) -> int:
    """y = -relu(x): a rewrite that replaces what computes y and keeps its name."""
    graph = model.graph
    old = graph.outputs[0]
    neg = ir.node("Neg", [old], name="neg")
    graph.append(neg)
    old.name = "y.relu"
    neg.outputs[0].name, neg.outputs[0].dtype, neg.outputs[0].shape = "y", FLOAT, ir.Shape([2, 3])
    graph.outputs[0] = neg.outputs[0]
    return 1


def nothing(model: ir.Model) -> list[str]:
    return []


def test_graph_rewrite_result_and_name() -> None:
    model = _tiny()
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    rewrite = GraphRewrite(negate)
    assert repr(rewrite) == pass_name(rewrite) == "negate"
    assert pass_name(NameNodes()) == "NameNodes"
    result = rewrite(model)
    assert result.modified and rewrite.result == 1
    np.testing.assert_array_equal(run(model, {"x": x})["y"], -np.maximum(x, 0))
    empty = GraphRewrite(nothing)
    assert not empty(model).modified and empty.result == []


def test_graph_rewrite_that_renames_an_output_fails() -> None:
    message = "rename_output changed the graph's inputs/outputs from (['x'], ['y']) to (['x'], ['z'])"
    with pytest.raises(ir.passes.PostconditionError) as info:
        GraphRewrite(rename_output)(_tiny())
    assert isinstance(info.value.__cause__, ExportError) and str(info.value.__cause__) == f"export: {message}"
    with pytest.raises(ExportError, match=exact(f"export: pass rename_output on the decode graph: {message}")):
        run_passes(_tiny(), [GraphRewrite(negate), GraphRewrite(rename_output)], graph="decode")


def test_run_passes_keeps_other_errors() -> None:
    """Anything but a KilnError is a bug and keeps its type and traceback."""

    def broken(model: ir.Model) -> int:
        raise ValueError("a bug")

    with pytest.raises(ValueError, match=exact("a bug")):
        run_passes(_tiny(), [GraphRewrite(broken)], graph="prefill")


# ---------------------------------------------------------------- NameNodes

_SCOPES = "pkg.torch.onnx.name_scopes"
_COUNT = itertools.count()  # unique names before the pass (ONNX Runtime refuses duplicates)


def _scoped(op: str, inputs: list[ir.Value], scopes: str | None, **attrs: Any) -> ir.Node:
    node = ir.node(op, inputs, attrs or None, name=f"node_{next(_COUNT)}")
    if scopes is not None:
        node.metadata_props[_SCOPES] = scopes
        node.metadata_props["pkg.torch.onnx.stack_trace"] = "/home/someone/model.py:12"
    node.outputs[0].metadata_props["pkg.torch.onnx.fx_node"] = "%add = ..."
    node.outputs[0].dtype = FLOAT
    return node


def test_name_nodes() -> None:
    x = ir.val("x", FLOAT, [2, 4], metadata_props={"pkg.torch.onnx.x": "1"})
    w = ir.val(
        "w",
        const_value=ir.tensor(np.arange(16, dtype=np.float32).reshape(4, 4) / 10, name="w"),
        metadata_props={"k": "v"},
    )
    attn = "['', 'model', 'model.layers.0', 'model.layers.0.attn', 'matmul']"
    mm1 = _scoped("MatMul", [x, w], attn)
    mm2 = _scoped("MatMul", [mm1.outputs[0], w], attn.replace("'matmul'", "'matmul_1'"))
    relu = _scoped(
        "Relu",
        [mm2.outputs[0]],
        "['', 'model', 'model.layers.0', 'model.layers.0.mlp', 'model.layers.0.mlp.fc1', 'relu']",
    )
    root = _scoped("Neg", [relu.outputs[0]], "['', 'model', 'neg']")  # only the wrapper: no module
    bad = _scoped("Abs", [root.outputs[0]], "not a [list")
    bare = _scoped("Sigmoid", [bad.outputs[0]], None)
    bare2 = _scoped("Sigmoid", [bare.outputs[0]], None)
    nodes = [mm1, mm2, relu, root, bad, bare, bare2]
    out = bare2.outputs[0]
    out.name, out.shape = "y", ir.Shape([2, 4])
    graph = ir.Graph(
        [x], [out], nodes=nodes, initializers=[w], opset_imports={"": OPSET}, name="g", metadata_props={"g": "1"}
    )
    model = ir.Model(graph, ir_version=10, metadata_props={"m": "1"})
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)}
    before = run(model, feeds)
    result = NameNodes()(model)
    assert result.modified and result.model is model
    assert [n.name for n in model.graph] == [
        "/layers.0.attn/MatMul",
        "/layers.0.attn/MatMul_1",
        "/layers.0.mlp.fc1/Relu",
        "/Neg",
        "/Abs",
        "/Sigmoid",
        "/Sigmoid_1",
    ]
    assert all(not n.metadata_props for n in model.graph)
    assert all(not v.metadata_props for n in model.graph for v in n.outputs)
    assert not x.metadata_props and not w.metadata_props
    assert not model.metadata_props and not model.graph.metadata_props
    np.testing.assert_array_equal(run(model, feeds)["y"], before["y"])


def test_name_nodes_reaches_subgraphs() -> None:
    cond = ir.val("cond", ir.DataType.BOOL, [])
    x = ir.val("x", FLOAT, [3])
    scope = "['', 'model', 'model.head', 'neg']"

    def branch(op: str) -> ir.Graph:
        node = _scoped(op, [x], scope)
        node.outputs[0].shape = ir.Shape([3])
        return ir.Graph([], node.outputs, nodes=[node], name=f"{op}_branch")

    if_node = ir.node("If", [cond], {"then_branch": branch("Neg"), "else_branch": branch("Abs")}, name="if")
    if_node.outputs[0].name, if_node.outputs[0].dtype, if_node.outputs[0].shape = "y", FLOAT, ir.Shape([3])
    model = model_of(ir.Graph([cond, x], if_node.outputs, nodes=[if_node], opset_imports={"": OPSET}, name="g"))
    NameNodes()(model)
    names = [n.name for n in ir.traversal.RecursiveGraphIterator(model.graph)]
    assert sorted(names) == ["/If", "/head/Abs", "/head/Neg"]
    xs = np.array([-1.0, 2.0, -3.0], dtype=np.float32)
    np.testing.assert_array_equal(run(model, {"cond": np.array(True), "x": xs})["y"], -xs)
    np.testing.assert_array_equal(run(model, {"cond": np.array(False), "x": xs})["y"], np.abs(xs))


# ---------------------------------------------------------------- PleTablesToInputs

ROWS, D = 6, 4


def ple_graph(tables: list[tuple[np.ndarray, np.ndarray]], decoy: np.ndarray | None = None) -> ir.Model:
    """y = x * scale_i[pos] + shift_i[pos] for each sub-layer i in turn; the tables are
    initializers under exporter-made names, and an optional decoy of the same shape is added."""
    x = ir.val("x", FLOAT, ["b", "s", D])
    pos = ir.val("position_ids", INT64, ["b", "s"])
    inits: list[ir.Value] = []
    nodes: list[ir.Node] = []
    h = x
    for i, (scale, shift) in enumerate(tables):
        s = init(inits, f"val_{2 * i}", scale)
        b = init(inits, f"val_{2 * i + 1}", shift)
        gs, gb = ir.node("Gather", [s, pos]), ir.node("Gather", [b, pos])
        mul = ir.node("Mul", [h, gs.outputs[0]])
        add = ir.node("Add", [mul.outputs[0], gb.outputs[0]])
        nodes += [gs, gb, mul, add]
        h = add.outputs[0]
    if decoy is not None:
        d = init(inits, "decoy", decoy)
        g = ir.node("Gather", [d, pos])
        add = ir.node("Add", [h, g.outputs[0]])
        nodes += [g, add]
        h = add.outputs[0]
    h.name, h.dtype, h.shape = "y", FLOAT, ir.Shape(["b", "s", D])
    return model_of(ir.Graph([x, pos], [h], nodes=nodes, initializers=inits, opset_imports={"": OPSET}, name="prefill"))


def _tables(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((ROWS, D)).astype(np.float32), rng.standard_normal((ROWS, D)).astype(np.float32))
        for _ in range(n)
    ]


def _torch(tables: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.from_numpy(s.copy()), torch.from_numpy(b.copy())) for s, b in tables]


def _ple_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "x": rng.standard_normal((2, 5, D)).astype(np.float32),
        "position_ids": rng.integers(0, ROWS, (2, 5)).astype(np.int64),
    }


def test_ple_tables_become_inputs() -> None:
    tables = _tables(2)
    decoy = np.random.default_rng(9).standard_normal((ROWS, D)).astype(np.float32)
    model = ple_graph(tables, decoy)
    feeds = _ple_feeds()
    before = run(model, feeds)["y"]
    pass_ = PleTablesToInputs(_torch(tables))
    assert pass_(model).modified
    graph = model.graph
    assert [v.name for v in graph.inputs] == [
        "x",
        "position_ids",
        "ple.0.scale",
        "ple.0.shift",
        "ple.1.scale",
        "ple.1.shift",
    ]
    assert sorted(graph.initializers) == ["decoy"]  # the same-shape tensor of other content stays
    for value in graph.inputs[2:]:
        assert value.const_value is None and value.dtype == FLOAT and list(value.shape) == [ROWS, D]
    tables_feeds = {
        f"ple.{i}.{part}": t for i, pair in enumerate(tables) for part, t in zip(("scale", "shift"), pair, strict=True)
    }
    after = run(model, {**feeds, **tables_feeds})["y"]
    np.testing.assert_array_equal(after, before)
    # other tables fed in change the output: they really are read from the inputs now
    swapped = {**tables_feeds, "ple.1.shift": tables_feeds["ple.1.shift"] + 1.0}
    np.testing.assert_allclose(run(model, {**feeds, **swapped})["y"], before + 1.0, rtol=0, atol=1e-5)


def test_ple_table_not_in_graph() -> None:
    tables = _tables(1)
    other = [(torch.from_numpy(tables[0][0].copy()), torch.from_numpy(tables[0][1] + 1.0))]
    message = "--ple-tables input: the folded table ple.0.shift is not a constant of the traced graph"
    with pytest.raises(ExportError, match=exact(f"export: {message}")):
        PleTablesToInputs(other)(ple_graph(tables))
    with pytest.raises(ExportError, match=exact(f"export: pass PleTablesToInputs on the prefill graph: {message}")):
        run_passes(ple_graph(tables), [PleTablesToInputs(other)], graph="prefill")
    # a table of the same values but another dtype is not the table either
    as_f64 = [(torch.from_numpy(tables[0][0].astype(np.float64)), torch.from_numpy(tables[0][1].copy()))]
    with pytest.raises(ExportError, match=re.escape("the folded table ple.0.scale is not a constant")):
        PleTablesToInputs(as_f64)(ple_graph(tables))


def test_no_ple_tables_is_a_no_op() -> None:
    model = ple_graph(_tables(1))
    result = PleTablesToInputs([])(model)
    assert not result.modified and [v.name for v in model.graph.inputs] == ["x", "position_ids"]


def test_ple_tables_of_equal_content() -> None:
    """Two sub-layers whose folded tables hold the same values (an untrained PLE: each table
    separately in the graph) must each become their input."""
    scale, shift = _tables(1)[0]
    tables = [(scale, shift), (scale.copy(), shift.copy())]
    model = ple_graph(tables)
    feeds = _ple_feeds()
    before = run(model, feeds)["y"]
    PleTablesToInputs(_torch(tables))(model)
    assert [v.name for v in model.graph.inputs][2:] == ["ple.0.scale", "ple.0.shift", "ple.1.scale", "ple.1.shift"]
    tables_feeds = {"ple.0.scale": scale, "ple.0.shift": shift, "ple.1.scale": scale, "ple.1.shift": shift}
    np.testing.assert_array_equal(run(model, {**feeds, **tables_feeds})["y"], before)
    # the second sub-layer reads its own input, not the first's (equal values could hide that)
    moved = {**tables_feeds, "ple.1.shift": shift + 1.0}
    np.testing.assert_allclose(run(model, {**feeds, **moved})["y"], before + 1.0, rtol=0, atol=1e-5)
