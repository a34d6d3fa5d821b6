"""``StaticTrtRunner``: engines of the ``--target onnx`` graphs, run in place, asked in the portable
contract as parity asks every runner.

The static-cache contract (``contract.static_cache``) makes the caller own each cache buffer and
bind it as both ``past_key_values.{i}.*`` and ``present.{i}.*``. TensorRT requires exactly that of
the ``IKVCacheUpdateLayer`` its ONNX parser makes of ``TensorScatter`` (10.15+): "The cache input
tensor and the output tensor must share the same device memory to enable in-place updates. Use
IExecutionContext::setTensorAddress to explicitly bind both tensors to the same memory address. If
different addresses are assigned, TensorRT reports an API error" (TensorRT 10.16 documentation,
docs.nvidia.com/deeplearning/tensorrt/latest/inference-library/transformers-kv-cache.html; the
operator reference, ``_static/operators/KVCacheUpdate.html``: the cache "Must be a network input
and have a static sequence length dimension", the output "Must be a network output and shares the
same device memory address with the cache input"). So polygraphy's ``TrtRunner``, which gives
every output a buffer of its own, cannot run these engines; this runner binds them itself:

- ``engine.create_execution_context()``; per step ``context.set_input_shape(name, shape)`` and
  ``context.set_tensor_address(name, ptr)`` for every input, ``context.get_tensor_shape(name)`` once
  the inputs are set for the size of ``logits``, ``set_tensor_address`` for every output (each
  ``present.{i}.*`` at its ``past_key_values.{i}.*`` buffer's address, the input each aliases by
  ``ICudaEngine.get_aliased_input_tensor``, checked when the engines open: ``build.check_in_place``),
  then ``context.execute_async_v3(stream)`` (NVIDIA/TensorRT ``python/src/infer/pyCore.cpp``,
  ``release/10.15`` and ``main`` = 11.1; typed by ``tensorrt-stubs`` 10.13).
- device memory and the stream are polygraphy's CUDA wrapper (0.53.6: ``cuda.Stream()``,
  ``cuda.DeviceArray(shape, dtype)`` with ``copy_from(host, stream)``, ``numpy()``, ``free()``),
  the one ``TrtRunner`` and ``device`` already use, so no CUDA Python package is needed.
- the feeds come from ``contract.static_cache.static_feeds``, shared with ONNX Runtime's
  ``StaticCacheRunner``: zeroed buffers of ``max_context`` slots holding the past, ``write_indices``
  the past length; each present returned is the buffer's first ``past + seq`` slots. A recurrent
  state (a hybrid's or Mamba2's ``conv``/``ssm``) is a plain input and output: its present gets a
  buffer of its own, never its past's (``targets.onnx.states``).

Written from those sources and type-checked; it has not run: kiln's development machines have no
GPU and no TensorRT (tests/gpu/test_engines.py runs it where both exist).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.errors import EngineError
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.contract.static_cache import portable_outputs, static_feeds
from kiln.exporter.engine.build import check_in_place, load_tensorrt
from kiln.exporter.engine.options import GraphSet
from kiln.exporter.engine.runner import RecordedEngines, load_engines, output_names

if TYPE_CHECKING:
    import tensorrt as trt_types

__all__ = ["StaticTrtRunner"]

Feeds = dict[str, np.ndarray]


def _shape(dims: Any) -> tuple[int, ...]:
    return tuple(int(dims[i]) for i in range(len(dims)))


class _Session:
    """One engine, its execution context and the device buffers bound to it (one per input, by
    name; each present is bound to its past's buffer, never one of its own)."""

    def __init__(self, trt: ModuleType, engine: trt_types.ICudaEngine, aliases: Mapping[str, str]) -> None:
        self._engine = engine  # the context needs its engine alive
        self._context: trt_types.IExecutionContext = engine.create_execution_context()
        self._aliases = dict(aliases)  # present.{i}.* -> past_key_values.{i}.*
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self._outputs = output_names(trt, engine)
        self._inputs = tuple(n for n in names if n not in self._outputs)
        self._dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}
        # each cache input without its batch dim ([n_kv_heads, max_context, head_dim], static), for static_feeds
        self.caches = {
            n: (_shape(engine.get_tensor_shape(n))[1:], self._dtypes[n])
            for n in self._inputs
            if n.startswith("past_key_values.")
        }
        self._buffers: dict[str, Any] = {}  # polygraphy.cuda.DeviceArray by tensor name

    def _device(self, name: str, shape: tuple[int, ...]) -> Any:
        from polygraphy import cuda  # no py.typed (Any: .ci/mypy)

        buffer = self._buffers.get(name)
        if buffer is None:
            buffer = self._buffers[name] = cuda.DeviceArray(shape=shape, dtype=self._dtypes[name])
        else:
            buffer.resize(shape)  # reallocates only when it grows
        return buffer

    def step(self, feeds: Mapping[str, np.ndarray], stream: Any) -> Feeds:
        """One execution: copy the feeds in, bind every tensor, run, copy the outputs back."""
        hosts = []  # kept until the stream is synchronized: the copies read them
        for name in self._inputs:
            host = np.ascontiguousarray(feeds[name], dtype=self._dtypes[name])
            if not self._context.set_input_shape(name, host.shape):
                raise EngineError(
                    f"TensorRT refused the shape {list(host.shape)} of {name}: outside the engine's optimization "
                    "profile?"
                )
            buffer = self._device(name, host.shape)
            buffer.copy_from(host, stream=stream)
            hosts.append(host)
            self._context.set_tensor_address(name, buffer.ptr)
        for name in self._outputs:
            if name in self._aliases:  # IKVCacheUpdateLayer: the output at its cache input's address
                buffer = self._buffers[self._aliases[name]]
            else:
                shape = _shape(self._context.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise EngineError(
                        f"TensorRT did not resolve the shape of {name} ({list(shape)}) from the input shapes"
                    )
                buffer = self._device(name, shape)
            self._context.set_tensor_address(name, buffer.ptr)
        if not self._context.execute_async_v3(stream.ptr):
            raise EngineError("TensorRT's execute_async_v3 failed (the logged error says why)")
        stream.synchronize()
        return {name: self._buffers[self._aliases.get(name, name)].numpy() for name in self._outputs}

    def free(self) -> None:
        for buffer in self._buffers.values():
            buffer.free()
        self._buffers.clear()


class StaticTrtRunner(RecordedEngines, contextlib.AbstractContextManager["StaticTrtRunner"]):
    """TensorRT engines of the ``--target onnx`` graphs over ``{kind: plan path}``, in the portable
    contract (module docstring); engines, contexts and buffers exist only while active."""

    name = "tensorrt (static cache)"
    graph_set = GraphSet.ONNX.value

    def __init__(
        self,
        engines: Mapping[GraphKind, Path],
        records: Mapping[GraphKind, Mapping[str, Any]] | None = None,
        extra_feeds: Feeds | None = None,
    ) -> None:
        super().__init__(engines, records, extra_feeds)
        self._sessions: dict[GraphKind, _Session] = {}
        self._stream: Any = None

    def __enter__(self) -> StaticTrtRunner:
        load_tensorrt()  # one clear error where it is missing
        import tensorrt as trt
        from polygraphy import cuda  # no py.typed (Any: .ci/mypy)

        self._keep, engines = load_engines(trt, self._paths, self._records)
        try:
            self._stream = cuda.Stream()
            for kind, engine in engines.items():
                self._sessions[kind] = _Session(trt, engine, check_in_place(trt, engine, str(self._paths[kind])))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for session in self._sessions.values():
            session.free()
        self._sessions.clear()
        if self._stream is not None:
            self._stream.free()
            self._stream = None
        self._keep.clear()

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        session = self._sessions.get(kind)
        if session is None:
            raise EngineError(f"the TensorRT runner has no active {kind.value} engine (use it inside a with block)")
        static, length = static_feeds(kind, self.feeds(feeds), session.caches)
        return portable_outputs(session.step(static, self._stream), length)
