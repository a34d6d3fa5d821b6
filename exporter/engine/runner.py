"""``TrtRunner``: kiln's runner interface (``exporter/runners/``) over the built engines.

Each engine is deserialized with ``trt.Runtime(logger).deserialize_cuda_engine(plan)`` and run by
polygraphy's ``polygraphy.backend.trt.TrtRunner`` (0.53.6: ``activate()`` creates the execution
context and a CUDA stream; ``infer(feed_dict, check_inputs=False)`` calls
``context.set_input_shape(name, shape)``, ``context.set_tensor_address(name, ptr)`` per input,
an output allocator per output, then ``context.execute_async_v3(stream)``, copies the outputs to
host and synchronizes; ``deactivate()`` frees its buffers). Its host output buffers are reused by
the next ``infer``, so ``run`` returns copies. Each engine has one optimization profile (index 0,
the default), so no profile is selected.

An export with LoRA slots (the manifest's ``lora``) has engines whose slot inputs are ordinary
network inputs (``build.slot_free_graph``): TensorRT has no optional inputs, so every run binds
each slot, by default an empty ``[in, 0]`` / ``[0, out]`` tensor (rank 0: the base model, as
ONNX Runtime's rank-0 initializers are; ``lora_default_feeds``). A zero-volume binding still needs
a non-null, distinct address (TensorRT developer guide, "Empty Tensors"); polygraphy 0.53.6's
``_get_array_on_gpu`` allocates one byte per such input for that reason. Adapter tensors fed by
the caller (``extra_feeds`` or a run's feeds) replace the defaults.

Before loading, every engine is checked against this machine's TensorRT and GPU
(``records.check_engine_compat``) and its sha256 against engines.json. Not run in kiln's CPU CI.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kiln.errors import ArtifactError, EngineError
from kiln.exporter.artifacts.hashing import sha256_file
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.contract.lora import LoraSlots
from kiln.exporter.engine import compat
from kiln.exporter.engine.build import TrtLog, load_tensorrt, make_logger
from kiln.exporter.engine.device import current_runtime
from kiln.exporter.engine.profiles import ENGINE_GRAPHS
from kiln.exporter.engine.records import check_engine_compat, read_records

if TYPE_CHECKING:
    import tensorrt as trt_types

__all__ = ["RecordedEngines", "TrtRunner", "recorded_engines", "output_names", "load_engines", "lora_default_feeds"]

Feeds = dict[str, np.ndarray]


def recorded_engines(directory: Path, graphs: str) -> tuple[dict[GraphKind, Path], dict[GraphKind, Mapping[str, Any]]]:
    """The prefill and decode engines engines.json records, each checked against its sha256 and
    against ``graphs``, the graph set the caller's contract is for ("portable" | "onnx")."""
    data = read_records(directory)
    built_from = data.get("graphs", {}).get("set", "portable")
    if built_from != graphs:
        raise ArtifactError(
            f"{directory}: its engines were built from the {built_from} graphs (engines.json), not the {graphs} ones; "
            "open them with kiln.exporter.engine.open_engines, which picks the runner of their contract"
        )
    engines: dict[GraphKind, Path] = {}
    records: dict[GraphKind, Mapping[str, Any]] = {}
    for kind in ENGINE_GRAPHS:
        record = data["engines"].get(kind.value)
        if not isinstance(record, dict):
            raise ArtifactError(
                f"{directory}: engines.json has no {kind.value} engine; rebuild with kiln build {directory}"
            )
        path = directory / str(record["file"])
        if not path.is_file():
            raise ArtifactError(f"{path}: engine file missing; rebuild with kiln build {directory}")
        if sha256_file(path) != record.get("sha256"):
            raise ArtifactError(f"{path}: sha256 differs from engines.json; rebuild with kiln build {directory}")
        engines[kind], records[kind] = path, record
    return engines, records


def lora_default_feeds(lora: LoraSlots | None) -> Feeds:
    """Every slot input at rank 0 (``[in, 0]``, ``[0, out]`` in the slots' dtype): what an engine of a
    slotted export is bound to when no adapter is fed. Empty without slots."""
    if lora is None:
        return {}
    dtype = np.dtype(lora.dtype)
    feeds: Feeds = {}
    for slot in lora.slots:
        feeds[slot.a] = np.zeros((slot.in_features, 0), dtype=dtype)
        feeds[slot.b] = np.zeros((0, slot.out_features), dtype=dtype)
    return feeds


def output_names(trt: ModuleType, engine: trt_types.ICudaEngine) -> tuple[str, ...]:
    """The engine's output tensors, in order."""
    names = (engine.get_tensor_name(i) for i in range(engine.num_io_tensors))
    return tuple(name for name in names if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT)


def load_engines(
    trt: ModuleType, paths: Mapping[GraphKind, Path], records: Mapping[GraphKind, Mapping[str, Any]]
) -> tuple[list[Any], dict[GraphKind, trt_types.ICudaEngine]]:
    """Deserialize each plan after checking its record against this machine's TensorRT and GPU
    (``records.check_engine_compat``). Returns what must outlive the engines (logger, runtime) and
    the engines."""
    if records:
        here = current_runtime(trt)
        for record in records.values():
            check_engine_compat(record, here)
    log = TrtLog()
    logger = make_logger(log)
    runtime: trt_types.Runtime = trt.Runtime(logger)
    if any(r.get("version_compatible") for r in records.values()):
        compat.allow_host_code(runtime)  # only plans kiln built and recorded
    engines: dict[GraphKind, trt_types.ICudaEngine] = {}
    for kind, path in paths.items():
        engine: trt_types.ICudaEngine | None = runtime.deserialize_cuda_engine(path.read_bytes())  # None on failure
        if engine is None:
            raise EngineError(f"{path}: TensorRT cannot load this engine: {log.last_error()}")
        engines[kind] = engine
    return [logger, runtime], engines


_Runner = TypeVar("_Runner", bound="RecordedEngines")


class RecordedEngines:
    """What both TensorRT runners hold: ``{kind: plan path}``, their engines.json entries (checked
    against this machine when loaded), the inputs fed to every run (e.g. PLE tables), and the
    logger and runtime that must outlive the engines. ``graph_set``: which engines.json set
    ``from_directory`` reads."""

    graph_set = "portable"

    def __init__(
        self,
        engines: Mapping[GraphKind, Path],
        records: Mapping[GraphKind, Mapping[str, Any]] | None = None,
        extra_feeds: Feeds | None = None,
    ) -> None:
        self._paths = dict(engines)
        self._records = dict(records or {})
        self._extra = dict(extra_feeds or {})
        self._defaults: Feeds = {}  # inputs bound when a run feeds nothing for them (LoRA slots at rank 0)
        self._keep: list[Any] = []

    @classmethod
    def from_directory(cls: type[_Runner], directory: Path, extra_feeds: Feeds | None = None) -> _Runner:
        """The engines of ``DIR/engines/engines.json`` of this runner's graph set, after checking
        their sha256."""
        from kiln.exporter.artifacts import manifest as manifest_mod

        engines, records = recorded_engines(directory, cls.graph_set)
        runner = cls(engines, records, extra_feeds)
        if cls.graph_set == "portable":  # slots exist on the portable graphs only
            runner._defaults = lora_default_feeds(manifest_mod.read(directory).lora)
        return runner

    def feeds(self, feeds: Feeds) -> Feeds:
        """What one run binds: the defaults, then the run's feeds, then the inputs fed to every run."""
        return {**self._defaults, **feeds, **self._extra}

    def graphs(self) -> tuple[GraphKind, ...]:
        return tuple(self._paths)


class TrtRunner(RecordedEngines, contextlib.AbstractContextManager["TrtRunner"]):
    """TensorRT engines of the portable graphs over ``{kind: plan path}`` (those of ``--target
    onnx``'s are ``static_runner.StaticTrtRunner``'s); engines and contexts exist only while active."""

    name = "tensorrt"

    def __init__(
        self,
        engines: Mapping[GraphKind, Path],
        records: Mapping[GraphKind, Mapping[str, Any]] | None = None,
        extra_feeds: Feeds | None = None,
    ) -> None:
        super().__init__(engines, records, extra_feeds)
        self._runners: dict[GraphKind, Any] = {}
        self._outputs: dict[GraphKind, tuple[str, ...]] = {}

    def __enter__(self) -> TrtRunner:
        load_tensorrt()  # one clear error where it is missing
        import tensorrt as trt
        from polygraphy.backend.trt import (
            TrtRunner as PolygraphyTrtRunner,  # no py.typed (Any: .ci/mypy)
        )

        self._keep, engines = load_engines(trt, self._paths, self._records)
        try:
            for kind, engine in engines.items():
                self._outputs[kind] = output_names(trt, engine)
                runner = PolygraphyTrtRunner(engine, name=f"tensorrt:{kind.value}")
                runner.activate()
                self._runners[kind] = runner
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for runner in self._runners.values():
            runner.deactivate()
        self._runners.clear()
        self._outputs.clear()
        self._keep.clear()

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        runner = self._runners.get(kind)
        if runner is None:
            raise EngineError(f"the TensorRT runner has no active {kind.value} engine (use it inside a with block)")
        outputs = runner.infer(self.feeds(feeds), check_inputs=False)
        return {name: np.array(outputs[name], copy=True) for name in self._outputs[kind]}
