"""Runners: one small interface over every backend that executes kiln's graphs.

A runner executes one graph of the contract on a feed dict of numpy arrays and returns its
outputs by name. ``TorchRunner`` runs the PyTorch model itself (the reference);
``OrtRunner`` runs the exported ONNX files through polygraphy's ONNX Runtime runner. The
parity code drives any runner the same way, so a TensorRT runner drops in beside them.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn

from kiln.exporter.io_contract import ENCODER_STATES, GraphKind, cross_past_names, cross_present_names, past_names, present_names
from kiln.exporter.trace import GraphModule

__all__ = ["Runner", "TorchRunner", "OrtRunner", "RecordingRunner", "Feeds"]

Feeds = dict[str, np.ndarray]


class Runner(Protocol):
    name: str

    def graphs(self) -> tuple[GraphKind, ...]:
        """The graphs this runner can execute."""
        ...

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds: ...


class TorchRunner:
    """The PyTorch model, called through the same flat contract the graphs were traced from."""

    name = "torch"

    def __init__(self, module: nn.Module, n_layers: int, last_logits_only: bool = False) -> None:
        self._module, self._n_layers, self._last = module, n_layers, last_logits_only
        self._wrappers: dict[tuple[GraphKind, bool], GraphModule] = {}

    def graphs(self) -> tuple[GraphKind, ...]:
        return tuple(GraphKind)

    @torch.no_grad()
    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        # a cross-attention decoder shows itself by its inputs: encoder states or a cross cache
        cross = ENCODER_STATES in feeds or cross_past_names(0)[0] in feeds
        if (kind, cross) not in self._wrappers:  # built once: kiln bench times this call
            self._wrappers[kind, cross] = GraphModule(self._module, kind, self._n_layers, self._last, cross).eval()
        wrapper = self._wrappers[kind, cross]
        ids, mask, pos = (torch.from_numpy(feeds[n]) for n in ("input_ids", "attention_mask", "position_ids"))
        # the reference computes in fp32 whatever the graphs' float I/O dtype
        extra: torch.Tensor | list[torch.Tensor] | None
        if kind is GraphKind.PREFILL:
            extra = torch.from_numpy(feeds[ENCODER_STATES]).float() if cross else None
        else:
            names = [n for i in range(self._n_layers) for n in (*past_names(i), *(cross_past_names(i) if cross else ()))]
            extra = [torch.from_numpy(feeds[n]).float() for n in names]
        outs = wrapper(ids, mask, pos, extra)
        names = ["logits"]
        for i in range(self._n_layers):
            names += [*present_names(i), *(cross_present_names(i) if cross and kind is GraphKind.PREFILL else ())]
        return {n: t.numpy() for n, t in zip(names, outs, strict=True)}


class RecordingRunner:
    """Records another runner's outputs by graph and inputs; once frozen it only replays them,
    so the runner it wraps (and the model behind it) can be released."""

    def __init__(self, inner: Runner) -> None:
        self.name = inner.name
        self._inner: Runner | None = inner
        self._graphs = inner.graphs()
        self._recorded: dict[bytes, Feeds] = {}

    def graphs(self) -> tuple[GraphKind, ...]:
        return self._graphs

    @staticmethod
    def _key(kind: GraphKind, feeds: Feeds) -> bytes:
        h = hashlib.sha256(kind.value.encode())
        for name in sorted(feeds):
            array = np.ascontiguousarray(feeds[name])
            h.update(f"{name}:{array.dtype}:{array.shape}".encode())
            h.update(array.tobytes())
        return h.digest()

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        key = self._key(kind, feeds)
        if key not in self._recorded:
            if self._inner is None:
                raise RuntimeError(f"no recorded {self.name} output for these {kind.value} inputs (the recording is frozen)")
            self._recorded[key] = self._inner.run(kind, feeds)
        return self._recorded[key]

    def freeze(self) -> None:
        self._inner = None


class OrtRunner(contextlib.AbstractContextManager["OrtRunner"]):
    """ONNX Runtime (CPU) over ``{kind: path}``; sessions exist only while the runner is active."""

    name = "onnxruntime"

    def __init__(self, paths: dict[GraphKind, Path], threads: int | None = None, extra_feeds: Feeds | None = None) -> None:
        self._paths = paths
        self._extra = dict(extra_feeds or {})  # inputs fed to every run (e.g. PLE tables)
        self._threads = threads
        self._runners: dict[GraphKind, object] = {}
        self._shared = _SharedInitializers()

    def graphs(self) -> tuple[GraphKind, ...]:
        return tuple(self._paths)

    def __enter__(self) -> OrtRunner:
        import onnxruntime as ort
        from polygraphy.backend.onnxrt import OnnxrtRunner

        for kind, path in self._paths.items():
            opts = ort.SessionOptions()
            if self._threads:
                opts.intra_op_num_threads = self._threads
            opts.log_severity_level = 3
            # one memory-mapped copy of the weights for all sessions, not one copy each;
            # prepacking would make a private copy of every MatMul weight again
            opts.add_session_config_entry("session.disable_prepacking", "1")
            for name, value in self._shared.initializers(path).items():
                opts.add_initializer(name, value)
            session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
            runner = OnnxrtRunner(session, name=f"onnxruntime:{kind.value}")
            runner.activate()
            self._runners[kind] = runner
        return self

    def __exit__(self, *exc: object) -> None:
        for runner in self._runners.values():
            runner.deactivate()  # type: ignore[attr-defined]
        self._runners.clear()
        self._shared = _SharedInitializers()

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        runner = self._runners[kind]
        return dict(runner.infer({**feeds, **self._extra}, check_inputs=False))  # type: ignore[attr-defined]


class _SharedInitializers:
    """OrtValues over memory maps of the external weights files, one per distinct initializer
    name. kiln's graphs name each weight identically in every graph (``weights/...``), so the
    sessions of prefill, decode and model.onnx read the same pages instead of three copies."""

    def __init__(self) -> None:
        self._maps: dict[Path, np.memmap] = {}
        self._values: dict[tuple[Path, str], object] = {}

    def initializers(self, graph: Path) -> dict[str, object]:
        import onnx
        from onnx.helper import tensor_dtype_to_np_dtype
        from onnxruntime import OrtValue

        model = onnx.load(str(graph), load_external_data=False)
        out: dict[str, object] = {}
        for init in model.graph.initializer:
            if init.data_location != onnx.TensorProto.EXTERNAL:
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
        return out
