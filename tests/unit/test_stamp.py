"""``StampLayers`` (``passes.stamp``): a graph traced with the first layers, stamped to the
model's depth, computes what the graph of every layer computes (ONNX Runtime on both), each
copy reading its own lazy weights and cache; ``StampPlan.of`` picks the template."""

from __future__ import annotations

import re

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from torch import nn

from kiln.errors import ExportError
from kiln.exporter.passes import run_passes
from kiln.exporter.passes.bind import ModuleWeight, WeightSource
from kiln.exporter.passes.stamp import StampLayers, StampPlan
from kiln.plugins.base import LayerPlan

FLOAT, INT64 = ir.DataType.FLOAT, ir.DataType.INT64
V, D, LAYERS = 11, 4, 4


def run(model: ir.Model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    proto = ir.serde.serialize_model(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList(nn.Linear(D, D, bias=False) for _ in range(LAYERS))
        self.head = nn.Linear(D, V, bias=False)


class Graph:
    def __init__(self, source: WeightSource) -> None:
        self.source = source
        self.nodes: list[ir.Node] = []
        self.inits: dict[str, ir.Value] = {}

    def const(self, name: str, array: np.ndarray) -> ir.Value:
        return self.inits.setdefault(name, ir.val(name, const_value=ir.tensor(array, name=name)))

    def weight(self, name: str) -> ir.Value:
        tensor = ModuleWeight(self.source, name, FLOAT)
        return self.inits.setdefault(name, ir.val(name, FLOAT, list(tensor.shape.numpy()), const_value=tensor))

    def op(self, op: str, inputs: list[ir.Value], name: str, attributes: dict[str, object] | None = None) -> ir.Value:
        self.nodes.append(ir.node(op, inputs, attributes, name=name))
        return self.nodes[-1].outputs[0]


def traced(source: WeightSource, layers: int, *, two_values: bool = False) -> ir.Model:
    """h = E[ids]; per layer i: m = h @ W_i * p (p = position_ids as float, shared; reshaped to
    Shape(h), computed outside the layer), h = h +
    tanh(m), present.i.key = Concat(past.i.key / 2, m) (the halving outside the layer's scope:
    a cache update of the model's forward); logits = h @ H^T. ``two_values``: layer 1 also reads layer 0's m."""
    g = Graph(source)
    ids, pos = ir.val("input_ids", INT64, ["batch", "seq"]), ir.val("position_ids", INT64, ["batch", "seq"])
    pasts = [ir.val(f"past_key_values.{i}.key", FLOAT, ["batch", "past_seq", D]) for i in range(layers)]
    p = g.op(
        "Unsqueeze",
        [g.op("Cast", [pos], "/rotary/Cast", {"to": FLOAT}), g.const("last", np.array([-1], np.int64))],
        "/rotary/Unsqueeze",
    )
    h = g.op("Gather", [g.weight("model.emb.weight"), ids], "/emb/Gather")
    presents, m_before = [], None
    for i in range(layers):
        w = g.op("Transpose", [g.weight(f"model.layers.{i}.weight")], f"/layers.{i}/Transpose", {"perm": [1, 0]})
        shape = g.op("Shape", [h], f"/Shape_{i}")  # outside every layer: the same in every layer, shared
        m = g.op(
            "Reshape",
            [g.op("Mul", [g.op("MatMul", [h, w], f"/layers.{i}/MatMul"), p], f"/layers.{i}/Mul"), shape],
            f"/layers.{i}/Reshape",
        )
        t = g.op(
            "Tanh",
            [
                m
                if not (two_values and i == 1 and m_before is not None)
                else g.op("Add", [m, m_before], "/layers.1/Add_1")
            ],
            f"/layers.{i}/Tanh",
        )
        h, m_before = g.op("Add", [h, t], f"/layers.{i}/Add"), m
        old = g.op(
            "Mul", [pasts[i], g.const("half", np.array(0.5, np.float32))], f"/cache.{i}/Mul"
        )  # outside every layer, reading one layer's cache only
        presents.append(g.op("Concat", [old, m], f"/layers.{i}/Concat", {"axis": 1}))
    logits = g.op(
        "MatMul",
        [h, g.op("Transpose", [g.weight("model.head.weight")], "/head/Transpose", {"perm": [1, 0]})],
        "/head/MatMul",
    )
    for value, name in [(logits, "logits"), *((v, f"present.{i}.key") for i, v in enumerate(presents))]:
        value.name, value.dtype = name, FLOAT
    graph = ir.Graph(
        [ids, pos, *pasts],
        [logits, *presents],
        nodes=g.nodes,
        initializers=list(g.inits.values()),
        opset_imports={"": 19},
        name="main_graph",
    )
    return ir.Model(graph, ir_version=10)


def feeds(layers: int = LAYERS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    out = {
        "input_ids": rng.integers(0, V, (2, 3)).astype(np.int64),
        "position_ids": np.tile(np.arange(5, 8, dtype=np.int64), (2, 1)),
    }
    return out | {f"past_key_values.{i}.key": rng.standard_normal((2, 5, D)).astype(np.float32) for i in range(layers)}


PLAN = StampPlan("layers.{}", 2, (0, 1, 1, 1))


def test_stamped_layers_compute_what_the_whole_graph_computes() -> None:
    source = WeightSource(Deep())
    want = run(traced(source, LAYERS), feeds())
    model = traced(source, 2)
    assert StampLayers(PLAN)(model).modified
    graph = model.graph
    assert [v.name for v in graph.inputs] == [
        "input_ids",
        "position_ids",
        *(f"past_key_values.{i}.key" for i in range(LAYERS)),
    ]
    assert [v.name for v in graph.outputs] == ["logits", *(f"present.{i}.key" for i in range(LAYERS))]
    for i in (2, 3):
        tensor = graph.initializers[f"model.layers.{i}.weight"].const_value
        assert (
            isinstance(tensor, ModuleWeight) and tensor.module_name == f"model.layers.{i}.weight"
        )  # its own weight, still lazy
        assert graph.node(f"/layers.{i}/Transpose").inputs[0] is graph.initializers[f"model.layers.{i}.weight"]
        assert (
            graph.node(f"/cache.1/Mul.layer{i}").inputs[0] is graph.inputs[2 + i]
        )  # the cache update went with its layer
    assert len([n for n in graph if n.name == "/rotary/Unsqueeze"]) == 1  # what every layer reads is shared
    got = run(model, feeds())
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_template_whose_layers_exchange_two_values_is_refused() -> None:
    model = traced(WeightSource(Deep()), 2, two_values=True)
    message = "layer 1 of the template reads 2 and hands on 1 values; stamping needs one hidden state each"
    with pytest.raises(ExportError, match="^" + re.escape(f"export: {message}") + "$"):
        StampLayers(PLAN).check(model)
    with pytest.raises(
        ExportError, match="^" + re.escape(f"export: pass StampLayers on the model graph: {message}") + "$"
    ):
        run_passes(model, [StampLayers(PLAN)], graph="model")


def test_a_whole_model_is_not_stamped() -> None:
    model = traced(WeightSource(Deep()), LAYERS)
    whole = StampPlan("layers.{}", LAYERS, tuple(range(LAYERS)))
    assert not whole.stamps and not StampLayers(whole)(model).modified
    assert len(list(model.graph)) == len(list(traced(WeightSource(Deep()), LAYERS).graph))


@pytest.mark.parametrize(
    ("signatures", "traced_layers", "templates"),
    [
        (("a",) * 4, 2, (0, 1, 1, 1)),
        (("a", "b", "a", "b", "a"), 3, (0, 1, 2, 1, 2)),  # alternating layers: both after the first
        (("a", "a", "b", "a"), 3, (0, 1, 2, 1)),
        (("a", "b", "c"), 3, (0, 1, 2)),  # no two alike: traced whole
    ],
)
def test_stamp_plan_of_takes_the_shortest_template(
    signatures: tuple[str, ...], traced_layers: int, templates: tuple[int, ...]
) -> None:
    plan = StampPlan.of(LayerPlan("layers.{}", signatures, lambda n: nn.Module()))
    assert (plan.prefix, plan.traced, plan.templates) == ("layers.{}", traced_layers, templates)
    assert plan.stamps == (traced_layers < len(signatures))
