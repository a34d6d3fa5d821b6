"""Pass: every layer's attention core (``patterns.attention``'s pattern) -> an in-place static
cache and ONNX's own ``Attention``, the contract becoming ``contract.static_cache``'s::

    present.i.key   = TensorScatter(past.i.key [B, kv, MAX, hd], k, write_indices, axis=-2, mode=linear)
    present.i.value = TensorScatter(past.i.value, v, write_indices, ...)
    out             = Attention(q, present.i.key, present.i.value, mask, scale)     (4-D, grouped heads native;
                                                                                      prefill: Attention(q, k, v, ...))

in place of ``present = Concat(past, k)`` and the decomposed MatMul/Softmax/MatMul; the mask is
``mask.static_masks``'s, one per window (the family's own mask subgraph is left dead and removed). Each
``TensorScatter`` output is the graph output itself: TensorRT's ``IKVCacheUpdateLayer`` needs the
cache to be a network input of static length and its output a network output (nothing between),
and ONNX Runtime writes in place when one buffer is bound as both.

What the layer must be, or the export stops naming it (its portable graphs are unaffected):
every attention layer's attention found (a hybrid's state-space or convolution layers keep their
recurrent state as plain inputs and outputs: ``states``; a model without attention gets no mask and
no ``write_indices``), and nothing else reading a cache input (a graph that takes a
length from the past's shape would read ``max_context`` now). A soft-capped layer (Gemma 2:
TensorRT's parser refuses ``Attention``'s ``softcap``) keeps the in-place cache and reads it with
``decomposed.decomposed_attention``'s plain ops; ``report`` lists those layers and why.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from kiln.errors import ExportError
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.contract.static_cache import WRITE_INDICES, static_io
from kiln.exporter.passes.reports import Report
from kiln.exporter.patterns.attention import AttentionCore, find_attention
from kiln.exporter.targets.onnx.decomposed import DECOMPOSED_WHY, decomposed_attention
from kiln.exporter.targets.onnx.mask import static_masks
from kiln.plugins.base import DecoderSpec
from kiln.plugins.cache_layout import Span

__all__ = ["StaticCache", "attention_layers"]


class StaticCache(ir.passes.InPlacePass):
    """The rewrite (module docstring) as a pass; ``report`` lists the layers it rewrote, and
    ``ensures`` that the graph's inputs and outputs are the static contract's, in its order."""

    report_name = "attention"

    def __init__(
        self,
        spec: DecoderSpec,
        kind: GraphKind,
        max_context: int,
        *,
        windows: dict[int, int] | None = None,
        kv_dtype: str = "float32",
        last_logits_only: bool = False,
    ) -> None:
        super().__init__()
        self.spec, self.kind, self.max_context = spec, kind, max_context
        self.windows = dict(windows or {})  # layer -> its sliding window (``windows.layer_windows``)
        self.io = static_io(spec, kind, max_context=max_context, kv_dtype=kv_dtype, last_logits_only=last_logits_only)
        self.layers: list[int] = []
        self.decomposed: list[int] = []  # the soft-capped layers, read by decomposed_attention

    @property
    def report(self) -> Report | None:
        if not self.layers:
            return None
        windows = {str(layer): window for layer, window in sorted(self.windows.items())}
        decomposed = {"decomposed": {"layers": list(self.decomposed), "why": DECOMPOSED_WHY}} if self.decomposed else {}
        return {
            "layers": list(self.layers),
            "op": "Attention",
            "cache": "TensorScatter",
            **({"windows": windows} if windows else {}),
            **decomposed,
        }

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        cores = find_attention(
            model, self.spec.head_dim, softmax_island=True
        )  # fp16: the Attention op takes the fp32 softmax island in
        missing = sorted(attention_layers(self.spec) - {c.layer for c in cores})
        if missing:
            raise ExportError(
                f"the attention of layer(s) {missing} is not the pattern --target onnx rewrites (attention core "
                "-> Attention); export without --target onnx"
            )
        graph = model.graph
        writes = self._write_indices(graph) if cores else None
        masks = (
            static_masks(
                graph,
                max_context=self.max_context,
                prefill=self.kind is GraphKind.PREFILL,
                windows={self.windows.get(c.layer) for c in cores},
            )
            if cores
            else {}
        )  # a pure state-space model has no attention: no mask, no write_indices
        for core in cores:
            self._layer(graph, core, writes, masks[self.windows.get(core.layer)])
        RemoveUnusedNodesPass()(model)
        self._check_cache_readers(graph, {c.layer for c in cores})
        self._order_inputs(graph)
        self.layers = [c.layer for c in cores]
        self.decomposed = [c.layer for c in cores if c.softcap is not None]
        return ir.passes.PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        got = ([v.name for v in model.graph.inputs], [v.name for v in model.graph.outputs])
        if got != (self.io.input_names, self.io.output_names):
            raise ExportError(
                f"the static-cache graph's inputs/outputs are {got}, not the contract's "
                f"{(self.io.input_names, self.io.output_names)}"
            )

    def _write_indices(self, graph: ir.Graph) -> ir.Value | None:  # only a graph with keys takes it
        if self.kind is GraphKind.PREFILL:
            return None  # TensorScatter without write_indices writes at slot 0
        value = ir.val(WRITE_INDICES, ir.DataType.INT64, ir.Shape(["batch"]))
        graph.inputs.append(value)
        return value

    def _buffer(self, graph: ir.Graph, past: ir.Value | None, name: str, like: ir.Value) -> ir.Value:
        """The layer's cache input ``name``, ``[batch, kv, max_context, hd]``: the portable past
        input reshaped (decode, model), or a new input (prefill)."""
        shape = ir.Shape(["batch", self.spec.n_kv_heads, self.max_context, self.spec.head_dim])
        if past is None:
            past = ir.val(name, like.dtype, shape)
            graph.inputs.append(past)
        past.shape = shape
        return past

    def _layer(self, graph: ir.Graph, core: AttentionCore, writes: ir.Value | None, mask: ir.Value) -> None:
        prefix = f"/static/layers.{core.layer}"
        caches = []
        for past, new, present, which in (
            (core.past_key, core.k, core.present_key, "key"),
            (core.past_value, core.v, core.present_value, "value"),
        ):
            buffer = self._buffer(graph, past, f"past_key_values.{core.layer}.{which}", new)
            inputs = [buffer, new] + ([writes] if writes is not None else [])
            scatter = _append(
                graph, "TensorScatter", inputs, {"axis": -2, "mode": "linear"}, f"{prefix}/{which}/TensorScatter"
            )
            scatter.type, scatter.shape = buffer.type, buffer.shape
            _take_output(graph, present, scatter)
            caches.append(scatter)
        # prefill's queries see only the prompt's keys: they are read as they are, not from the
        # max_context buffer (4.5x the portable prefill's time on the 33M Llama at seq 128, measured)
        keys = [core.k, core.v] if self.kind is GraphKind.PREFILL else caches
        if core.softcap is None:
            attention = _append(
                graph,
                "Attention",
                [core.q, *keys, mask],
                {"scale": float(core.scale), "is_causal": 0},
                f"{prefix}/Attention",
            )
            attention.type, attention.shape = core.q.type, core.q.shape
        else:
            heads = (core.n_heads, self.spec.n_kv_heads, self.spec.head_dim)
            attention = decomposed_attention(
                graph,
                core.q,
                keys[0],
                keys[1],
                mask,
                scale=float(core.scale),
                softcap=core.softcap,
                heads=heads,
                prefix=f"{prefix}/decomposed",
            )
        reshape = core.out.producer()
        transpose = reshape.inputs[0].producer() if reshape is not None and reshape.inputs[0] is not None else None
        assert transpose is not None, "the attention pattern ends in Reshape(Transpose(pv))"
        transpose.replace_input_with(0, attention)

    def _check_cache_readers(self, graph: ir.Graph, layers: set[int]) -> None:
        buffers = {f"past_key_values.{layer}.{which}" for layer in layers for which in ("key", "value")}
        for value in graph.inputs:
            if value.name in buffers:  # a recurrent state (conv, ssm) is read by the mixer's own ops
                others = [u.node for u in value.uses() if u.node.op_type != "TensorScatter" and not _batch_only(u.node)]
                if others:
                    raise ExportError(
                        f"{value.name} is read by {others[0].op_type} {others[0].name!r} besides its "
                        "TensorScatter: the static cache would give it max_context slots"
                    )

    def _order_inputs(self, graph: ir.Graph) -> None:
        by_name = {v.name or "": v for v in graph.inputs}
        if set(by_name) != set(self.io.input_names):
            raise ExportError(
                f"the static-cache graph has inputs {sorted(by_name)}, the contract {self.io.input_names}"
            )
        graph.inputs.clear()
        graph.inputs.extend(by_name[name] for name in self.io.input_names)


def attention_layers(spec: DecoderSpec) -> set[int]:
    """The layers that carry keys and values (a hybrid's attention layers; every layer of the others)."""
    return {layer for layer, tensor in spec.cache_layout.tensors() if tensor.span is Span.SEQUENCE}


def _batch_only(node: ir.Node) -> bool:
    """A ``Shape`` reading the batch dim alone (the tracer takes the batch size from a past): the
    static buffer has the same batch."""
    return (
        node.op_type == "Shape" and node.attributes.get_int("start", 0) == 0 and node.attributes.get_int("end", 0) == 1
    )


def _append(graph: ir.Graph, op_type: str, inputs: list[Any], attributes: dict[str, Any], name: str) -> ir.Value:
    node = ir.node(op_type, inputs, attributes, name=name)
    graph.append(node)
    return node.outputs[0]


def _take_output(graph: ir.Graph, present: ir.Value, scatter: ir.Value) -> None:
    """``scatter`` becomes the graph output ``present`` was, under its name; ``present`` (prefill:
    the new keys themselves, which the scatter reads) stays an inner value, renamed."""
    index = next(i for i, out in enumerate(graph.outputs) if out is present)
    name = present.name
    present.name = f"{name}.portable"
    graph.outputs[index] = scatter
    scatter.name = name
