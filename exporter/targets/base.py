"""What a target is (docs/how-it-works.md): given the portable graph set, it writes its own graphs
beside them (never replacing them) and says what parity, the manifest and a run loop need.

The pipeline iterates the registry (``exporter.targets``); a target is one folder behind this
interface and one registration. The pipeline and parity reach a target only through the
registry, and every other module asks a target what it is rather than testing its name
(``tests/unit/test_code_shape.py``). No target folder imports another's (the same test): what
they share is ``exporter.patterns``. The interface:

- ``reasons(spec, options)``: why it cannot build from the export's options (its own flags
  without it too: every target is asked of every export) and, given the model's ``spec``, from a
  structure it cannot rewrite, one line each; the plan stage (``exporter.plan``) asks it with
  every other refusal, before any work is done;
- ``flags``: its own ``kiln export`` options (``kiln.registry.Flag``), which the CLI builds from the
  registry; their values reach it as ``options.target_flags``, by the flag's ``field``;
- ``letter``, ``lora_slots``, ``serves_genai(precision)``: its column's letter in ``kiln plugins``,
  whether ``--lora-slots`` is built on its graphs, whether ONNX Runtime GenAI runs its unified graph;
- ``wanted(options)``: whether this export writes it (``--target NAME``);
- ``write(given)``: its graphs, from the portable ones, as ``TargetGraphs``: their paths, their
  precision, its weights file, per graph what its passes report (``passes.reports``), its own
  ``record`` and the ``CacheUpdate`` contract its decode step follows;
- ``runner(paths, extra_feeds)``: how parity (and ``kiln check``) opens a runner over its graphs;
- ``engines`` (optional, an ``EngineGraphs``): that ``kiln build --graphs NAME`` makes TensorRT
  engines of its graphs (their static cache written in place) and the TensorRT that parses them;
  the engine package asks the registry for it (``targets.engine_target``), never for a name.

The manifest stores a ``TargetGraphs`` as a ``TargetEntry`` (``artifacts.manifest``), data the
target owns; ``kiln generate`` and ``kiln bench`` read the graph files and ``kv_cache`` from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kiln.exporter.contract.io import CacheUpdate, GraphIO, GraphKind
from kiln.registry import Flag

if TYPE_CHECKING:  # the registry is read by the CLI before anything heavy is imported
    from kiln.exporter.options import ExportOptions
    from kiln.exporter.passes.weights import SharedWeights
    from kiln.exporter.precision.kinds.plan import Precision
    from kiln.exporter.progress import Progress
    from kiln.exporter.runners.base import Feeds, Runner
    from kiln.plugins.base import DecoderSpec

__all__ = ["EngineGraphs", "Target", "TargetGiven", "TargetGraphs"]


@dataclasses.dataclass(frozen=True)
class EngineGraphs:
    """What ``kiln build`` needs of a target whose graphs it makes TensorRT engines of (``--graphs NAME``)."""

    min_tensorrt: tuple[int, int]  # the first TensorRT whose ONNX parser imports every op they hold
    needs: str  # that TensorRT, and why, in words (a refusal says it)


@dataclasses.dataclass(frozen=True)
class TargetGiven:
    """What a target is given: the portable graph files (in ``onnx_dir``, their weights beside
    them) and what shaped them."""

    onnx_dir: Path
    portable: dict[GraphKind, Path]
    spec: DecoderSpec
    options: ExportOptions
    max_context: int
    progress: Progress


@dataclasses.dataclass(frozen=True)
class TargetGraphs:
    """What a target wrote."""

    name: str
    precision: Precision  # of its graphs (its value is the manifest's targets.<name>.precision)
    paths: dict[GraphKind, Path]
    weights: SharedWeights  # the one more weights file its graphs read (besides the portable weights.bin)
    passes: dict[GraphKind, dict[str, dict[str, Any]]]  # per graph, what its passes report
    kv_cache: CacheUpdate  # how its decode step carries the cache
    record: Mapping[str, Any] | None = None  # what its graphs were written with, for the manifest
    io: Mapping[GraphKind, GraphIO] | None = (
        None  # its graphs' inputs and outputs, when they are not the portable contract's
    )


class Target(Protocol):
    """One target; registered in ``exporter.targets``."""

    name: str  # --target NAME
    label: str  # what its graphs are, in a sentence ("ONNX Runtime-target")
    description: str  # one line, for --help
    kv_caches: tuple[CacheUpdate, ...]  # the cache contracts its graphs follow (kiln verify refuses another)
    # its own CLI options (``kiln export --help`` lists them after --target); their values reach it as
    # ``options.target_flags[flag.field]``
    flags: tuple[Flag, ...]
    letter: str  # its letter in ``kiln plugins``' marks (``support``)
    lora_slots: bool  # --lora-slots is built on its graphs

    def reasons(self, spec: DecoderSpec | None, options: ExportOptions) -> list[str]: ...

    def wanted(self, options: ExportOptions) -> bool: ...

    def write(self, given: TargetGiven) -> TargetGraphs: ...

    def runner(
        self, paths: dict[GraphKind, Path], extra_feeds: Feeds | None
    ) -> Callable[[], contextlib.AbstractContextManager[Runner]]: ...

    def serves_genai(self, precision: Precision) -> bool:
        """Whether ONNX Runtime GenAI runs its unified graph (of ``precision``), not the portable one."""
        ...

    def quantized_precision(self, precision: Precision) -> Precision | None:
        """The precision whose tolerances judge this target's graphs of ``precision`` against
        PyTorch on the export's int4 weights (``parity.quantized``); None: not judged so."""
        ...
