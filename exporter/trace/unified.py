"""The trace stage: the model's unified graph, traced once.

The unified graph (``model.onnx``: seq >= 1, past_seq >= 0) is the only graph traced; prefill and
decode are derived from it by specialisation passes (``passes.specialise``). (A cross-attention
decoder's prefill computes the cross cache from ``encoder_hidden_states``, which the unified
graph takes as an input instead: its prefill is traced too; an encoder-decoder's encoder is a
graph of its own, traced too; a family whose one-token step has a form of its own, a recurrent
mixer's update rather than its scan, has its decode traced too, at a static seq of 1.) When the family
gives a ``LayerPlan``, what is traced is a template: the model with only its first few layers,
built on the meta device (no weights, no memory), and the stamp pass (``passes.stamp``) grows the
graph to the model's depth. Either way the graph's initializers are then bound lazily to the
reference's own tensors (``passes.bind``). So one export costs one trace of about two layers,
whatever the depth, and no weight is copied until it is written.

A template that cannot be traced (a family's code that needs real values at init or in
forward) or stamped (layers that exchange more than their hidden state) falls back to tracing
the whole reference model, with a note saying why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import onnx_ir as ir
from torch import nn

from kiln.errors import ExportError
from kiln.exporter.contract.io import GraphKind, graph_io
from kiln.exporter.fold import Folded
from kiln.exporter.load import Reference
from kiln.exporter.options import ExportOptions
from kiln.exporter.passes import NameNodes, run_passes
from kiln.exporter.passes.bind import BindWeights, WeightSource
from kiln.exporter.passes.fold import FoldConstants
from kiln.exporter.passes.stamp import StampLayers, StampPlan
from kiln.exporter.passes.transposes import FoldWeightTransposes
from kiln.exporter.progress import Progress
from kiln.exporter.trace.cache import as_cached, from_cached, trace_cache
from kiln.exporter.trace.torch_export import PHASES, trace_graph

__all__ = ["Traced", "trace_unified"]


@dataclasses.dataclass(frozen=True)
class Traced:
    """The graphs as traced (the unified one; a cross-attention decoder's prefill too): nodes
    named, weights bound lazily, constants folded."""

    graphs: dict[GraphKind, ir.Model]
    stamp: StampPlan | None  # how they grow to the model's depth (None: they have every layer)

    @property
    def model(self) -> ir.Model:
        return self.graphs[GraphKind.UNIFIED]


def trace_unified(reference: Reference, folded: Folded, options: ExportOptions, progress: Progress) -> Traced:
    """The graphs to trace, as a progress stage counting each graph's exporter phases."""
    kinds = _traced_kinds(reference)
    with progress.stage("trace", total=PHASES * len(kinds)) as stage:
        return _trace_all(reference, folded, options, progress, kinds, stage.advance)


def _traced_kinds(reference: Reference) -> tuple[GraphKind, ...]:
    kinds: tuple[GraphKind, ...] = (
        (GraphKind.UNIFIED, GraphKind.PREFILL) if reference.spec.encoder_dim is not None else (GraphKind.UNIFIED,)
    )
    # a one-token form of its own (a recurrent mixer's update: LoadedModel.decode_traced): decode traced at seq 1
    kinds += (GraphKind.DECODE,) if reference.loaded.decode_traced else ()
    # the encoder last: it gathers from the tables the decoder graphs store transposed (passes.transposes)
    kinds += (GraphKind.ENCODER,) if reference.spec.has_encoder else ()
    return kinds


def _trace_all(
    reference: Reference,
    folded: Folded,
    options: ExportOptions,
    progress: Progress,
    kinds: tuple[GraphKind, ...],
    on_phase: Callable[[], None],
) -> Traced:
    transposed: set[int] = set()  # the module tensors a graph of this export stores transposed
    plan = reference.loaded.layers
    stamp = StampPlan.of(plan) if plan is not None and len(plan.signatures) == reference.spec.n_layers else None
    if stamp is not None:
        try:
            template = _template(reference, stamp.traced)
            graphs = {
                kind: _checked(
                    _trace(
                        reference,
                        folded,
                        options,
                        template,
                        kind,
                        stamp.traced,
                        meta=True,
                        transposed=transposed,
                        on_phase=on_phase,
                    ),
                    stamp,
                )
                for kind in kinds
            }
            return Traced(graphs, stamp)
        except ExportError as exc:  # the template's own trace or analysis: the whole model still traces
            progress.note(f"trace: tracing the whole model ({exc})")
    if reference.spec.dtype != "float32":  # the graphs are traced in fp32: this path needs an fp32 copy of the model
        progress.note(
            f"trace: converting the {reference.spec.dtype} model to float32 to trace it whole (twice its memory)"
        )
        folded.module.float()  # in place: the reference shares these parameters and computes in fp32 anyway
    transposed.clear()
    return Traced(
        {
            kind: _trace(
                reference,
                folded,
                options,
                folded.module,
                kind,
                reference.spec.n_layers,
                meta=False,
                transposed=transposed,
                on_phase=on_phase,
            )
            for kind in kinds
        },
        None,
    )


def _template(reference: Reference, layers: int) -> nn.Module:
    loaded = reference.loaded
    assert loaded.layers is not None
    template = loaded.layers.template(layers)
    return loaded.ple.fold(template) if loaded.ple is not None else template


def _trace(
    reference: Reference,
    folded: Folded,
    options: ExportOptions,
    module: nn.Module,
    kind: GraphKind,
    layers: int,
    *,
    meta: bool,
    transposed: set[int],
    on_phase: Callable[[], None],
) -> ir.Model:
    own = reference.spec.cache
    spec = dataclasses.replace(
        reference.spec, n_layers=layers, cache=dataclasses.replace(own, layers=own.layers[:layers]) if own else None
    )
    arguments: dict[str, Any] = dict(
        kind=kind,
        io_spec=graph_io(spec, kind, last_logits_only=options.graphs.last_logits_only),
        n_layers=layers,
        vocab=spec.vocab_size,
        opset=options.graphs.opset,
        last_logits_only=options.graphs.last_logits_only and kind is GraphKind.PREFILL,
        max_batch=options.graphs.max_batch,
        max_context=reference.max_context,
        meta=meta,
        translations=reference.loaded.translations,
    )
    if spec.encoder_features is not None:  # a speech encoder's output (frames / 2) may outnumber the decoder's context
        arguments["max_encoder"] = spec.encoder_features[1] // 2
    model = _cached_trace(module, arguments, on_phase) if meta else trace_graph(module, on_phase=on_phase, **arguments)
    passes = [NameNodes(), BindWeights(WeightSource(folded.module)), FoldWeightTransposes(transposed), FoldConstants()]
    return run_passes(model, passes, graph="traced")


def _cached_trace(module: nn.Module, arguments: dict[str, Any], on_phase: Callable[[], None]) -> ir.Model:
    """A meta-device template's trace, from the trace cache when an identical one was traced
    before (``trace.cache``: the same phases counted), else traced and kept there; either way
    as the cache holds it (``as_cached``), so both give the same graphs."""
    cache = trace_cache()
    key = cache.key(module, arguments) if cache is not None else None
    model = cache.get(key) if cache is not None and key is not None else None
    if model is not None:
        for _ in range(PHASES):
            on_phase()
        return model
    proto = as_cached(trace_graph(module, on_phase=on_phase, **arguments))
    if cache is not None and key is not None:
        cache.put(key, proto)
    return from_cached(proto)


def _checked(model: ir.Model, stamp: StampPlan) -> ir.Model:
    StampLayers(stamp).check(model)
    return model
