"""The ORT target's attention rules (``attention``/``gqa``: the core -> GroupQueryAttention,
``rotary``: -> RotaryEmbedding, ``gqa_rotary``: GQA's own rotary at decode) on one layer built in
the form kiln's traces take (q/k/v MatMuls, Reshape + Transpose to heads, the rotary's rotate-half
by Split or Slices, the presents as graph outputs, repeat_kv by Unsqueeze/Expand/Reshape, a
Where- or Add-mask), each fused and run with ONNX Runtime before and after; and near misses,
whose reason is asserted."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from kiln.exporter.patterns.rotary_tables import graph_tables
from kiln.exporter.patterns.rules import NotFused
from kiln.exporter.targets.ort.gqa import fuse_attention

B, N, KV, S, P = 2, 4, 2, 3, 5  # batch, query heads, kv heads, new tokens (prefill), past (decode)
F32 = TensorProto.FLOAT
MIN = float(np.finfo(np.float32).min)


class Layer:
    """One attention layer, node by node (names as kiln's tracer writes them)."""

    def __init__(self, hd: int, past: int, seq: int) -> None:
        self.hd, self.past, self.seq, self.total = hd, past, seq, past + seq
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, np.ndarray] = {}
        self.rng = np.random.default_rng(0)

    def const(self, name: str, array: np.ndarray) -> str:
        self.inits[name] = array
        return name

    def op(self, op: str, inputs: list[str], out: str, **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, inputs, [out], name=f"/layers.0.attn/{op}_{len(self.nodes)}", **attrs))
        return out

    def heads(self, which: str, heads: int, norm: bool) -> str:
        w = self.const(f"w{which}", (0.3 * self.rng.standard_normal((N * 8, heads * self.hd))).astype(np.float32))
        lin = self.op("MatMul", ["x", w], f"{which}_lin")
        view = self.op(
            "Reshape", [lin, self.const(f"{which}_shape", np.array([0, 0, heads, self.hd], np.int64))], f"{which}_view"
        )
        if norm:  # a per-head op between the projection and the heads (a q/k norm's weight)
            view = self.op(
                "Mul",
                [view, self.const(f"{which}_norm", np.linspace(0.5, 1.5, self.hd, dtype=np.float32))],
                f"{which}_normed",
            )
        return self.op("Transpose", [view], f"{which}_heads", perm=[0, 2, 1, 3])

    def cos_sin(self, width: int) -> tuple[str, str]:
        pos = self.op("Cast", ["position_ids"], "pos", to=F32)
        pos = self.op("Unsqueeze", [pos, self.const("ax2", np.array([2], np.int64))], "pos3")
        inv = self.const("inv_freq", (10000.0 ** (-np.arange(0, width, 2) / width)).astype(np.float32))
        freqs = self.op("Mul", [pos, inv], "freqs")
        emb = self.op("Concat", [freqs, freqs], "emb", axis=-1)
        ax1 = self.const("ax1", np.array([1], np.int64))
        return self.op("Unsqueeze", [self.op("Cos", [emb], "cos0"), ax1], "cos"), self.op(
            "Unsqueeze", [self.op("Sin", [emb], "sin0"), ax1], "sin"
        )

    def rotate(self, x: str, cos: str, sin: str, width: int, halves: str, tag: str, other: str | None = None) -> str:
        """x*cos + rotate_half(x)*sin; ``other``: take the halves from another tensor (a near miss)."""
        src = other or x
        if halves == "split":
            first, second = f"{tag}_x1", f"{tag}_x2"
            self.nodes.append(
                helper.make_node(
                    "Split", [src], [first, second], axis=3, num_outputs=2, name=f"/layers.0.attn/Split_{tag}"
                )
            )
        else:
            bounds = {"a": (0, width // 2), "b": (width // 2, 2**62)}
            first, second = (
                self.op(
                    "Slice",
                    [
                        src,
                        self.const(f"{tag}{k}0", np.array([lo], np.int64)),
                        self.const(f"{tag}{k}1", np.array([hi], np.int64)),
                        "axis3",
                    ],
                    f"{tag}_x{k}",
                )
                for k, (lo, hi) in bounds.items()
            )
        half = self.op("Concat", [self.op("Neg", [second], f"{tag}_neg"), first], f"{tag}_half", axis=-1)
        return self.op(
            "Add", [self.op("Mul", [x, cos], f"{tag}_xc"), self.op("Mul", [half, sin], f"{tag}_hs")], f"{tag}_rot"
        )

    def rename(self, value: str, name: str) -> str:
        """Prefill: the new keys/values themselves are the presents (graph outputs)."""
        for node in self.nodes:
            node.input[:] = [name if i == value else i for i in node.input]
            node.output[:] = [name if o == value else o for o in node.output]
        return name

    def repeat(self, present: str, which: str) -> str:
        up = self.op("Unsqueeze", [present, self.const("ax2b", np.array([2], np.int64))], f"{which}_up")
        wide = self.op(
            "Expand",
            [up, self.const("expand", np.array([B, KV, N // KV, self.total, self.hd], np.int64))],
            f"{which}_wide",
        )
        return self.op(
            "Reshape", [wide, self.const("rep_shape", np.array([B, N, self.total, self.hd], np.int64))], f"{which}_rep"
        )


def build(
    *,
    hd: int = 8,
    past: int = 0,
    rotary: str = "full",
    halves: str = "split",
    qk_norm: bool = False,
    mask: str = "where",
    scale: str = "mul",
    softcap: tuple[float, float] | None = None,
    probs_read_twice: bool = False,
    halves_from_other: bool = False,
) -> ir.Model:
    seq = 1 if past else S
    g = Layer(hd, past, seq)
    g.const("axis3", np.array([3], np.int64))
    q, k, v = g.heads("q", N, qk_norm), g.heads("k", KV, qk_norm), g.heads("v", KV, False)
    if rotary != "none":
        width = hd if rotary == "full" else hd // 2
        cos, sin = g.cos_sin(width)
        rotated = []
        for x in (q, k):
            other = g.op("Sigmoid", [x], "other") if halves_from_other and x == q else None
            if rotary == "full":
                rotated.append(g.rotate(x, cos, sin, width, halves, x, other))
            else:  # partial: Concat(rotate(x[..., :d]), x[..., d:])
                ends = [g.const(f"{x}_e{i}", np.array([e], np.int64)) for i, e in enumerate((0, width, 2**62))]
                part = g.op("Slice", [x, ends[0], ends[1], "axis3"], f"{x}_part")
                rest = g.op("Slice", [x, ends[1], ends[2], "axis3"], f"{x}_rest")
                rotated.append(
                    g.op("Concat", [g.rotate(part, cos, sin, width, halves, f"{x}p"), rest], f"{x}_prot", axis=-1)
                )
        q, k = rotated
    present_k = (
        g.op("Concat", ["past_key_values.0.key", k], "present.0.key", axis=2) if past else g.rename(k, "present.0.key")
    )
    present_v = (
        g.op("Concat", ["past_key_values.0.value", v], "present.0.value", axis=2)
        if past
        else g.rename(v, "present.0.value")
    )
    kt = g.op("Transpose", [g.repeat(present_k, "k")], "kt", perm=[0, 1, 3, 2])
    scores = g.op("MatMul", [q, kt], "qk")
    c = 1.0 / np.sqrt(hd)
    scores = (
        g.op("Mul", [scores, g.const("scale", np.array(c, np.float32))], "scaled")
        if scale == "mul"
        else g.op("Div", [scores, g.const("scale", np.array(1 / c, np.float32))], "scaled")
    )
    if softcap is not None:
        t = g.op(
            "Tanh", [g.op("Div", [scores, g.const("cap_div", np.array(softcap[0], np.float32))], "cap_in")], "tanh"
        )
        scores = g.op("Mul", [t, g.const("cap", np.array(softcap[1], np.float32))], "capped")
    keys = g.op(
        "Cast",
        [g.op("Unsqueeze", ["attention_mask", g.const("ax12", np.array([1, 2], np.int64))], "mask4")],
        "keys",
        to=TensorProto.BOOL,
    )
    causal = g.const("causal", np.tril(np.ones((seq, g.total), bool), k=past))
    allowed = g.op("And", [keys, causal], "allowed")
    if mask == "where":
        masked = g.op("Where", [allowed, scores, g.const("fill", np.array(MIN, np.float32))], "masked")
    else:
        bias = g.op(
            "Where",
            [allowed, g.const("zero", np.array(0.0, np.float32)), g.const("fill", np.array(MIN, np.float32))],
            "bias",
        )
        masked = g.op("Add", [scores, bias], "masked")
    probs = g.op("Softmax", [masked], "probs", axis=-1)
    heads = g.op("Transpose", [g.op("MatMul", [probs, g.repeat(present_v, "v")], "pv")], "pv_bsnh", perm=[0, 2, 1, 3])
    flat = g.op("Reshape", [heads, g.const("flat", np.array([0, 0, N * hd], np.int64))], "attn")
    g.op("MatMul", [flat, g.const("wo", (0.3 * g.rng.standard_normal((N * hd, N * 8))).astype(np.float32))], "y")
    return _model(g, extra=["probs"] if probs_read_twice else [])


def _model(g: Layer, extra: list[str]) -> ir.Model:
    info = helper.make_tensor_value_info
    inputs = [
        info("x", F32, [B, g.seq, N * 8]),
        info("attention_mask", TensorProto.INT64, [B, g.total]),
        info("position_ids", TensorProto.INT64, [B, g.seq]),
    ]
    if g.past:
        inputs += [info(f"past_key_values.0.{kv}", F32, [B, KV, g.past, g.hd]) for kv in ("key", "value")]
    outputs = [
        info("y", F32, [B, g.seq, N * 8]),
        *(info(f"present.0.{kv}", F32, [B, KV, g.total, g.hd]) for kv in ("key", "value")),
    ]
    outputs += [info(name, F32, None) for name in extra]
    graph = helper.make_graph(
        g.nodes, "layer", inputs, outputs, [numpy_helper.from_array(a, n) for n, a in g.inits.items()]
    )
    proto = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=10), strict_mode=True
    )
    return ir.serde.deserialize_model(proto)


def feeds(model: ir.Model) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    shapes = {v.name: [int(d) for d in v.shape] for v in model.graph.inputs if v.shape is not None}
    mask = np.ones(shapes["attention_mask"], np.int64)
    mask[0, :2] = 0  # left padding
    seq = shapes["position_ids"][1]
    out = {"attention_mask": mask, "position_ids": np.clip(np.cumsum(mask, 1) - 1, 0, None)[:, -seq:]}
    return out | {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items() if n not in out}


def run(model: ir.Model, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        ir.serde.serialize_model(model).SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs), strict=True))


def fuse(
    model: ir.Model, tmp_path: Path, *, hd: int = 8, decode: bool = False, tables: bool = True
) -> tuple[list[int], dict[str, tuple[str, ...]], Counter[str]]:
    """fuse_attention as the target runs it, then dead nodes out and the graph sorted."""
    log = NotFused()
    found = graph_tables(model, tmp_path, 16, hd) if tables else (lambda cos, sin: None)
    layers = fuse_attention(model, n_kv_heads=KV, head_dim=hd, tables=found, decode=decode, not_fused=log)
    RemoveUnusedNodesPass()(model)
    TopologicalSortPass()(model)
    return layers, log.record() or {}, Counter(n.op_type for n in model.graph)


def assert_same(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> None:
    assert before.keys() == after.keys()
    for name, want in before.items():
        np.testing.assert_allclose(after[name], want, rtol=1e-5, atol=1e-5, err_msg=name)


VARIANTS = {
    "native (Split halves, Where mask)": {},
    "Hugging Face (Slice halves, Add mask, Div scale)": {"halves": "slice", "mask": "add", "scale": "div"},
    "q/k norm": {"qk_norm": True, "halves": "slice"},
    "partial rotary": {"rotary": "partial", "halves": "slice"},
    "soft-capping": {"softcap": (50.0, 50.0), "mask": "add"},
    "no rotary (GPT-2, OPT)": {"rotary": "none"},
}


@pytest.mark.parametrize("past", [0, P], ids=["prefill", "decode"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_attention_fuses_and_computes_the_same(variant: str, past: int, tmp_path: Path) -> None:
    kwargs = VARIANTS[variant]
    model = build(past=past, **kwargs)  # type: ignore[arg-type]
    inputs = feeds(model)
    before = run(model, inputs)
    layers, why, ops = fuse(model, tmp_path, decode=bool(past))
    assert layers == [0] and ops["GroupQueryAttention"] == 1 and ops["Softmax"] == 0, ops
    assert ops["RotaryEmbedding"] == (0 if kwargs.get("rotary") == "none" else 2) and ops["Neg"] == 0, ops
    gqa = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    assert gqa.attributes.get_int("causal", 1) == (1 if past else 0)
    assert gqa.attributes.get_float("softcap", 0.0) == (50.0 if "softcap" in kwargs else 0.0)
    dims = {n.attributes.get_int("rotary_embedding_dim", 0) for n in model.graph if n.op_type == "RotaryEmbedding"}
    assert dims <= ({4} if kwargs.get("rotary") == "partial" else {0}), dims
    packed = not kwargs.get("qk_norm")  # per-head ops sit between the projections and GQA
    assert ops["Split"] == int(packed) and ops["MatMul"] == (2 if packed else 4), ops
    assert set(why) <= {"qkv_pack", "gqa_rotary"}, why  # head_dim 8: GQA's own rotary refused at decode
    assert_same(before, run(model, inputs))


def test_decode_rotary_inside_gqa(tmp_path: Path) -> None:
    """head_dim 16 at decode: GQA reads the packed QKV and rotates it itself."""
    model = build(hd=16, past=P)
    inputs = feeds(model)
    before = run(model, inputs)
    layers, why, ops = fuse(model, tmp_path, hd=16, decode=True)
    assert layers == [0] and why == {} and ops["RotaryEmbedding"] == 0 and ops["Split"] == 0 and ops["MatMul"] == 2, (
        why,
        ops,
    )
    gqa = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    assert gqa.attributes.get_int("do_rotary", 0) == 1 and gqa.inputs[1] is None and gqa.inputs[9] is not None
    assert_same(before, run(model, inputs))


def test_gqa_rotary_refused_for_head_dim_8(tmp_path: Path) -> None:
    _, why, ops = fuse(build(past=P), tmp_path, decode=True)
    assert why == {
        "gqa_rotary": ("layer 0: head_dim 8 is not a multiple of 16 (GroupQueryAttention's own rotary needs it)",)
    }
    assert ops["RotaryEmbedding"] == 2


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (
            {"softcap": (30.0, 50.0)},
            "tanh(scores / 30.0) * 50.0: the soft cap divides by another constant than it multiplies by",
        ),
        ({"probs_read_twice": True}, "the attention probabilities are read by more than the value MatMul"),
    ],
    ids=["soft cap mismatch", "probabilities read twice"],
)
def test_attention_near_miss_says_why(kwargs: dict[str, object], reason: str, tmp_path: Path) -> None:
    model = build(**kwargs)  # type: ignore[arg-type]
    inputs = feeds(model)
    before = run(model, inputs)
    layers, why, ops = fuse(model, tmp_path)
    assert layers == [] and ops["GroupQueryAttention"] == 0 and ops["Softmax"] == 1
    assert why == {"attention": (f"layer 0: {reason}",)}
    assert_same(before, run(model, inputs))


@pytest.mark.parametrize(
    ("kwargs", "tables", "reason"),
    [
        (
            {},
            False,
            "its cos/sin tables cannot be evaluated per position (they read more than position_ids, or a row "
            "depends on the call's other positions)",
        ),
        (
            {"halves_from_other": True},
            True,
            "not a rotate-half rotary (rotate_half's halves are not taken from the rotated tensor)",
        ),
    ],
    ids=["tables not per position", "halves of another tensor"],
)
def test_rotary_near_miss_keeps_the_rotary_and_says_why(
    kwargs: dict[str, object], tables: bool, reason: str, tmp_path: Path
) -> None:
    """GQA still fuses, reading the rotated q (and k) flattened; the rotary stays in the graph."""
    model = build(**kwargs)  # type: ignore[arg-type]
    inputs = feeds(model)
    before = run(model, inputs)
    layers, why, ops = fuse(model, tmp_path, tables=tables)
    assert layers == [0] and ops["GroupQueryAttention"] == 1 and ops["Neg"] >= 1
    assert why["rotary"][0] == f"layer 0 q: {reason}"
    assert ops["RotaryEmbedding"] == (1 if kwargs else 0)  # halves of another tensor: only q's rotary is refused
    assert_same(before, run(model, inputs))
