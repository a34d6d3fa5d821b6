"""Optimization profiles of the prefill and decode engines, read from an export's manifest.

Every name and shape comes from the manifest's graph inputs (the I/O contract, exporter/contract/io.py): a dim is an
int (fixed) or one of ``batch``, ``seq``, ``past_seq``, ``total_seq``; the ranges come from the
manifest's ``limits`` (docs/commands.md, kiln build):

- prefill: batch ``[1, opt_batch, max_batch]`` x seq ``[1, opt_context, max_context]``;
- decode: batch ``[1, opt_batch, max_batch]`` x past_seq ``[1, opt_context - 1, max_context - 1]``,
  so total_seq = past_seq + 1 is ``[2, opt_context, max_context]`` and the new tokens are one.

Any other input with int dims only (e.g. ``ple.{i}.scale`` under ``--ple-tables input``) gets
its fixed shape as min = opt = max.
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
from kiln.exporter.engine.options import BuildOptions

__all__ = ["ENGINE_GRAPHS", "DimRange", "InputShape", "EngineProfile", "dim_ranges", "engine_profile", "engine_profiles"]

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
        raise ConfigError(f"--opt-batch {opt_batch} is larger than the export's max_batch {max_batch}; pass at most {max_batch}")
    if opt_context > max_context:
        raise ConfigError(f"--opt-context {opt_context} is larger than the export's max_context {max_context}; pass at most {max_context}")
    batch = DimRange(1, opt_batch, max_batch)
    encoder = DimRange(1, opt_context, max_context)  # cross-attention decoders: encoder_seq <= max_context (trace bound)
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
            raise ArtifactError(f"manifest graphs.{kind.value}: input {name} has dim {dim!r}; expected an int or one of {known}")
    return InputShape(name, dtype, tuple(lo), tuple(mid), tuple(hi))


def engine_profile(manifest: Manifest, kind: GraphKind, options: BuildOptions) -> EngineProfile:
    """The profile of the ``kind`` engine: every input of ``graphs.<kind>`` with its range."""
    graph = manifest.graphs.get(kind.value)
    if graph is None:
        raise ArtifactError(f"manifest has no graphs.{kind.value}; re-export with this kiln")
    ranges = dim_ranges(kind, manifest.limits, options)
    shapes = tuple(_input_shape(kind, spec, ranges) for spec in graph.inputs)
    return EngineProfile(kind, graph.file, f"engines/{kind.value}.plan", shapes)


def engine_profiles(manifest: Manifest, options: BuildOptions) -> tuple[EngineProfile, ...]:
    """The prefill and decode profiles, in that order."""
    return tuple(engine_profile(manifest, kind, options) for kind in ENGINE_GRAPHS)
