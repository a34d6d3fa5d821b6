"""Pass: each mixture-of-experts block -> one com.microsoft ``MoE`` node (ONNX Runtime's fused
expert kernel), where it computes the same thing.

The portable graph of a Hugging Face MoE block (transformers' default expert kernel, translated
by ``plugins/hf/moe.py``) is, per layer::

    logits  = router(x)                                 [T, E]   x: the block's tokens [T, H]
    w, ids  = TopK(Softmax(logits), k)                  [T, k]   (w / ReduceSum(w) when renormalised)
    up      = Concat_e(MatMul(rows_e(x), gate_up[e]))   the rows routed to expert e, in expert order
    h       = silu(up[:, :I]) * up[:, I:]               (Split in two, Sigmoid, Mul, Mul)
    down    = Concat_e(MatMul(rows_e(h), down[e]))
    out     = ReduceSum(Reshape(unsort(down * w)), axis 1)   [T, H]

``MoE`` computes exactly that from ``x`` and ``logits``: softmax over all experts, top-k,
optionally renormalised over the k (``normalize_routing_weights``), each token through its k
experts, summed with those weights. Measured on ONNX Runtime 1.32's CPU kernel (not taken from
its docs): it runs only ``activation_type="swiglu"`` with ``swiglu_fusion=1``, fc1's rows
interleaved (row 2i the gate's row i, row 2i+1 the up projection's), computing
``gate * sigmoid(alpha * gate) * (up + beta)``, so ``alpha=1, beta=0`` and no ``swiglu_limit``
(none given: no clamp) is SwiGLU with silu; fc1 ``[E, 2I, H]`` and fc2 ``[E, H, I]`` are
transformers' own layouts (fc1 rewritten interleaved into ``weights.ort.bin``; fc2 is the
portable graph's own tensor). Both routing forms fit: Mixtral and Qwen3-MoE with
``norm_topk_prob`` renormalise (``normalize_routing_weights=1``), Qwen3-MoE without it does not
(``0``).

Matched structurally, from the per-expert MatMuls (``Concat`` of ``MatMul(rows, Gather(W, e))``
for e = 0..E-1) out to the router and the weighted sum, so every part the op replaces is checked
to be what it stands for; a block that does not match keeps its portable form (still exact) and
its reason is returned (the manifest's ``moe_not_fused``). Not matched: gpt-oss (its router takes
the top-k of the logits before a softmax over them, and its gate is a clamped SwiGLU with biases
on interleaved columns), experts without a gate, and anything else whose pieces differ.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import onnx_ir as ir

from kiln.exporter.passes.ir_utils import MS_DOMAIN, constant, copy_type, producer, scalar_of, skip_casts, use_ms_domain

__all__ = ["PROMPT_GRAPH", "MoeBlock", "MoeRewrite", "find_moe", "fuse_moe"]

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class MoeRewrite:
    """What ``fuse_moe`` did to one graph."""

    layers: tuple[int, ...]  # the layers whose experts became one MoE node
    not_fused: tuple[str, ...]  # "layer i: why" for each MoE block left portable


@dataclasses.dataclass
class MoeBlock:
    """One layer's experts as found in the traced graph."""

    layer: int
    tokens: ir.Value  # [T, H], what the router and the experts read
    logits: ir.Value  # [T, E], the router's output
    k: int
    normalize: bool
    gate_up: ir.Value  # [E, 2I, H] initializer (gate rows first, then up), or [E, H, 2I] when transposed
    gate_up_transposed: bool
    down: ir.Value  # [E, H, I] initializer, or [E, I, H] when transposed
    down_transposed: bool
    out: ir.Value  # [T, H], the weighted sum of the experts' outputs


@dataclasses.dataclass
class _Experts:
    concat: ir.Node
    weight: ir.Value  # the [E, ., .] initializer
    transposed: bool  # False: weight is [E, N, K] (MatMul reads its Transpose), True: [E, K, N]
    rows: ir.Value  # what the first expert's rows are sliced from


class _NoMatch(Exception):
    pass


def _int(value: ir.Value | None) -> int | None:
    got = scalar_of(value)
    return int(got) if got is not None and float(got).is_integer() else None


def _experts(concat: ir.Node) -> _Experts | None:
    """``Concat(MatMul(Slice(rows, ..), Gather(W, e, axis=0)) for e in 0..E-1, axis=0)`` -> its
    parts, W a 3-D float initializer (or ``Transpose(W, [0, 2, 1])`` of one)."""
    if (
        concat.op_type != "Concat"
        or concat.domain != ""
        or concat.attributes.get_int("axis", 0) != 0
        or len(concat.inputs) < 2
    ):
        return None
    weight: ir.Value | None = None
    rows: ir.Value | None = None
    transposed = True
    for e, value in enumerate(concat.inputs):
        matmul = producer(value, "MatMul")
        gather = producer(matmul.inputs[1], "Gather") if matmul is not None else None
        part = producer(matmul.inputs[0], "Slice") if matmul is not None else None
        if gather is None or part is None or gather.attributes.get_int("axis", 0) != 0 or _int(gather.inputs[1]) != e:
            return None
        source = gather.inputs[0]
        if weight is None:
            weight = source
        elif source is not weight:
            return None
        if rows is None:
            rows = part.inputs[0]
        elif part.inputs[0] is not rows:
            return None
    transpose = producer(weight, "Transpose")
    if transpose is not None and list(transpose.attributes.get_ints("perm", [])) == [0, 2, 1]:
        weight, transposed = transpose.inputs[0], False
    tensor = weight.const_value if weight is not None else None
    if (
        weight is None
        or rows is None
        or tensor is None
        or len(tensor.shape) != 3
        or tensor.dtype != ir.DataType.FLOAT
        or tensor.shape[0] != len(concat.inputs)
    ):
        return None
    return _Experts(concat, weight, transposed, rows)


def _uses(value: ir.Value) -> list[ir.Node]:
    return [use.node for use in value.uses()]


def _one_use(value: ir.Value) -> ir.Node | None:
    nodes = _uses(value)
    return nodes[0] if len(nodes) == 1 and not value.is_graph_output() else None


def _silu_gated(up: ir.Value) -> ir.Value:
    """``Split(up, 2, axis=-1) -> silu(first) * second`` -> the product; else _NoMatch."""
    split = _one_use(up)
    if (
        split is None
        or split.op_type != "Split"
        or len(split.outputs) != 2
        or split.attributes.get_int("axis", 0) not in (1, -1)
    ):
        readers = ", ".join(sorted({n.op_type for n in _uses(up)})) or "nothing"
        raise _NoMatch(
            f"the experts' first projection is not split in two halves (gate, up): its output is read by {readers}"
        )
    if len(split.inputs) > 1 and split.inputs[1] is not None:
        sizes = split.inputs[1].const_value
        if sizes is None or len(set(sizes.numpy().tolist())) != 1:
            raise _NoMatch("the gate/up split is not in two equal halves")
    gate, linear = split.outputs
    for node in _uses(gate):
        if node.op_type != "Mul" or node.domain != "":
            continue
        other = node.inputs[1] if node.inputs[0] is gate else node.inputs[0]
        sigmoid = producer(other, "Sigmoid")
        if sigmoid is None or sigmoid.inputs[0] is not gate:
            continue
        product = _one_use(node.outputs[0])
        if (
            product is not None
            and product.op_type == "Mul"
            and product.domain == ""
            and linear in product.inputs
            and node.outputs[0] in product.inputs
        ):
            return product.outputs[0]
    raise _NoMatch("the gate/up activation is not silu(gate) * up")


def _weighted_sum(down: ir.Value) -> tuple[ir.Value, ir.Value]:
    """From the second projection's output along its only readers: ``Mul(down, weights)`` ...
    ``ReduceSum`` (over the k experts of each token) -> (the weights' value, the sum)."""
    weights: ir.Value | None = None
    value = down
    for _ in range(8):
        node = _one_use(value)
        if node is None or node.domain != "":
            break
        if node.op_type == "Mul" and weights is None:
            weights = node.inputs[1] if node.inputs[0] is value else node.inputs[0]
        elif node.op_type == "ReduceSum":
            axes = node.inputs[1].const_value if len(node.inputs) > 1 and node.inputs[1] is not None else None
            if (
                weights is None
                or axes is None
                or axes.numpy().reshape(-1).tolist() != [1]
                or node.attributes.get_int("keepdims", 1) != 0
            ):
                break
            return weights, node.outputs[0]
        elif node.op_type not in ("Transpose", "GatherND", "Gather", "Reshape", "Cast"):
            break
        value = node.outputs[0]
    raise _NoMatch("the experts' outputs are not summed per token with the routing weights")


def _back(value: ir.Value | None, ops: tuple[str, ...], depth: int = 8) -> list[ir.Value]:
    """``value`` and what it is computed from through ``ops`` (first inputs only)."""
    chain: list[ir.Value] = []
    while value is not None and len(chain) < depth:
        chain.append(value)
        node = producer(value, ops)
        value = node.inputs[0] if node is not None else None
    return chain


def _router(weights: ir.Value) -> tuple[ir.Value, ir.Value, int, bool]:
    """The routing weights back to ``TopK(Softmax(logits))`` -> (logits, the router's input, k,
    renormalised)."""
    for value in _back(weights, ("Unsqueeze", "Transpose", "GatherND", "Gather", "Reshape", "Cast")):
        value = skip_casts(value)
        normalize = False
        div = producer(value, "Div")
        if div is not None:
            total = producer(div.inputs[1], "ReduceSum")
            if total is None or total.inputs[0] is not div.inputs[0] or total.attributes.get_int("keepdims", 1) != 1:
                continue
            value, normalize = div.inputs[0], True  # type: ignore[assignment]  # Div's input is set
        topk = producer(value, "TopK")
        if topk is None or value is not topk.outputs[0]:
            continue
        k = _int(topk.inputs[1])
        if (
            k is None
            or topk.attributes.get_int("largest", 1) != 1
            or topk.attributes.get_int("axis", -1) not in (-1, 1)
            or topk.inputs[0] is None
        ):
            raise _NoMatch("the routing TopK is not the k largest over the experts")
        softmax = producer(skip_casts(topk.inputs[0]), "Softmax")
        if softmax is None or softmax.attributes.get_int("axis", -1) not in (-1, 1) or softmax.inputs[0] is None:
            raise _NoMatch("the router does not take the top-k of a softmax over all experts")
        logits = skip_casts(softmax.inputs[0])
        router = producer(logits, ("MatMul", "Gemm"))
        if router is None or router.inputs[0] is None:
            raise _NoMatch("the router logits are not a projection of the block's tokens")
        return logits, router.inputs[0], k, normalize
    raise _NoMatch("the routing weights do not come from a TopK of the router")


def _after(value: ir.Value, sources: set[int], depth: int = 16) -> bool:
    """Whether ``value`` is computed from one of ``sources`` (value ids) within ``depth`` nodes,
    not through a ``ReduceSum`` (the sum that ends a block: no earlier block's experts count)."""
    frontier, seen = [value], {id(value)}
    for _ in range(depth + 1):
        if any(id(v) in sources for v in frontier):
            return True
        nxt = []
        for v in frontier:
            node = v.producer()
            for x in node.inputs if node is not None and node.op_type != "ReduceSum" else ():
                if x is not None and id(x) not in seen:
                    seen.add(id(x))
                    nxt.append(x)
        frontier = nxt
    return False


def _block(up: _Experts, experts: dict[int, _Experts]) -> MoeBlock:
    hidden = _silu_gated(up.concat.outputs[0])
    down = next((d for d in experts.values() if d.rows is hidden), None)
    if down is None:
        raise _NoMatch("the gated activation does not feed a second per-expert projection")
    weights, out = _weighted_sum(down.concat.outputs[0])
    logits, tokens, k, normalize = _router(weights)
    if not set(map(id, _back(tokens, ("Reshape",)))) & set(
        map(id, _back(up.rows, ("Reshape", "Transpose", "GatherND", "Gather")))
    ):
        raise _NoMatch("the experts do not read the router's tokens")
    gate_up, down_w = up.weight.const_value, down.weight.const_value
    assert gate_up is not None and down_w is not None  # _experts checked them
    up_shape, down_shape = gate_up.shape.numpy(), down_w.shape.numpy()  # constants: static dims
    n_experts = up_shape[0]
    inner = up_shape[2 if up.transposed else 1]
    hidden_size = up_shape[1 if up.transposed else 2]
    if down_shape[0] != n_experts or inner % 2 or not 0 < k <= n_experts:
        raise _NoMatch("the experts' weight shapes do not agree")
    expect_down = (n_experts, inner // 2, hidden_size) if down.transposed else (n_experts, hidden_size, inner // 2)
    if tuple(down_shape) != expect_down:
        raise _NoMatch("the experts' weight shapes do not agree")
    match = _LAYER.search(up.weight.name or "")
    return MoeBlock(
        layer=int(match.group(1)) if match else -1,
        tokens=tokens,
        logits=logits,
        k=k,
        normalize=normalize,
        gate_up=up.weight,
        gate_up_transposed=up.transposed,
        down=down.weight,
        down_transposed=down.transposed,
        out=out,
    )


def find_moe(model: ir.Model) -> tuple[list[MoeBlock], list[str]]:
    """Every MoE block of the graph that ``MoE`` computes exactly, and "layer i: why" for the
    others (blocks are found by their first per-expert projection)."""
    experts = {id(node): found for node in model.graph if (found := _experts(node)) is not None}
    outputs = {id(e.concat.outputs[0]) for e in experts.values()}
    blocks: list[MoeBlock] = []
    refused: list[str] = []
    for first in experts.values():
        if _after(first.rows, outputs):
            continue  # a second projection: its rows are computed from another one's output
        try:
            blocks.append(_block(first, experts))
        except _NoMatch as why:
            match = _LAYER.search(first.weight.name or "")
            refused.append(f"layer {match.group(1) if match else '?'}: {why}")
    return sorted(blocks, key=lambda b: b.layer), refused


def _interleaved(gate_up: np.ndarray) -> np.ndarray:
    """[E, 2I, H] with the gate's rows first -> rows 2i the gate's, 2i+1 the up projection's."""
    inner = gate_up.shape[1] // 2
    out = np.empty_like(gate_up)
    out[:, 0::2], out[:, 1::2] = gate_up[:, :inner], gate_up[:, inner:]
    return out


PROMPT_GRAPH = (
    "kept as per-expert MatMuls: this graph runs prompts, where ONNX Runtime 1.32's CPU MoE kernel is slower "
    "than the per-expert MatMuls (docs/benchmarks.md, MoE)"
)


def fuse_moe(model: ir.Model, *, prompts: bool = False) -> MoeRewrite:
    """Replace every matched MoE block by one ``MoE`` node; the portable nodes it replaces are
    left dead (the target's passes remove them). ``prompts`` (prefill, model.onnx): replace none,
    each matched block reported as ``PROMPT_GRAPH``: measured, the CPU kernel is faster than the
    per-expert MatMuls for one token per row and slower for a prompt (its experts run one GEMM
    each on one thread, after copying their rows twice)."""
    graph = model.graph
    blocks, refused = find_moe(model)
    if prompts:
        kept = [f"layer {b.layer}: {PROMPT_GRAPH}" for b in blocks]
        refused = sorted(
            [*refused, *kept], key=lambda why: int(m.group(1)) if (m := re.match(r"layer (\d+):", why)) else -1
        )
        blocks = []
    nodes: list[ir.Node] = []
    for block in blocks:
        prefix = f"ort/layers.{block.layer}.moe"
        gate_up = block.gate_up.const_value
        down = block.down.const_value
        assert gate_up is not None and down is not None
        up_array = gate_up.numpy()
        fc1 = constant(
            graph,
            f"{prefix}.fc1.weight",
            _interleaved(up_array.transpose(0, 2, 1) if block.gate_up_transposed else up_array),
        )
        fc2 = (
            constant(graph, f"{prefix}.fc2.weight", down.numpy().transpose(0, 2, 1))
            if block.down_transposed
            else block.down
        )
        node = ir.node(
            "MoE",
            [block.tokens, block.logits, fc1, None, fc2],
            {
                "k": block.k,
                "activation_type": "swiglu",
                "swiglu_fusion": 1,
                "activation_alpha": 1.0,
                "activation_beta": 0.0,
                "normalize_routing_weights": int(block.normalize),
            },
            domain=MS_DOMAIN,
            name=f"/layers.{block.layer}.mlp/ort/MoE",
        )
        copy_type(node.outputs[0], block.out)
        block.out.replace_all_uses_with(node.outputs[0])
        nodes.append(node)
    if nodes:
        graph.extend(nodes)  # the caller sorts the graph once its passes are done
        use_ms_domain(model)
    return MoeRewrite(layers=tuple(b.layer for b in blocks), not_fused=tuple(refused))
