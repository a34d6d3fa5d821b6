"""ONNX Runtime (CPU): the session factory every part of kiln uses, and the parity runner."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from kiln.errors import ArtifactError
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.runners.base import Feeds

__all__ = ["OrtRunner", "ort_session"]


def ort_session(
    model: Path | bytes,
    *,
    threads: int | None = None,
    spinning: bool = True,
    prepacking: bool = True,
    initializers: Mapping[str, object] | None = None,
    fp16_weights_stay_fp16: bool = False,
    weight_only_dq: bool = False,
    qdq_as_written: bool = False,
) -> Any:
    """An ONNX Runtime CPU session over a graph file or serialized model: the one place kiln
    sets session options. ``threads`` pins intra-op threads (and inter-op to one);
    ``spinning=False`` stops idle threads spinning (timing on a shared machine);
    ``prepacking=False`` with ``initializers`` (OrtValues over memory maps) lets several sessions
    read one copy of the weights instead of a private copy each.

    ``fp16_weights_stay_fp16``: the CPU provider has no fp16 MatMul on most x86 CPUs, so it casts
    every fp16 weight to fp32, and by default folds those casts into fp32 copies of all the
    weights when the session starts (twice the fp16 weights' bytes, in every session: measured on
    the Qwen2-1.5B shape, 3.1 GB of fp16 weights made 6.7 GB per session, 19.7 GB for an export's
    three; ``disabled_optimizers`` cannot name that fusion). With the graph optimizations off, no
    memory arena and priority-based order, each Cast runs just before its use and its fp32 copy is
    freed after it: 3.4 GB steady, 4.3 GB peak for the same session, at about 5x the decode time
    (a Cast per weight per run). Parity uses it; it also runs the graph as written.

    ``weight_only_dq``: ONNX Runtime (1.32) fuses ``DequantizeLinear(constant weight) -> MatMul``
    into ``MatMulNBits`` with ``accuracy_level`` 4 at ``ORT_ENABLE_EXTENDED`` and above, which
    quantizes the *activations* to int8 per block: a weight-only graph would be checked against
    int8 activations TensorRT never computes (0.5-0.8% relative error on one MatMul, measured in
    issue 16: tests/export/test_int4.py). Level 0 keeps the fusion, in float. Parity uses it.

    ``qdq_as_written``: ONNX Runtime (1.32) runs an int8 Q/DQ MatMul as ``QLinearMatMul`` over
    uint8 activations, whose kernel on x86 CPUs without VNNI (AVX2) is not the graph's exact int8
    products (0.38 off a tiny model's logits, measured: it flips near-tied tokens of the demo's
    int8 export); ``session.disable_quant_qdq`` computes the Q/DQ as written, as TensorRT does.
    Parity uses it for graphs that quantize activations (int8, fp8)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if fp16_weights_stay_fp16:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        opts.enable_cpu_mem_arena = False
        opts.enable_mem_pattern = False
        opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    if threads:
        opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    if not spinning:
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if weight_only_dq:
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    if qdq_as_written:
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
    if not prepacking:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    for name, value in (initializers or {}).items():
        opts.add_initializer(name, value)
    return _session(ort, model, opts)


def _session(ort: Any, model: Path | bytes, opts: Any) -> Any:
    """The session, or ONNX Runtime's refusal to load the graph in one line (a graph from a
    directory kiln verified may still be one it cannot run)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    refusals = (state.Fail, state.InvalidArgument, state.NoSuchFile, state.InvalidGraph, state.InvalidProtobuf, state.RuntimeException, state.NotImplemented)
    try:
        return ort.InferenceSession(str(model) if isinstance(model, Path) else model, opts, providers=["CPUExecutionProvider"])
    except refusals as exc:
        what = model if isinstance(model, Path) else "a graph"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ArtifactError(f"{what}: ONNX Runtime cannot load it ({first})") from exc


class OrtRunner(contextlib.AbstractContextManager["OrtRunner"]):
    """ONNX Runtime (CPU) over ``{kind: path}``; sessions exist only while the runner is active."""

    name = "onnxruntime"

    def __init__(self, paths: dict[GraphKind, Path], threads: int | None = None, extra_feeds: Feeds | None = None) -> None:
        self._paths = paths
        self._extra = dict(extra_feeds or {})  # inputs fed to every run (e.g. PLE tables)
        self._threads = threads
        self._runners: dict[GraphKind, Any] = {}  # polygraphy's OnnxrtRunner (untyped)
        self._shared = _SharedInitializers()

    @classmethod
    def opener(cls, paths: dict[GraphKind, Path], extra_feeds: Feeds | None = None) -> Callable[[], OrtRunner]:
        """A zero-argument factory of this runner (what parity opens when it needs the sessions)."""
        return lambda: cls(paths, extra_feeds=extra_feeds)

    def graphs(self) -> tuple[GraphKind, ...]:
        return tuple(self._paths)

    def __enter__(self) -> OrtRunner:
        from polygraphy.backend.onnxrt import OnnxrtRunner

        for kind, path in self._paths.items():
            # one memory-mapped copy of the weights for all sessions, not one copy each;
            # prepacking would make a private copy of every MatMul weight again
            initializers = self._shared.initializers(path)
            session = ort_session(
                path, threads=self._threads, prepacking=False, initializers=initializers, fp16_weights_stay_fp16=self._shared.has_fp16(path), weight_only_dq=True,
                qdq_as_written=self._shared.quantizes(path),
            )
            runner = OnnxrtRunner(session, name=f"onnxruntime:{kind.value}")
            runner.activate()
            self._runners[kind] = runner
        return self

    def __exit__(self, *exc: object) -> None:
        for runner in self._runners.values():
            runner.deactivate()
        self._runners.clear()
        self._shared = _SharedInitializers()

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        runner = self._runners[kind]
        return dict(runner.infer({**feeds, **self._extra}, check_inputs=False))


# packed int4 and float8 weights have no numpy dtype an OrtValue can be made from: each session
# reads its own copy of those from the file (an int4 weight is an eighth of its fp32 bytes)
_UNSHAREABLE = frozenset({22, 21, 17, 18, 19, 20})  # TensorProto INT4, UINT4, FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ


class _SharedInitializers:
    """OrtValues over memory maps of the external weights files, one per distinct initializer
    name. kiln's graphs name each weight identically in every graph (``weights/...``), so the
    sessions of prefill, decode and model.onnx read the same pages instead of three copies."""

    def __init__(self) -> None:
        self._maps: dict[Path, np.memmap] = {}
        self._values: dict[tuple[Path, str], object] = {}
        self._fp16: dict[Path, bool] = {}
        self._quantizes: set[Path] = set()

    def has_fp16(self, graph: Path) -> bool:
        """Whether the graph's external weights include fp16 ones (``initializers`` read it)."""
        return self._fp16.get(graph, False)

    def quantizes(self, graph: Path) -> bool:
        """Whether the graph quantizes activations (a QuantizeLinear: int8, fp8; ``initializers`` read it)."""
        return graph in self._quantizes

    def initializers(self, graph: Path) -> dict[str, object]:
        import onnx
        from onnx.helper import tensor_dtype_to_np_dtype
        from onnxruntime import OrtValue

        model = onnx.load(str(graph), load_external_data=False)
        if any(node.op_type == "QuantizeLinear" for node in model.graph.node):
            self._quantizes.add(graph)
        out: dict[str, object] = {}
        for init in model.graph.initializer:
            if init.data_location != onnx.TensorProto.EXTERNAL or init.data_type in _UNSHAREABLE:
                continue
            info = {e.key: e.value for e in init.external_data}
            file = (graph.parent / info["location"]).resolve()
            key = (file, init.name)
            if key not in self._values:
                if file not in self._maps:
                    self._maps[file] = np.memmap(file, dtype=np.uint8, mode="r")
                dtype = np.dtype(tensor_dtype_to_np_dtype(init.data_type))
                offset = int(info.get("offset", 0))
                array = np.ndarray(tuple(init.dims), dtype=dtype, buffer=self._maps[file], offset=offset)
                self._values[key] = OrtValue.ortvalue_from_numpy(array)
            out[init.name] = self._values[key]
            self._fp16[graph] = self._fp16.get(graph, False) or init.data_type == onnx.TensorProto.FLOAT16
        return out
