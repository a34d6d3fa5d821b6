"""Optimization profiles of the prefill and decode engines, read from an export's manifest.

Every name and shape comes from the manifest's graph inputs (the I/O contract, exporter/contract/io.py): a dim is an
int (fixed) or one of ``batch``, ``seq``, ``past_seq``, ``total_seq``; the ranges come from the
manifest's ``limits`` (docs/commands.md, kiln build):

- prefill: batch ``[1, opt_batch, max_batch]`` x seq ``[1, opt_context, max_context]``;
- decode: batch ``[1, opt_batch, max_batch]`` x past_seq ``[1, opt_context - 1, max_context - 1]``,
  so total_seq = past_seq + 1 is ``[2, opt_context, max_context]`` and the new tokens are one.

An export with LoRA slots (``--lora-slots RANK``: the manifest's ``lora``) has, on its portable
graphs only, each slot's ``A`` ``[in, 0..RANK]`` and ``B`` ``[0..RANK, out]`` (``lora_shapes``; the
``--target onnx`` graphs have no slots, so their profiles are unchanged). A min rank of 0 is legal:
``IOptimizationProfile::setDimensions`` requires ``0 <= min <= opt <= max`` since TensorRT 8
(NvInferRuntime.h; TensorRT 7 required ``1 <= min``), and TensorRT runs zero-volume tensors
(developer guide, "Empty Tensors"), so rank 0 is the base model, as on ONNX Runtime. opt is RANK:
the builder times kernels at opt, and an adapter's rank is what a served request carries (rank 0
is an empty product that costs nothing to tune).

Any other input with int dims only (e.g. ``ple.{i}.scale`` under ``--ple-tables input``) gets
its fixed shape as min = opt = max.

The ``--target onnx`` graphs (``graphs=GraphSet.ONNX``: the manifest's ``targets.onnx.graphs``,
``engines/<kind>.std.plan``) follow the static-cache contract (``contract.static_cache``), and the
same rules give their profiles: every cache input ``past_key_values.{i}.*`` is ``[batch, n_kv_heads,
max_context, head_dim]`` with ``max_context`` an int in the manifest, so fixed (min = opt = max, as
``IKVCacheUpdateLayer`` requires: a static sequence dim), batch ranged; ``write_indices`` ``[batch]``;
``attention_mask`` is prefill's ``[batch, seq]`` and decode's ``[batch, total_seq]``, both up to
``max_context``; ``input_ids`` and ``position_ids`` as the portable graphs'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from kiln.errors import ArtifactError, ConfigError
from kiln.exporter.artifacts.manifest import Limits, Manifest, TensorEntry
from kiln.exporter.contract.io import (
    BATCH,
    ENC_SEQ,
    PAST_SEQ,
    SEQ,
    TOTAL_SEQ,
    GraphKind,
)
from kiln.exporter.contract.lora import LoraSlots
from kiln.exporter.engine.graphs import ONNX_TARGET
from kiln.exporter.engine.options import BuildOptions, GraphSet

__all__ = [
    "ENGINE_GRAPHS",
    "DimRange",
    "InputShape",
    "EngineProfile",
    "dim_ranges",
    "engine_file",
    "lora_shapes",
    "engine_profile",
    "engine_profiles",
]

ENGINE_GRAPHS = (GraphKind.PREFILL, GraphKind.DECODE)  # one engine each; model.onnx gets none
Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class DimRange:
    min: int
    opt: int
    max: int


@dataclasses.dataclass(frozen=True)
class InputShape:
    """One input of one optimization profile."""

    name: str
    dtype: str
    min: Shape
    opt: Shape
    max: Shape

    def to_dict(self) -> dict[str, object]:
        return {"dtype": self.dtype, "min": list(self.min), "opt": list(self.opt), "max": list(self.max)}


@dataclasses.dataclass(frozen=True)
class EngineProfile:
    """The ONNX graph, the engine file and the single optimization profile of one engine."""

    kind: GraphKind
    onnx: str  # path relative to the export directory
    engine: str  # path relative to the export directory
    inputs: tuple[InputShape, ...]
    slot_inputs: tuple[str, ...] = ()  # the LoRA slot inputs among them: ONNX initializers the build turns into inputs

    def shapes(self) -> dict[str, dict[str, object]]:
        return {s.name: s.to_dict() for s in self.inputs}


def _limit(limits: Limits, key: str, minimum: int) -> int:
    value = getattr(limits, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ArtifactError(f"manifest limits.{key} must be an integer of at least {minimum}, found {value!r}")
    return value


def dim_ranges(kind: GraphKind, limits: Limits, options: BuildOptions) -> dict[str, DimRange]:
    """The range of every named dim of ``kind`` for the manifest's ``limits``."""
    max_batch = _limit(limits, "max_batch", 1)
    max_context = _limit(limits, "max_context", 2)
    opt_batch = 1 if options.opt_batch is None else options.opt_batch
    opt_context = max(2, max_context // 2) if options.opt_context is None else options.opt_context
    if opt_batch > max_batch:
        raise ConfigError(
            f"--opt-batch {opt_batch} is larger than the export's max_batch {max_batch}; pass at most {max_batch}"
        )
    if opt_context > max_context:
        raise ConfigError(
            f"--opt-context {opt_context} is larger than the export's max_context {max_context}; pass at most "
            f"{max_context}"
        )
    batch = DimRange(1, opt_batch, max_batch)
    encoder = DimRange(
        1, opt_context, max_context
    )  # cross-attention decoders: encoder_seq <= max_context (trace bound)
    if kind is GraphKind.PREFILL:
        seq = DimRange(1, opt_context, max_context)
        return {BATCH: batch, SEQ: seq, TOTAL_SEQ: seq, ENC_SEQ: encoder}  # no past: the mask spans the prompt
    if kind is GraphKind.DECODE:
        past_opt = min(max(opt_context - 1, 1), max_context - 1)
        past = DimRange(1, past_opt, max_context - 1)
        total = DimRange(2, past_opt + 1, max_context)
        return {BATCH: batch, SEQ: DimRange(1, 1, 1), PAST_SEQ: past, TOTAL_SEQ: total, ENC_SEQ: encoder}
    raise ArtifactError(f"no TensorRT engine is built for the {kind.value} graph; only prefill and decode")


def _input_shape(kind: GraphKind, spec: TensorEntry, ranges: Mapping[str, DimRange]) -> InputShape:
    name, dtype, dims = spec.name, spec.dtype, spec.shape
    lo: list[int] = []
    mid: list[int] = []
    hi: list[int] = []
    for dim in dims:
        if isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0:
            lo.append(dim)
            mid.append(dim)
            hi.append(dim)
        elif isinstance(dim, str) and dim in ranges:
            r = ranges[dim]
            lo.append(r.min)
            mid.append(r.opt)
            hi.append(r.max)
        else:
            known = ", ".join(sorted(ranges))
            raise ArtifactError(
                f"manifest graphs.{kind.value}: input {name} has dim {dim!r}; expected an int or one of {known}"
            )
    return InputShape(name, dtype, tuple(lo), tuple(mid), tuple(hi))


def lora_shapes(lora: LoraSlots) -> tuple[InputShape, ...]:
    """Every slot's A ``[in, 0..max_rank]`` and B ``[0..max_rank, out]``, in the manifest's slot order
    (the order the graphs list them, after the contract's inputs)."""
    r = lora.max_rank
    shapes: list[InputShape] = []
    for s in lora.slots:
        shapes.append(InputShape(s.a, lora.dtype, (s.in_features, 0), (s.in_features, r), (s.in_features, r)))
        shapes.append(InputShape(s.b, lora.dtype, (0, s.out_features), (r, s.out_features), (r, s.out_features)))
    return tuple(shapes)


def engine_file(kind: GraphKind, graphs: GraphSet) -> str:
    """The engine of ``kind`` built from ``graphs``, relative to the export directory."""
    return f"engines/{kind.value}.std.plan" if graphs is GraphSet.ONNX else f"engines/{kind.value}.plan"


def _graph_inputs(manifest: Manifest, kind: GraphKind, graphs: GraphSet) -> tuple[str, tuple[TensorEntry, ...]]:
    """The graph file and the inputs of ``kind`` in ``graphs``, as the manifest records them."""
    if graphs is GraphSet.PORTABLE:
        graph = manifest.graphs.get(kind.value)
        if graph is None:
            raise ArtifactError(f"manifest has no graphs.{kind.value}; re-export with this kiln")
        return graph.file, graph.inputs
    entry = (manifest.targets or {}).get(ONNX_TARGET)
    std = None if entry is None else entry.graphs.get(kind.value)
    if std is None or std.inputs is None:
        raise ArtifactError(
            f"manifest has no targets.{ONNX_TARGET}.graphs.{kind.value} with its inputs; re-export with --target onnx"
        )
    max_context = manifest.limits.max_context
    for spec in std.inputs:  # the contract: every key/value buffer holds max_context slots (a state: its fixed size)
        buffer = spec.name.startswith("past_key_values.") and spec.name.endswith((".key", ".value"))
        if buffer and (len(spec.shape) != 4 or spec.shape[2] != max_context):
            raise ArtifactError(
                f"manifest targets.{ONNX_TARGET}.graphs.{kind.value}: cache input {spec.name} is "
                f"{list(spec.shape)}, expected [batch, n_kv_heads, {max_context}, head_dim] "
                "(its sequence dim fixed at limits.max_context); re-export with --target onnx"
            )
    return std.file, std.inputs


def engine_profile(
    manifest: Manifest, kind: GraphKind, options: BuildOptions, graphs: GraphSet = GraphSet.PORTABLE
) -> EngineProfile:
    """The profile of the ``kind`` engine: every input of its graph in ``graphs`` with its range."""
    if graphs is GraphSet.AUTO:
        raise ValueError("engine_profile takes a chosen graph set (engine.graphs.choose_graphs), not auto")
    file, inputs = _graph_inputs(manifest, kind, graphs)
    ranges = dim_ranges(kind, manifest.limits, options)
    shapes = tuple(_input_shape(kind, spec, ranges) for spec in inputs)
    slots = (
        lora_shapes(manifest.lora) if graphs is GraphSet.PORTABLE and manifest.lora is not None else ()
    )  # portable graphs only
    return EngineProfile(kind, file, engine_file(kind, graphs), shapes + slots, tuple(s.name for s in slots))


def engine_profiles(
    manifest: Manifest, options: BuildOptions, graphs: GraphSet = GraphSet.PORTABLE
) -> tuple[EngineProfile, ...]:
    """The prefill and decode profiles of ``graphs``, in that order."""
    return tuple(engine_profile(manifest, kind, options, graphs) for kind in ENGINE_GRAPHS)
