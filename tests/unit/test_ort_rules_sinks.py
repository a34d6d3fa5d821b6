"""Attention sinks on ``--target ort`` (``patterns.sinks``, ``gqa``): one attention layer in the form
kiln's traces take (``test_ort_rules``'s builder), its softmax given a learned logit per query head
in transformers' two forms (concatenated to the scores and sliced off, with or without gpt-oss's
row max; a sigmoid gate of the scores' log-sum-exp, Granite-SWA's), fused into GroupQueryAttention
with ``head_sink`` and run by ONNX Runtime before and after; near misses keep the portable
attention and say why, and ``--target onnx``'s finder (its ``Attention`` has no sink) takes none."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from kiln.exporter.patterns.attention import find_attention
from unit.test_ort_rules import KV, MIN, Layer, N, P, S, _model, assert_same, feeds, fuse, run

B = 2
SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)  # one per query head (N = 4), distinct per KV group


def _softmax_with_sinks(g: Layer, masked: str, form: str, seq: int) -> str:
    """The probabilities the value MatMul reads, sinks concatenated after the keys' scores."""
    shape = (1, 1, seq, 1) if form == "per position" else (1, N, 1, 1)
    if form in ("per position", "4-D sinks"):  # a constant already shaped to broadcast (no Reshape of a 1-D tensor)
        values = np.linspace(-1, 1, int(np.prod(shape)), dtype=np.float32) if form == "per position" else SINKS
        view = g.const("sinks", values.reshape(shape))
    else:
        view = g.op("Reshape", [g.const("sinks", SINKS), g.const("sink_shape", np.array(shape, np.int64))], "sink_view")
    wide = g.op("Expand", [view, g.const("sink_expand", np.array([B, N, seq, 1], np.int64))], "sink_wide")
    joined = g.op("Concat", [masked, wide], "joined", axis=-1)
    if form == "shifted":
        top = g.op("ReduceMax", [joined, g.const("last", np.array([-1], np.int64))], "row_max", keepdims=1)
        joined = g.op("Sub", [joined, top], "shifted")
    probs = g.op("Softmax", [joined], "probs", axis=-1)
    bounds = (1, 2**62) if form == "first column off" else (0, -1)
    starts, ends = (g.const(f"slice_{i}", np.array([b], np.int64)) for i, b in enumerate(bounds))
    return g.op(
        "Slice",
        [probs, starts, ends, g.const("slice_axes", np.array([-1], np.int64)), g.const("one", np.array([1], np.int64))],
        "kept",
    )


def build(form: str, past: int = 0) -> ir.Model:
    """A rotary-less layer (q/k/v projections to heads, presents, repeat_kv, Where mask) whose
    softmax carries attention sinks in ``form`` ("none": a plain softmax)."""
    seq = 1 if past else S
    g = Layer(8, past, seq)
    q, k, v = g.heads("q", N, False), g.heads("k", KV, False), g.heads("v", KV, False)
    present_k = (
        g.op("Concat", ["past_key_values.0.key", k], "present.0.key", axis=2) if past else g.rename(k, "present.0.key")
    )
    present_v = (
        g.op("Concat", ["past_key_values.0.value", v], "present.0.value", axis=2)
        if past
        else g.rename(v, "present.0.value")
    )
    scores = g.op("MatMul", [q, g.op("Transpose", [g.repeat(present_k, "k")], "kt", perm=[0, 1, 3, 2])], "qk")
    scores = g.op("Mul", [scores, g.const("scale", np.array(1 / np.sqrt(8), np.float32))], "scaled")
    keys = g.op(
        "Cast",
        [g.op("Unsqueeze", ["attention_mask", g.const("ax12", np.array([1, 2], np.int64))], "mask4")],
        "keys",
        to=9,
    )
    allowed = g.op("And", [keys, g.const("causal", np.tril(np.ones((seq, g.total), bool), k=past))], "allowed")
    masked = g.op("Where", [allowed, scores, g.const("fill", np.array(MIN, np.float32))], "masked")
    values = g.repeat(present_v, "v")
    if form == "gate":
        pv = g.op("MatMul", [g.op("Softmax", [masked], "probs", axis=-1), values], "pv")
        lse = g.op("ReduceLogSumExp", [masked, g.const("last", np.array([-1], np.int64))], "lse", keepdims=0)
        sink = g.op(
            "Reshape", [g.const("sinks", SINKS), g.const("sink_shape", np.array([1, N, 1], np.int64))], "sink_view"
        )
        gate = g.op(
            "Unsqueeze",
            [
                g.op("Sigmoid", [g.op("Sub", [lse, sink], "lse_sink")], "sigmoid"),
                g.const("last", np.array([-1], np.int64)),
            ],
            "gate",
        )
        pv = g.op("Mul", [pv, gate], "gated")
    else:
        probs = (
            g.op("Softmax", [masked], "probs", axis=-1) if form == "none" else _softmax_with_sinks(g, masked, form, seq)
        )
        pv = g.op("MatMul", [probs, values], "pv")
    heads = g.op("Transpose", [pv], "pv_bsnh", perm=[0, 2, 1, 3])
    flat = g.op("Reshape", [heads, g.const("flat", np.array([0, 0, N * 8], np.int64))], "attn")
    g.op("MatMul", [flat, g.const("wo", (0.3 * g.rng.standard_normal((N * 8, N * 8))).astype(np.float32))], "y")
    return _model(g, extra=[])


@pytest.mark.parametrize("past", [0, P], ids=["prefill", "decode"])
@pytest.mark.parametrize(
    "form",
    ["concat", "shifted", "gate", "4-D sinks"],
    ids=["concatenated (Flint)", "row max shift (gpt-oss)", "log-sum-exp gate (Granite-SWA)", "sinks [1, N, 1, 1]"],
)
def test_attention_sinks_fuse_as_head_sink(form: str, past: int, tmp_path: Path) -> None:
    model = build(form, past)
    inputs = feeds(model)
    before = run(model, inputs)
    layers, why, ops = fuse(model, tmp_path, decode=bool(past))
    assert layers == [0] and ops["GroupQueryAttention"] == 1 and ops["Softmax"] == 0 and ops["Concat"] == 0, (why, ops)
    assert ops["ReduceMax"] == ops["ReduceLogSumExp"] == ops["Sigmoid"] == 0 and "kept" not in {
        o.name for n in model.graph for o in n.outputs
    }, ops
    gqa = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    head_sink = gqa.inputs[11] if len(gqa.inputs) > 11 else None
    reshape = head_sink.producer() if head_sink is not None and form == "4-D sinks" else None  # reshaped to [N] for GQA
    source = reshape.inputs[0] if reshape is not None and reshape.op_type == "Reshape" else head_sink
    assert (
        head_sink is not None and head_sink.shape == ir.Shape([N]) and source is not None and source.name == "sinks"
    ), gqa.inputs
    assert source.const_value is not None and np.array_equal(
        source.const_value.numpy().reshape(-1), SINKS
    )  # the family's own tensor, per query head
    assert_same(before, run(model, inputs))


def test_the_sinks_change_the_output(tmp_path: Path) -> None:
    """The sinks matter here (else the tests above could pass with head_sink dropped)."""
    model = build("concat")
    inputs = feeds(model)
    with_sinks = run(model, inputs)["y"]
    fuse(model, tmp_path)
    gqa = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    gqa.resize_inputs(11)  # head_sink removed: plain softmax
    assert np.abs(run(model, inputs)["y"] - with_sinks).max() > 1e-2


@pytest.mark.parametrize(
    ("form", "reason"),
    [
        ("first column off", "the probabilities are sliced otherwise than [..., :-1] (dropping the sink's column)"),
        ("per position", "the attention sinks are shaped [1, 1, 3, 1], not one logit per query head (4)"),
    ],
    ids=["the keys' first column sliced off", "a logit per query position"],
)
def test_a_near_miss_keeps_portable_attention_and_says_why(form: str, reason: str, tmp_path: Path) -> None:
    model = build(form)
    inputs = feeds(model)
    before = run(model, inputs)
    layers, why, ops = fuse(model, tmp_path)
    assert layers == [] and ops["GroupQueryAttention"] == 0 and ops["Softmax"] == 1, ops
    assert why == {"attention": (f"layer 0: {reason}",)}
    assert_same(before, run(model, inputs))


@pytest.mark.parametrize("form", ["concat", "gate"])
def test_the_onnx_targets_finder_takes_no_sinks(form: str) -> None:
    """``--target onnx`` rewrites what ``find_attention`` returns into ONNX's Attention, which has no
    sink input: a layer with sinks is not found (that target then refuses the export, naming it)."""
    assert find_attention(build(form), head_dim=8) == []
    assert [c.layer for c in find_attention(build("none"), head_dim=8)] == [0]  # the same layer without sinks is
