"""How ``kiln generate`` carries the KV cache between steps (``runtime.generate``'s IOBinding
loop): grown by the graph each step (the portable graphs), one buffer written in place by the
attention (``--target ort``), or the graphs' own static buffers (``--target onnx``). Each export
target's manifest says which (``targets.<name>.kv_cache``: ``contract.io.CacheUpdate``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.exporter.artifacts.manifest import Manifest
from kiln.exporter.contract.io import CacheUpdate, GraphKind, is_cross, kv_pairs
from kiln.exporter.contract.static_cache import WRITE_INDICES
from kiln.runtime.decoder_dirs import shares_kv_buffer

__all__ = ["ConcatKv", "KvStrategy", "SharedKv", "StaticKv", "kv_strategy"]


class KvStrategy:
    """How KV tensors move from one step's outputs to the next step's inputs."""

    def __init__(self, n_layers: int, cross: bool = False, pairs: list[tuple[str, str]] | None = None) -> None:
        self._pairs = self.pairs = pairs if pairs is not None else kv_pairs(n_layers, cross=cross)
        self.presents = [present for _, present in self._pairs]  # prefill's, bound after ``logits``, in this order
        self.step_presents = [
            present for past, present in self._pairs if not is_cross(past)
        ]  # decode's (the cross cache never grows)

    def start(self, prefill: dict[str, Any], capacity: int) -> None:
        """Take the prompt's presents (OrtValues by name) before the first decode step."""

    def bind(self, binding: Any, feeds: Mapping[str, Any]) -> None:
        """Bind past inputs (the step's ``feeds``: OrtValues carried from the last step) and present outputs."""
        raise NotImplementedError


class ConcatKv(KvStrategy):
    """For graphs that grow the cache with Concat: the runtime allocates each step's presents
    (total length); they are bound, as OrtValues, as the next step's pasts."""

    def bind(self, binding: Any, feeds: Mapping[str, Any]) -> None:
        for past, present in self._pairs:
            binding.bind_ortvalue_input(past, feeds[past])
            if not is_cross(past):
                binding.bind_output(present, "cpu")


class SharedKv(KvStrategy):
    """For decode graphs whose attention writes the new key/value in place (the ``--target ort``
    graphs' GroupQueryAttention: it writes row ``total - 1`` and reads rows ``< total`` of a
    past buffer of any capacity, and aliases present to past when both are bound to one buffer):
    one ``[1, n_kv, capacity, head_dim]`` buffer per cache tensor, filled from the prompt's
    presents once and then bound as both input and output of every step (bound once: an
    IOBinding keeps its bindings between runs)."""

    def __init__(self, n_layers: int) -> None:
        super().__init__(n_layers)
        self._buffers: dict[str, Any] = {}
        self._bound: Any = None

    def start(self, prefill: dict[str, Any], capacity: int) -> None:
        from onnxruntime import OrtValue

        for past, present in self._pairs:
            prompt = prefill[present].numpy()  # [1, n_kv, n, head_dim]
            buffer = np.zeros((*prompt.shape[:2], capacity, prompt.shape[3]), dtype=prompt.dtype)
            buffer[:, :, : prompt.shape[2]] = prompt
            self._buffers[past] = OrtValue.ortvalue_from_numpy(buffer)
        self._bound = None

    def bind(self, binding: Any, feeds: Mapping[str, Any]) -> None:
        if binding is self._bound:
            return
        for past, present in self._pairs:
            binding.bind_ortvalue_input(past, self._buffers[past])
            binding.bind_ortvalue_output(present, self._buffers[past])
        self._bound = binding


class StaticKv(KvStrategy):
    """For static-cache graphs (``--target onnx``: ``contract.static_cache``): one zeroed
    ``[1, heads, max_context, width]`` buffer per key/value tensor, made for each prompt and bound
    as both the past input and the present output of the prompt's step and of every decode step,
    so each step's TensorScatter writes its token into it in place (never a copy); each decode
    step writes at ``write_indices`` = the tokens before it. A recurrent state (``states``: a
    hybrid's or a state-space model's ``conv``/``ssm``) is a plain input and output of the graphs,
    which must not share a buffer (``targets.onnx.states``): two buffers of its fixed shape, the
    prompt's step writing the first, each decode step reading one and writing the other."""

    def __init__(
        self, pairs: list[tuple[str, str]], shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]], states: set[str]
    ) -> None:
        super().__init__(0, pairs=pairs)
        self._shapes, self._states = dict(shapes), set(states)  # by past name; batch 1
        self._buffers: dict[str, Any] = {}
        self._pingpong: dict[str, tuple[Any, Any]] = {}
        self._turn = 0  # which of a state's two buffers holds the state the next step reads
        self._bound: Any = None

    def bind_prompt(self, binding: Any) -> None:
        from onnxruntime import OrtValue

        def zeros(past: str) -> Any:
            shape, dtype = self._shapes[past]
            return OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype))

        self._buffers = {past: zeros(past) for past, _ in self._pairs if past not in self._states}
        self._pingpong = {past: (zeros(past), zeros(past)) for past, _ in self._pairs if past in self._states}
        self._bound, self._turn = None, 0
        for past, present in self._pairs:  # in the pairs' order: the order the prompt's outputs are read in
            if past in self._states:
                binding.bind_ortvalue_output(present, self._pingpong[past][0])  # prefill takes no state
            else:
                binding.bind_ortvalue_input(past, self._buffers[past])
                binding.bind_ortvalue_output(present, self._buffers[past])

    def bind(self, binding: Any, feeds: Mapping[str, Any]) -> None:
        if self._buffers:
            past = feeds["attention_mask"].shape[1] - feeds["input_ids"].shape[1]
            binding.bind_cpu_input(WRITE_INDICES, np.array([past], dtype=np.int64))
        first = binding is not self._bound
        for past, present in self._pairs:
            if past in self._states:  # read one buffer, write the other (rebinding keeps the output's place)
                binding.bind_ortvalue_input(past, self._pingpong[past][self._turn])
                binding.bind_ortvalue_output(present, self._pingpong[past][1 - self._turn])
            elif first:
                binding.bind_ortvalue_input(past, self._buffers[past])
                binding.bind_ortvalue_output(present, self._buffers[past])
        self._turn, self._bound = (1 - self._turn if self._pingpong else 0), binding

    @property
    def buffers(self) -> dict[str, Any]:
        """The key/value buffers by past name (tests check they are what every step wrote into)."""
        return dict(self._buffers)

    @property
    def states(self) -> dict[str, Any]:
        """Each recurrent state's buffer that holds it after the last step, by past name."""
        return {past: pair[self._turn] for past, pair in self._pingpong.items()}


def _static_kv(manifest: Manifest, target: str) -> StaticKv:
    """The buffers of ``target``'s static-cache graphs, shaped as its decode graph declares them (batch 1)."""
    decode = (manifest.targets or {})[target].graphs[GraphKind.DECODE.value]
    shapes = {
        t.name: ((1, *(int(d) for d in t.shape[1:])), np.dtype(t.dtype))
        for t in decode.inputs or ()
        if t.name.startswith("past_key_values.")
    }
    states = {f"past_key_values.{t.layer}.{t.name}" for t in manifest.kv_cache.tensors or () if t.span == "state"}
    return StaticKv(_listed_pairs(manifest) or kv_pairs(manifest.model.n_layers), shapes, states)


def kv_strategy(manifest: Manifest, target: str | None) -> KvStrategy:
    """The strategy the export's graphs of ``target`` (None: the portable ones) need."""
    n_layers = manifest.model.n_layers
    entry = (manifest.targets or {}).get(target) if target is not None else None
    if entry is not None and entry.kv_cache == CacheUpdate.STATIC.value:
        return _static_kv(manifest, target or "")
    if target is not None and shares_kv_buffer(manifest, target):
        return SharedKv(n_layers)
    return ConcatKv(n_layers, cross=manifest.model.has_encoder, pairs=_listed_pairs(manifest))


def _listed_pairs(manifest: Manifest) -> list[tuple[str, str]] | None:
    """The ``(past, present)`` names of a cache the manifest lists tensor by tensor (a recurrent
    state's ``conv``/``ssm``), else None (keys and values: ``kv_pairs``)."""
    listed = manifest.kv_cache.tensors
    if listed is None:
        return None
    return [(f"past_key_values.{t.layer}.{t.name}", f"present.{t.layer}.{t.name}") for t in listed]
