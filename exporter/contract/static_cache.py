"""The static-cache I/O contract of ``--target onnx`` (docs/commands.md, kiln export): a KV cache
that is one buffer per layer of fixed capacity, written in place.

Every graph of the set (prefill, decode, model) reads and writes the cache the same way:

- ``past_key_values.{i}.key/.value`` ``[batch, n_kv_heads, max_context, head_dim]``: the
  caller's buffers, **static** in their sequence dim (``max_context``, the export's limit), in
  the graphs' float dtype. The caller owns them: it allocates them once per sequence (zeros:
  an unused slot must be finite, NaN would leak through any mask) and binds each as both the
  past input and the ``present.{i}.key/.value`` output of every step, so the step writes into it
  (TensorScatter; TensorRT's ``IKVCacheUpdateLayer`` requires the two to share one address, ONNX
  Runtime copies the whole buffer unless they are one OrtValue). Prefill takes them too: its
  prompt's keys and values land in slots ``0 .. seq - 1``.
- ``write_indices`` ``[batch]`` int64 (decode and model; prefill writes at 0): the slot of each
  row's first new token. Row ``b`` writes its ``seq`` new keys/values to slots ``write_indices[b]
  .. write_indices[b] + seq - 1`` and its query ``s`` sees slot ``j`` when ``j <= write_indices[b]
  + s`` and ``attention_mask[b, j]`` is 1 (its own slot always). Keep ``write_indices[b] + seq <=
  max_context``: ONNX Runtime refuses the step, TensorRT drops the write silently.
- ``attention_mask`` ``[batch, total_seq]``: 1 for a slot that holds a real token, slots
  ``0 .. total_seq - 1`` (``total_seq <= max_context``, the rest is taken as 0). For kiln's
  left-padded batches every row writes at the same slot, the past length, so the mask is the
  portable graphs' own; rows at different lengths (ragged) each write at their own slot.
- ``input_ids``, ``position_ids`` ``[batch, seq]`` and ``logits`` as the portable contract
  (``contract.io``); ``present.*`` have the buffers' shape.

The buffers' bytes follow from the config alone (``cache_bytes``): an export whose buffers at
``--max-batch`` exceed half this machine's memory is refused before the trace
(``refuse_oversized``), not met by an allocator's traceback in parity.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from kiln.errors import ExportError
from kiln.exporter.contract.io import BATCH, GraphIO, GraphKind, TensorSpec, graph_io, past_names, present_names
from kiln.plugins.base import DecoderSpec

__all__ = [
    "WRITE_INDICES", "CacheBuffers", "cache_bytes", "machine_memory", "refuse_oversized", "static_io", "static_feeds",
    "portable_outputs",
]  # fmt: skip

WRITE_INDICES = "write_indices"
CacheBuffers = Mapping[str, tuple[tuple[int, ...], np.dtype]]  # each cache input: its shape without the batch, its dtype


def static_io(spec: DecoderSpec, kind: GraphKind, *, max_context: int, kv_dtype: str = "float32", last_logits_only: bool = False) -> GraphIO:
    """The inputs and outputs of one static-cache graph, in order: the portable contract's with
    every cache tensor ``[batch, n_kv_heads, max_context, head_dim]`` and, after ``position_ids``,
    ``write_indices`` (decode, model) and prefill's cache inputs."""
    portable = graph_io(spec, kind, last_logits_only=last_logits_only, kv_dtype=kv_dtype)
    buffer = (BATCH, spec.n_kv_heads, max_context, spec.head_dim)
    caches = tuple(TensorSpec(name, kv_dtype, buffer) for i in range(spec.n_layers) for name in past_names(i))
    ids = portable.inputs[:3]  # input_ids, attention_mask, position_ids
    writes = () if kind is GraphKind.PREFILL else (TensorSpec(WRITE_INDICES, "int64", (BATCH,)),)
    presents = {name for i in range(spec.n_layers) for name in present_names(i)}
    outputs = tuple(TensorSpec(t.name, t.dtype, buffer) if t.name in presents else t for t in portable.outputs)
    return GraphIO((*ids, *writes, *caches), outputs)


def static_feeds(kind: GraphKind, feeds: Mapping[str, np.ndarray], caches: CacheBuffers) -> tuple[dict[str, np.ndarray], int]:
    """Feeds of the portable contract (a past of ``past_seq`` slots, none for prefill) as this
    contract's: each past copied into a zeroed buffer of its capacity, ``write_indices`` the past
    length in every row (kiln's batches are left-padded: every row writes at one slot), prefill's
    caches zeroed. Returns them and ``past_seq + seq``, the slots of each present that the portable
    contract returns (``portable_outputs``). Every runner of these graphs asks through this one
    function: ONNX Runtime's (``targets.standard.runner``) and TensorRT's (``engine.static_runner``)."""
    batch, seq = feeds["input_ids"].shape
    pasts = {name: value for name, value in feeds.items() if name.startswith("past_key_values.")}
    past_seq = next(iter(pasts.values())).shape[2] if pasts else 0
    static = {name: value for name, value in feeds.items() if name not in pasts}
    if kind is GraphKind.PREFILL:  # the graph's cache inputs, zeroed
        static.update({name: np.zeros((batch, *shape), dtype=dtype) for name, (shape, dtype) in caches.items()})
        return static, seq
    for name, past in pasts.items():
        buffer = np.zeros((past.shape[0], *caches[name][0]), dtype=past.dtype)
        buffer[:, :, : past.shape[2]] = past
        static[name] = buffer
    static[WRITE_INDICES] = np.full((batch,), past_seq, dtype=np.int64)
    return static, past_seq + seq


def portable_outputs(outputs: Mapping[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
    """A step's outputs in the portable contract: each present cut to its first ``length`` slots."""
    return {name: value[:, :, :length] if name.startswith("present.") else value for name, value in outputs.items()}


def cache_bytes(spec: DecoderSpec, *, batch: int, max_context: int, kv_dtype: str) -> int:
    """The bytes of the static cache's buffers at ``batch`` rows: a key and a value buffer per
    layer, ``[batch, n_kv_heads, max_context, head_dim]`` each."""
    return spec.n_layers * 2 * batch * spec.n_kv_heads * max_context * spec.head_dim * np.dtype(kv_dtype).itemsize


def machine_memory() -> int:
    """This machine's memory in bytes: its physical memory, or its control group's limit where
    that is lower (a container's)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            memory = min(memory, int(text))
    return memory


def refuse_oversized(spec: DecoderSpec, *, max_batch: int, max_context: int, kv_dtype: str) -> None:
    """Refuse, before anything is traced, a static cache whose buffers at ``max_batch`` rows (what a
    runtime serving the graphs allocates at their largest batch) exceed half this machine's
    memory (the graphs, their sessions and parity's copies of the buffers need the rest, as
    ``kiln bench``'s feeds leave it): the figures are the config's, and parity would otherwise die
    in the allocator after the trace (--max-context 1000000 grew to 7 GB, then a BFCArena traceback)."""
    need, limit = cache_bytes(spec, batch=max_batch, max_context=max_context, kv_dtype=kv_dtype), machine_memory() // 2
    if need > limit:
        figures = (
            f"{spec.n_layers} layers x 2 (key, value) x {max_batch} rows (--max-batch) x {spec.n_kv_heads} KV heads"
            f" x {max_context} slots x {spec.head_dim} x {np.dtype(kv_dtype).itemsize} bytes ({kv_dtype})"
        )
        raise ExportError(
            f"--max-context {max_context}: the static KV cache of --target onnx takes {figures} = {need} bytes"
            f" ({need / 2**30:.1f} GiB), more than half this machine's memory ({limit} bytes, {limit / 2**30:.1f} GiB);"
            " pass a smaller --max-context or --max-batch"
        )
