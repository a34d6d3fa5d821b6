"""ONNX Runtime: the session factory every part of kiln uses (CPU; parity on CUDA: ``runners.device``), and the
parity runner."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.errors import ArtifactError
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.external_data import external_files
from kiln.exporter.runners.base import Feeds
from kiln.exporter.runners.device import current
from kiln.exporter.runners.heap import return_freed_memory
from kiln.exporter.runners.ort_memory import allocation_failure, memory_error

__all__ = ["KEEP_OPEN_BYTES", "OrtRunner", "ort_session"]

KEEP_OPEN_BYTES = 512 * 2**20  # graphs whose weights together fit this keep their sessions open together


def ort_session(
    model: Path | bytes,
    *,
    threads: int | None = None,
    spinning: bool = True,
    fp16_weights_stay_fp16: bool = False,
    weight_only_dq: bool = False,
    qdq_as_written: bool = False,
    providers: list[Any] | None = None,
    memory_arena: bool = True,
    prepack: bool = True,
) -> Any:
    """An ONNX Runtime CPU session over a graph file or serialized model: the one place kiln
    sets session options. ``threads`` pins intra-op threads (and inter-op to one);
    ``spinning=False`` stops idle threads spinning (timing on a shared machine). MatMul weights
    are prepacked, as ONNX Runtime does by default (``OrtRunner``: without it, the CPU kernels
    repack or dequantize every weight on every call).

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
    Parity uses it for graphs that quantize activations (int8, fp8).

    ``providers``: ONNX Runtime's execution providers (default the CPU's alone); parity on CUDA
    passes ``ParityDevice.providers`` (``runners.device``).

    ``memory_arena=False``: no CPU memory arena, so a run's buffers go back to the system when it
    ends instead of staying reserved in the arena's grown chunks until the session closes (parity:
    the 0.5B fp32 export's peak fell 0.3 GB, from 4.23 to 3.92 GB, at the same stage time).

    ``prepack=False`` (``session.disable_prepacking``): the session maps its weights and packs them
    at each call instead of copying every one into packed form when it starts: for a graph run a
    handful of times, the start is what costs (``OrtRunner``)."""
    import onnxruntime as ort

    opts = _options(ort, threads, spinning, fp16_weights_stay_fp16, weight_only_dq, qdq_as_written, memory_arena)
    if not prepack:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    return _session(ort, model, opts, providers or ["CPUExecutionProvider"])


def _options(
    ort: Any,
    threads: int | None,
    spinning: bool,
    fp16_weights_stay_fp16: bool,
    weight_only_dq: bool,
    qdq_as_written: bool,
    memory_arena: bool,
) -> Any:
    """``ort_session``'s ``SessionOptions`` (each argument as ``ort_session`` says)."""
    opts = ort.SessionOptions()
    if fp16_weights_stay_fp16:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        opts.enable_cpu_mem_arena = False
        opts.enable_mem_pattern = False
        opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    if not memory_arena:
        opts.enable_cpu_mem_arena = False
    if threads:
        opts.intra_op_num_threads = threads
    opts.log_severity_level = (
        4  # fatal only: a failed run is its exception (one line, ort_memory), not also a logged error
    )
    if not spinning:
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if weight_only_dq:
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    if qdq_as_written:
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
    return opts


def _session(ort: Any, model: Path | bytes, opts: Any, providers: list[Any]) -> Any:
    """The session, or ONNX Runtime's refusal to load the graph in one line (a graph from a
    directory kiln verified may still be one it cannot run)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    refusals = (
        state.Fail,
        state.InvalidArgument,
        state.NoSuchFile,
        state.InvalidGraph,
        state.InvalidProtobuf,
        state.RuntimeException,
        state.NotImplemented,
    )
    try:
        return ort.InferenceSession(str(model) if isinstance(model, Path) else model, opts, providers=providers)
    except refusals as exc:
        what = model if isinstance(model, Path) else "a graph"
        if allocation_failure(exc):
            raise memory_error(exc, f"{what}: its session") from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ArtifactError(f"{what}: ONNX Runtime cannot load it ({first})") from exc


class OrtRunner(contextlib.AbstractContextManager["OrtRunner"]):
    """ONNX Runtime (CPU) over ``{kind: path}``, one session at a time: a graph's session opens
    when it is first run and closes when another graph is run (parity runs each graph's work
    together, so each session opens once: ``parity.schedule``), so a model's weights are in
    memory once, whatever the number of graphs. Each session prepacks its MatMul weights as ONNX
    Runtime does by default: without prepacking its CPU kernels repack every fp32 weight and
    dequantize every int4 one on every call (measured on the Llama-3-8B shape with 2 layers, an
    int4 decode step of 4 rows: 3.3 s against 0.48 s). Graphs whose weights together fit
    ``KEEP_OPEN_BYTES`` keep their sessions open side by side instead (a small model's sessions
    cost more to reopen than to hold: the test suite's parity). Prefill and the unified graph, which
    parity runs a handful of times, do not prepack fp32 weights: their session's start would cost
    more than packing at each run (docs/benchmarks.md); decode, run once a generated token, and
    quantized or fp16 weights (dequantized or cast at every call without it) keep prepacking.
    Sessions exist only while the runner is active. Its sessions run on the parity device of its
    making (``runners.device``): on CUDA, ONNX Runtime's CUDA provider (the CPU's for nodes it has
    no kernel of)."""

    name = "onnxruntime"

    def __init__(
        self, paths: dict[GraphKind, Path], threads: int | None = None, extra_feeds: Feeds | None = None
    ) -> None:
        self._paths = paths
        self._extra = dict(extra_feeds or {})  # inputs fed to every run (e.g. PLE tables)
        self._threads = threads
        self._open: dict[GraphKind, Any] = {}  # the open graphs' polygraphy OnnxrtRunners (untyped)
        self._traits: dict[GraphKind, _GraphTraits] = {}  # read once per graph, not at every reopening
        self._active = False
        self._device = current()

    @classmethod
    def opener(cls, paths: dict[GraphKind, Path], extra_feeds: Feeds | None = None) -> Callable[[], OrtRunner]:
        """A zero-argument factory of this runner (what parity opens when it needs the sessions)."""
        return lambda: cls(paths, extra_feeds=extra_feeds)

    def graphs(self) -> tuple[GraphKind, ...]:
        return tuple(self._paths)

    def __enter__(self) -> OrtRunner:
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()
        self._active = False

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        assert self._active, "OrtRunner runs inside its `with` block"
        runner = self._open[kind] if kind in self._open else self._session(kind)
        try:
            return dict(runner.infer({**feeds, **self._extra}, check_inputs=False))
        except Exception as exc:
            if allocation_failure(exc):
                rows = f" at batch {feeds['input_ids'].shape[0]}" if "input_ids" in feeds else ""
                raise memory_error(exc, f"{self._paths[kind]}: a run{rows}") from None
            raise

    def _session(self, kind: GraphKind) -> Any:
        """``kind``'s session, opened after the open ones are closed unless all their weights
        together fit ``KEEP_OPEN_BYTES``."""
        from polygraphy.backend.onnxrt import OnnxrtRunner

        path = self._paths[kind]
        if kind not in self._traits:
            self._traits[kind] = _GraphTraits.of(path)
        traits = self._traits[kind]
        if sum(self._traits[k].weight_bytes for k in (*self._open, kind)) > KEEP_OPEN_BYTES:
            self._close()
        session = ort_session(
            path,
            threads=self._threads,
            # the CPU provider's fp16 casts (``ort_session``): CUDA runs fp16 MatMuls on fp16 kernels,
            # with the graph optimizations on
            fp16_weights_stay_fp16=traits.fp16_weights and not self._device.cuda,
            weight_only_dq=True,
            qdq_as_written=traits.quantizes,
            providers=self._device.providers,
            memory_arena=False,  # parity's sessions hold their weights, not every run's largest buffers
            prepack=kind is GraphKind.DECODE or not traits.float_weights,
        )
        runner = OnnxrtRunner(session, name=f"onnxruntime:{kind.value}")
        runner.activate()
        self._open[kind] = runner
        return runner

    def _close(self) -> None:
        if not self._open:
            return
        while self._open:
            self._open.popitem()[1].deactivate()
        return_freed_memory()  # the closed sessions' prepacked weights, not kept for the next (``runners.heap``)


@dataclasses.dataclass(frozen=True)
class _GraphTraits:
    """What a graph's session options depend on, read from the graph file alone (its weights stay
    on disk): whether it holds fp16 weights (``fp16_weights_stay_fp16``), whether it quantizes
    activations (a QuantizeLinear: int8, fp8; ``qdq_as_written``), whether every weight it reads
    from its external files is fp32 (``prepack``); and the bytes of its weights (its file and the
    external files it reads), what its session holds about as much of."""

    fp16_weights: bool
    quantizes: bool
    weight_bytes: int
    float_weights: bool = False

    @classmethod
    def of(cls, graph: Path) -> _GraphTraits:
        import onnx

        model = onnx.load(str(graph), load_external_data=False)
        return cls(
            fp16_weights=any(
                i.data_type == onnx.TensorProto.FLOAT16 and i.data_location == onnx.TensorProto.EXTERNAL
                for i in model.graph.initializer
            ),
            quantizes=any(node.op_type == "QuantizeLinear" for node in model.graph.node),
            weight_bytes=graph.stat().st_size
            + sum(path.stat().st_size for path in external_files(graph, model).values()),
            float_weights=all(
                i.data_type == onnx.TensorProto.FLOAT
                for i in model.graph.initializer
                if i.data_location == onnx.TensorProto.EXTERNAL
            ),
        )
