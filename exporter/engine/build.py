"""The TensorRT builder: one strongly typed engine per graph with one optimization profile.

API used, as bound in NVIDIA/TensorRT ``python/src/infer/pyCore.cpp`` and
``python/src/parsers/pyOnnx.cpp`` (``release/10.13`` and ``main`` = 11.1) and typed by
``tensorrt-stubs`` 10.13: ``Builder(logger)``, ``Builder.create_network(flags)``,
``OnnxParser(network, logger)``, ``OnnxParser.parse_from_file(path)`` (resolves external data
beside the file), ``OnnxParser.parse(model_bytes, path)`` (the same, for a graph kiln edited: ``slot_free_graph``),
``OnnxParser.num_errors``/``get_error(i)`` with ``ParserError.desc()``,
``node()``, ``node_name()``, ``node_operator()``; ``Builder.create_builder_config()``,
``IBuilderConfig.set_memory_pool_limit(MemoryPoolType.WORKSPACE, n)``,
``builder_optimization_level``, ``hardware_compatibility_level``, ``set_flag``/``clear_flag``,
``create_timing_cache(bytes)``, ``set_timing_cache(cache, ignore_mismatch)``,
``get_timing_cache().serialize()``; ``Builder.create_optimization_profile()``,
``IOptimizationProfile.set_shape(name, min, opt, max)``, ``IBuilderConfig.add_optimization_profile``;
``Builder.build_serialized_network(network, config)`` (IHostMemory, None on failure);
``Runtime(logger).deserialize_cuda_engine(plan)``, ``ICudaEngine.get_tensor_profile_shape(name, 0)``.
A custom logger subclasses ``trt.ILogger`` and calls ``trt.ILogger.__init__(self)`` (pyCoreDoc.h,
ILoggerDoc). Everything that differs between 10.x and 11.x goes through ``compat``.

``tensorrt`` is imported only inside these functions. Nothing here has run on a GPU in kiln's
CI; the GPU tier (tests/gpu/test_engines.py) exercises it where TensorRT is installed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kiln.errors import ArtifactError, EngineError
from kiln.exporter.artifacts.hashing import sha256_file
from kiln.exporter.engine import compat
from kiln.exporter.engine.device import current_runtime
from kiln.exporter.engine.gpus import require_gpu_for
from kiln.exporter.engine.graphs import GraphChoice, choose_graphs
from kiln.exporter.engine.options import BuildOptions, GraphSet
from kiln.exporter.engine.profiles import (
    ENGINE_GRAPHS,
    EngineProfile,
    InputShape,
    Shape,
    engine_file,
    engine_profiles,
)
from kiln.exporter.engine.records import (
    ENGINES_JSON,
    EngineRecord,
    RuntimeInfo,
    write_records,
)
from kiln.exporter.engine.trtexec import SCRIPT, timing_cache_path
from kiln.newfile import new_output

if TYPE_CHECKING:
    import tensorrt as trt_types

__all__ = [
    "INSTALL_HINT",
    "TrtLog",
    "make_logger",
    "load_tensorrt",
    "format_parser_error",
    "parser_errors",
    "slot_free_graph",
    "check_in_place",
    "build_engine",
    "build_engines",
]

INSTALL_HINT = (
    "pip install tensorrt on a machine with an NVIDIA GPU and CUDA (then run kiln build again there), "
    f"or copy the export directory to one and run bash {SCRIPT} there"
)
_MAX_ERRORS = 5


def load_tensorrt() -> ModuleType:
    """``import tensorrt``, or one ``EngineError`` saying it is not installed and how to install it.

    A ``tensorrt`` with no ``Builder`` is not TensorRT: ``tensorrt-stubs`` alone installs a
    ``tensorrt/__init__.pyi`` directory that imports as an empty namespace package.
    """
    try:
        import tensorrt as trt
    except (ImportError, OSError) as exc:
        raise EngineError(f"TensorRT is not installed ({type(exc).__name__}: {exc}); {INSTALL_HINT}") from None
    if not hasattr(trt, "Builder"):
        where = ", ".join(str(p) for p in getattr(trt, "__path__", [])) or "?"
        raise EngineError(
            f"TensorRT is not installed (the 'tensorrt' at {where} has no Builder: type stubs only?); {INSTALL_HINT}"
        )
    compat.require_supported(trt)
    return trt


class TrtLog:
    """What TensorRT logged during one build: errors kept for the failure message."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def last_error(self) -> str:
        return (
            self.errors[-1]
            if self.errors
            else "no error was logged; rerun with the trtexec command in engines/trtexec.sh for details"
        )


def make_logger(log: TrtLog) -> trt_types.ILogger:
    """A ``trt.ILogger`` that prints warnings and errors to stderr and keeps the errors."""
    import tensorrt as trt

    severity = trt.ILogger.Severity
    errors = {severity.INTERNAL_ERROR, severity.ERROR}
    shown = errors | {severity.WARNING}

    class _Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)  # required by pybind11 (ILoggerDoc in pyCoreDoc.h)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            if severity in errors:
                log.errors.append(msg)
            if severity in shown:
                print(f"[TensorRT] {msg}", file=sys.stderr)

    return _Logger()


def _call(obj: object, name: str) -> Any:
    method = getattr(obj, name, None)  # node_name()/node_operator(): not in every version
    if not callable(method):
        return None
    try:
        return method()
    except Exception:  # a binding that cannot answer for this error
        return None


def format_parser_error(error: object) -> str:
    """``node 'name' (Op): message`` for one ``trt.ParserError``."""
    name, op, index, desc = (_call(error, n) for n in ("node_name", "node_operator", "node", "desc"))
    if name:
        where = f"node {name!r}"
    elif isinstance(index, int) and index >= 0:
        where = f"node #{index}"
    else:
        where = "graph"
    if op:
        where += f" ({op})"
    return f"{where}: {desc if desc else str(error)}"


def parser_errors(parser: object) -> list[str]:
    """Every error of an ``OnnxParser`` after a parse, formatted with node name and message."""
    count = getattr(parser, "num_errors", 0)
    get_error: Callable[[int], object] | None = getattr(parser, "get_error", None)
    if not isinstance(count, int) or get_error is None:
        return []
    return [format_parser_error(get_error(i)) for i in range(count)]


def slot_free_graph(onnx: Path, slots: Sequence[str]) -> bytes:
    """The graph of ``onnx`` (its weights left in their external file) without the initializers of
    the LoRA slot inputs ``slots``. TensorRT's ONNX parser does not know overridable initializers: it
    takes a graph input that has an initializer for a constant, never a network input
    (onnx-tensorrt ``ModelImporter.cpp`` ``importInputs``: "Initializers are not really network
    inputs, so they need to be excluded"), which would build the base model with no adapter input.
    Without them the slots are ordinary inputs, ranged by the profile and always bound."""
    import onnx as onnx_lib

    proto = onnx_lib.load(str(onnx), load_external_data=False)
    names = set(slots)
    kept = [init for init in proto.graph.initializer if init.name not in names]
    if len(proto.graph.initializer) - len(kept) != len(names):
        raise ArtifactError(
            f"{onnx}: the manifest's {len(names)} LoRA slot inputs are not all initializers of the graph; "
            "re-export the directory"
        )
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept)
    return bytes(proto.SerializeToString())


def _parse(
    trt: ModuleType, builder: trt_types.Builder, logger: trt_types.ILogger, onnx: Path, slots: Sequence[str] = ()
) -> tuple[trt_types.INetworkDefinition, trt_types.OnnxParser]:
    network = builder.create_network(compat.network_flags(trt))
    parser: trt_types.OnnxParser = trt.OnnxParser(network, logger)
    if slots:  # parse(model, path): path locates the external weights beside the graph (pyOnnx.cpp)
        ok = bool(parser.parse(slot_free_graph(onnx, slots), str(onnx)))
    else:
        ok = bool(parser.parse_from_file(str(onnx)))  # the 10.13 stubs' `bool` is trt.bool: coerce
    errors = parser_errors(parser)
    if not ok or errors:
        shown = "; ".join(errors[:_MAX_ERRORS]) or "the parser reported failure without an error"
        more = f" (and {len(errors) - _MAX_ERRORS} more)" if len(errors) > _MAX_ERRORS else ""
        raise EngineError(f"{onnx}: TensorRT's ONNX parser failed: {shown}{more}")
    return network, parser  # the parser must outlive the network's use (it owns its weights)


def _dims(trt: ModuleType, shape: Shape) -> trt_types.Dims:
    dims: trt_types.Dims = trt.Dims(list(shape))
    return dims


def _as_tuple(dims: trt_types.Dims) -> Shape:
    return tuple(int(dims[i]) for i in range(len(dims)))


def _add_profile(
    trt: ModuleType,
    builder: trt_types.Builder,
    network: trt_types.INetworkDefinition,
    config: trt_types.IBuilderConfig,
    profile: EngineProfile,
) -> list[InputShape]:
    """Set the profile's shapes on every dynamic network input; check the static ones.
    Returns the inputs whose shapes were set."""
    tensors = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
    wanted = {spec.name: spec for spec in profile.inputs}
    if set(tensors) != set(wanted):
        raise EngineError(
            f"{profile.onnx}: the graph's inputs {sorted(tensors)} differ from the manifest's {sorted(wanted)}; "
            "re-export the directory"
        )
    opt_profile: trt_types.IOptimizationProfile = builder.create_optimization_profile()
    dynamic: list[InputShape] = []
    for name, tensor in tensors.items():
        spec, shape = wanted[name], _as_tuple(tensor.shape)
        if len(shape) != len(spec.min):
            raise EngineError(
                f"{profile.onnx}: input {name} has rank {len(shape)} in the graph and {len(spec.min)} in the manifest"
            )
        if any(d < 0 for d in shape):
            opt_profile.set_shape(name, _dims(trt, spec.min), _dims(trt, spec.opt), _dims(trt, spec.max))
            dynamic.append(spec)
        elif shape != spec.min or shape != spec.max:
            raise EngineError(
                f"{profile.onnx}: input {name} is fixed at {list(shape)} in the graph but {list(spec.min)} in "
                "the manifest"
            )
    if config.add_optimization_profile(opt_profile) < 0:
        raise EngineError(f"{profile.onnx}: TensorRT rejected the optimization profile {profile.shapes()}")
    return dynamic


def _set_timing_cache(config: trt_types.IBuilderConfig, cache_file: Path) -> None:
    data = cache_file.read_bytes() if cache_file.is_file() else b""
    cache = config.create_timing_cache(data)
    if not bool(config.set_timing_cache(cache, ignore_mismatch=False)):  # stubs: see _parse
        if not data:
            raise EngineError("TensorRT refused an empty timing cache")
        print(
            f"[kiln] {cache_file} was written for another GPU or TensorRT; starting a new timing cache", file=sys.stderr
        )
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)


def _write(path: Path, data: Any) -> None:
    """Write a buffer (bytes, memoryview or IHostMemory) to ``path`` through a temporary file."""
    with new_output(path) as tmp, open(tmp, "wb") as f:
        f.write(memoryview(data))


def _check_profile(engine: trt_types.ICudaEngine, dynamic: Sequence[InputShape], onnx: str) -> None:
    for spec in dynamic:
        got = [_as_tuple(d) for d in engine.get_tensor_profile_shape(spec.name, 0)]
        if got != [spec.min, spec.opt, spec.max]:
            raise EngineError(
                f"{onnx}: the built engine's profile for {spec.name} is {got}, expected "
                f"{[spec.min, spec.opt, spec.max]}"
            )


def _builder_config(
    trt: ModuleType, builder: trt_types.Builder, options: BuildOptions
) -> tuple[trt_types.IBuilderConfig, bool]:
    """The builder config of ``options`` and whether TF32 stays on (TensorRT builds that lack the flag)."""
    config: trt_types.IBuilderConfig = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace)
    config.builder_optimization_level = options.opt_level
    config.hardware_compatibility_level = compat.hardware_level(trt, options.hardware_compat)
    if options.version_compatible:
        config.set_flag(compat.builder_flag(trt, "VERSION_COMPATIBLE"))
    if options.refittable:
        config.set_flag(compat.builder_flag(trt, "REFIT"))
    return config, not compat.disable_tf32(trt, config)


def check_in_place(trt: ModuleType, engine: trt_types.ICudaEngine, where: str) -> dict[str, str]:
    """The static-cache contract's promise, checked on a built engine of the ``--target onnx``
    graphs: every ``present.{i}.*`` output aliases its ``past_key_values.{i}.*`` input (the ONNX
    parser lowered each ``TensorScatter`` to an in-place ``IKVCacheUpdateLayer``, whose output "must
    be a network output and shares the same device memory address with the cache input": TensorRT
    operators reference, KVCacheUpdate). A recurrent state's present (``conv``, ``ssm``: the static
    contract's buffers are its keys and values only) is a plain output, aliased to nothing; a graph of
    a state-space model has no buffer at all. Returns the aliases (output -> input)."""
    aliases = compat.aliased_inputs(trt, engine)
    if aliases is None:
        raise EngineError(
            f"{where}: this TensorRT {trt.__version__} cannot report aliased tensors "
            "(ICudaEngine.get_aliased_input_tensor, 10.15+); the --target onnx engines need 10.15 or newer"
        )
    outputs = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    presents = [name for name in outputs if name.startswith("present.")]
    buffers = [name for name in presents if name.endswith((".key", ".value"))]
    wrong = [
        f"{name} -> {aliases.get(name)}"
        for name in presents
        if aliases.get(name) != ("past_key_values." + name.removeprefix("present.") if name in buffers else None)
    ]
    if not presents or wrong:
        raise EngineError(
            f"{where}: the cache is not written in place: {', '.join(wrong) or 'no present output'} (each "
            f"present.{{i}}.* must alias past_key_values.{{i}}.*); "
            "TensorRT's parser did not lower TensorScatter to IKVCacheUpdateLayer: build the portable graphs "
            "(--graphs portable)"
        )
    return aliases


def build_engine(
    directory: Path,
    profile: EngineProfile,
    options: BuildOptions,
    built_with: RuntimeInfo,
    graphs: GraphSet = GraphSet.PORTABLE,
) -> EngineRecord:
    """Build ``profile.engine`` from ``profile.onnx`` (both relative to ``directory``; ``graphs``: the
    set they belong to, the --target onnx engines checked for their in-place cache);
    ``load_tensorrt()`` must have succeeded."""
    import tensorrt as trt

    onnx = directory / profile.onnx
    if not onnx.is_file():
        raise ArtifactError(f"{onnx}: graph file missing; re-export the directory")
    log = TrtLog()
    logger = make_logger(log)
    try:
        builder: trt_types.Builder = trt.Builder(logger)
    except (TypeError, RuntimeError) as exc:  # pybind11: "factory function returned nullptr" without a GPU
        raise EngineError(
            f"TensorRT could not create a builder ({log.last_error() if log.errors else exc}); is a CUDA GPU visible?"
        ) from None
    network, _parser = _parse(trt, builder, logger, onnx, profile.slot_inputs)

    config, tf32 = _builder_config(trt, builder, options)
    dynamic = _add_profile(trt, builder, network, config, profile)
    cache_file = timing_cache_path(directory, options)
    _set_timing_cache(config, cache_file)

    plan: trt_types.IHostMemory | None = builder.build_serialized_network(network, config)  # None on failure
    if plan is None:
        raise EngineError(f"{onnx}: TensorRT could not build the {profile.kind.value} engine: {log.last_error()}")
    engine_path = directory / profile.engine
    engine_path.parent.mkdir(parents=True, exist_ok=True)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    _write(cache_file, config.get_timing_cache().serialize())
    _write(engine_path, plan)

    runtime: trt_types.Runtime = trt.Runtime(logger)
    if options.version_compatible:
        compat.allow_host_code(runtime)
    engine: trt_types.ICudaEngine | None = runtime.deserialize_cuda_engine(engine_path.read_bytes())  # None on failure
    if engine is None:
        raise EngineError(f"{engine_path}: TensorRT built the engine but cannot load it: {log.last_error()}")
    _check_profile(engine, dynamic, profile.onnx)
    if graphs is GraphSet.ONNX:
        check_in_place(trt, engine, str(engine_path))
    return EngineRecord(
        kind=profile.kind.value,
        file=profile.engine,
        sha256=sha256_file(engine_path),
        bytes=engine_path.stat().st_size,
        onnx=profile.onnx,
        onnx_sha256=sha256_file(onnx),
        built_with=built_with,
        hardware_compat=options.hardware_compat.value,
        version_compatible=options.version_compatible,
        refittable=options.refittable,
        tf32=tf32,
        profiles=(profile.shapes(),),
        device_memory_bytes=compat.device_memory_bytes(engine),
        weights_bytes=compat.weights_bytes(trt, engine),
        graphs=graphs.value,
    )


def build_engines(
    directory: Path,
    options: BuildOptions,
    profiles: Sequence[EngineProfile] | None = None,
    choice: GraphChoice | None = None,
) -> dict[str, EngineRecord]:
    """Build the prefill and decode engines of the chosen graph set (``choice``, else
    ``engine.graphs.choose_graphs`` for ``options.graphs`` and this TensorRT; ``profiles``, else that
    set's) into ``DIR/engines/`` and write ``engines/engines.json``; returns the records by kind.
    The other set's engines are removed first: ``engines/`` holds one set, the one engines.json
    records. ``build_command`` also writes trtexec.sh and records the engines in the manifest."""
    from kiln.exporter.artifacts import manifest as manifest_mod
    from kiln.exporter.precision.lowbit_check import require_tensorrt_int4

    trt = load_tensorrt()
    manifest = manifest_mod.read(directory)
    if choice is None:
        choice = choose_graphs(manifest, options.graphs, compat.trt_version(trt))
    if profiles is None:
        profiles = engine_profiles(manifest, options, choice.graphs)
    require_tensorrt_int4(directory, [profile.onnx for profile in profiles])  # as trtexec.sh's writer does
    built_with = current_runtime(trt)
    require_gpu_for(manifest.precision, built_with.compute_capability, built_with.gpu)
    (directory / ENGINES_JSON).unlink(missing_ok=True)  # a failed build leaves no record of stale plans
    for kind in ENGINE_GRAPHS:
        for graphs in (GraphSet.PORTABLE, GraphSet.ONNX):
            if graphs is not choice.graphs:
                (directory / engine_file(kind, graphs)).unlink(
                    missing_ok=True
                )  # kiln build's own name: one set in engines/
    records: dict[str, EngineRecord] = {}
    for profile in profiles:
        records[profile.kind.value] = build_engine(directory, profile, options, built_with, choice.graphs)
    write_records(directory, records, options.to_dict(), SCRIPT, choice.to_dict())
    return records
