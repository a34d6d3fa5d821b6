"""The specialisation passes (``passes.specialise``) on a small unified graph built here, run
with ONNX Runtime before and after: prefill (no past inputs, the past's shapes folded), decode
(seq fixed at 1), ``--logits last``, each ending in the contract's I/O (``ApplyContract``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir
import pytest

from kiln.errors import ExportError
from kiln.exporter.contract.io import GraphKind, graph_io
from kiln.exporter.passes import ApplyContract, run_passes
from kiln.exporter.passes.fold import FoldConstants
from kiln.exporter.passes.specialise import LastLogits, SpecialiseDecode, SpecialisePrefill, specialise
from kiln.plugins.native import spec_of
from kiln_testing import exact, tiny_config
from kiln_testing import run_graph as run

SPEC = spec_of(tiny_config())  # vocab 101, 2 layers, 2 kv heads of 8
FLOAT, INT64 = ir.DataType.FLOAT, ir.DataType.INT64
D = 16  # hidden size of the graph below
TOTAL = "past_seq + seq"  # how the trace names the total length


class Builder:
    """Nodes appended in order, initializers from arrays."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[ir.Node] = []
        self.inits: list[ir.Value] = []

    def const(self, name: str, array: np.ndarray) -> ir.Value:
        value = ir.val(name, const_value=ir.tensor(array, name=name))
        self.inits.append(value)
        return value

    def table(self, name: str, shape: tuple[int, ...]) -> ir.Value:
        return self.const(name, self.rng.standard_normal(shape).astype(np.float32))

    def op(
        self, op: str, inputs: list[ir.Value], attributes: dict[str, object] | None = None, name: str | None = None
    ) -> ir.Value:
        node = ir.node(op, inputs, attributes, name=name or f"/{op}_{len(self.nodes)}")
        self.nodes.append(node)
        return node.outputs[0]


def typed(value: ir.Value, name: str, dims: list[int | str]) -> ir.Value:
    value.name, value.dtype, value.shape = name, FLOAT, ir.Shape(dims)
    return value


def unified(*, head: bool = True, reads_past: bool = False, heads: int | str = SPEC.n_kv_heads) -> ir.Model:
    """A unified graph as the trace writes one: logits = (Gather(E, ids) * new-token mask) @ H * 0.5,
    the mask's new columns sliced at [past_len, past_len + seq) with past_len read from the past's
    shape (a ``Shape(start=2, end=3)`` and a full ``Shape`` then ``Gather``); each present is
    ``Concat(past, new)``. ``head=False``: logits are rows of a table (no LM head MatMul);
    ``reads_past``: the hidden state adds the sum of past_key_values.0.key (nothing folds that
    away at prefill)."""
    b = Builder(0)
    kv, hd = SPEC.n_kv_heads, SPEC.head_dim
    ids, pos = ir.val("input_ids", INT64, ["batch", "seq"]), ir.val("position_ids", INT64, ["batch", "seq"])
    mask = ir.val("attention_mask", INT64, ["batch", TOTAL])
    pasts = [
        ir.val(f"past_key_values.{i}.{p}", FLOAT, ["batch", heads, "past_seq", hd])
        for i in range(SPEC.n_layers)
        for p in ("key", "value")
    ]
    past_len = b.op("Shape", [pasts[0]], {"start": 2, "end": 3}, name="/past_len/Shape")
    full = b.op("Shape", [pasts[1]], name="/past_shape/Shape")
    past_len2 = b.op("Gather", [full, b.const("two", np.array([2], np.int64))])
    total = b.op("Add", [past_len2, b.op("Shape", [ids], {"start": 1, "end": 2}, name="/seq_len/Shape")])
    new_mask = b.op("Slice", [mask, past_len, total, b.const("axis1", np.array([1], np.int64))])
    gate = b.op("Unsqueeze", [b.op("Cast", [new_mask], {"to": FLOAT}), b.const("last", np.array([-1], np.int64))])
    hidden = b.op("Mul", [b.op("Gather", [b.table("emb", (SPEC.vocab_size, D)), ids]), gate])
    if reads_past:
        hidden = b.op("Add", [hidden, b.op("ReduceSum", [pasts[0]], {"keepdims": 0}, name="/reads_past/ReduceSum")])
    if head:
        logits = b.op(
            "Mul",
            [
                b.op("MatMul", [hidden, b.table("head", (D, SPEC.vocab_size))], name="/lm_head/MatMul"),
                b.const("half", np.array(0.5, np.float32)),
            ],
        )
    else:
        logits = b.op("Mul", [b.op("Gather", [b.table("rows", (SPEC.vocab_size, SPEC.vocab_size)), ids]), gate])
    outputs = [typed(logits, "logits", ["batch", "seq", SPEC.vocab_size])]
    shape = b.const("kv_shape", np.array([0, 0, kv, hd], np.int64))
    for past in pasts:
        new = b.op(
            "Transpose",
            [b.op("Reshape", [b.op("Gather", [b.table(f"kv.{past.name}", (SPEC.vocab_size, kv * hd)), ids]), shape])],
            {"perm": [0, 2, 1, 3]},
        )
        present = b.op("Concat", [past, new], {"axis": 2})
        outputs.append(
            typed(present, (past.name or "").replace("past_key_values", "present"), ["batch", heads, TOTAL, hd])
        )
    graph = ir.Graph(
        [ids, mask, pos, *pasts],
        outputs,
        nodes=b.nodes,
        initializers=b.inits,
        opset_imports={"": 19},
        name="main_graph",
    )
    return ir.Model(graph, ir_version=10)


def feeds(*, batch: int = 2, seq: int = 3, past: int = 0, pasts: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    mask = np.ones((batch, past + seq), np.int64)
    mask[0, -1] = 0  # a masked new token: the mask's new columns reach the logits
    out = {
        "input_ids": rng.integers(0, SPEC.vocab_size, (batch, seq)).astype(np.int64),
        "attention_mask": mask,
        "position_ids": np.tile(np.arange(past, past + seq, dtype=np.int64), (batch, 1)),
    }
    if pasts:
        shape = (batch, SPEC.n_kv_heads, past, SPEC.head_dim)
        out |= {
            f"past_key_values.{i}.{p}": rng.standard_normal(shape).astype(np.float32)
            for i in range(SPEC.n_layers)
            for p in ("key", "value")
        }
    return out


def contract(kind: GraphKind, last: bool = False) -> list[ir.passes.PassBase]:
    return [*specialise(kind, last), ApplyContract(graph_io(SPEC, kind, last_logits_only=last), kind)]


def readers(model: ir.Model, which: Callable[[str], bool]) -> list[str]:
    """The op types of the nodes that read a graph input whose name ``which`` accepts."""
    return [use.node.op_type for v in model.graph.inputs if which(v.name or "") for use in v.uses()]


def dims(model: ir.Model, name: str) -> list[int | str | None]:
    value = next(v for v in [*model.graph.inputs, *model.graph.outputs] if v.name == name)
    assert value.shape is not None
    return [d if isinstance(d, int) else d.value for d in value.shape]


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_prefill_has_no_past_and_computes_the_unified_graph_with_an_empty_past() -> None:
    model = unified()
    want = run(model, feeds(past=0))
    passes = contract(GraphKind.PREFILL)
    assert [type(p) for p in passes] == [SpecialisePrefill, ApplyContract]
    run_passes(model, passes[:1], graph="prefill")
    assert dims(model, "attention_mask") == ["batch", "seq"] and dims(model, "present.1.value") == [
        "batch",
        2,
        "seq",
        8,
    ]
    run_passes(model, passes[1:], graph="prefill")
    io = graph_io(SPEC, GraphKind.PREFILL)
    assert (
        [v.name for v in model.graph.inputs]
        == [s.name for s in io.inputs]
        == ["input_ids", "attention_mask", "position_ids"]
    )
    assert [v.name for v in model.graph.outputs] == [s.name for s in io.outputs]
    assert [list(v.shape or []) for v in model.graph.outputs][1] == ["batch", SPEC.n_kv_heads, "seq", SPEC.head_dim]
    made = [v.producer() for v in model.graph.outputs[1:]]
    assert [n.op_type if n is not None else None for n in made] == [
        "Transpose"
    ] * 4  # each present is its new part: the empty past dropped
    assert_same(run(model, feeds(past=0, pasts=False)), want)


def test_decode_fixes_seq_at_one_and_computes_the_unified_graph() -> None:
    model = unified()
    want = run(model, feeds(seq=1, past=4))
    passes = contract(GraphKind.DECODE)
    assert [type(p) for p in passes] == [SpecialiseDecode, ApplyContract]
    run_passes(model, passes[:1], graph="decode")
    assert dims(model, "attention_mask") == ["batch", "past_seq + 1"] and dims(model, "present.1.value") == [
        "batch",
        2,
        "past_seq + 1",
        8,
    ]
    run_passes(model, passes[1:], graph="decode")
    io = graph_io(SPEC, GraphKind.DECODE)
    assert [v.name for v in model.graph.inputs] == [s.name for s in io.inputs]
    assert list(model.graph.inputs[0].shape or []) == ["batch", 1]
    assert list(model.graph.outputs[0].shape or []) == ["batch", 1, SPEC.vocab_size]
    assert readers(model, lambda name: name == "input_ids") == ["Gather"] * 5  # its Shape folded: seq is 1
    assert_same(run(model, feeds(seq=1, past=4)), want)


def test_unified_needs_no_specialisation() -> None:
    assert specialise(GraphKind.UNIFIED, False) == []


def test_prefill_with_last_logits_computes_the_head_on_the_last_position_only() -> None:
    model = unified()
    want = run(model, feeds(past=0))
    passes = contract(GraphKind.PREFILL, last=True)
    assert [type(p) for p in passes] == [SpecialisePrefill, LastLogits, FoldConstants, ApplyContract]
    run_passes(model, passes, graph="prefill")
    head = model.graph.node("/lm_head/MatMul")
    sliced = head.inputs[0].producer() if head.inputs[0] is not None else None
    assert sliced is not None and sliced.op_type == "Slice"
    assert list(model.graph.outputs[0].shape or []) == ["batch", 1, SPEC.vocab_size]
    got = run(model, feeds(past=0, pasts=False))
    assert_same(got, {**want, "logits": want["logits"][:, -1:, :]})


def test_last_logits_without_a_head_matmul_is_refused() -> None:
    message = (
        "export: pass LastLogits on the prefill graph: --logits last: no LM head MatMul found behind the logits "
        "through position-wise ops"
    )
    with pytest.raises(ExportError, match=exact(message)):
        run_passes(unified(head=False), contract(GraphKind.PREFILL, last=True), graph="prefill")


def test_prefill_refuses_a_graph_that_still_reads_the_past() -> None:
    message = (
        "the past is empty at prefill but /reads_past/ReduceSum still reads past_key_values.0.key; this model cannot "
        "be specialised"
    )
    with pytest.raises(ExportError, match=exact(f"export: pass SpecialisePrefill on the prefill graph: {message}")):
        run_passes(unified(reads_past=True), contract(GraphKind.PREFILL), graph="prefill")


def test_prefill_refuses_a_past_without_static_heads() -> None:
    message = "past_key_values.0.key has shape [batch,heads,past_seq,8]; the contract fixes its heads and head_dim"
    with pytest.raises(ExportError, match=exact(f"export: pass SpecialisePrefill on the prefill graph: {message}")):
        run_passes(unified(heads="heads"), contract(GraphKind.PREFILL), graph="prefill")
