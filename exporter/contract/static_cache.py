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
- a recurrent state (``past_key_values.{i}.conv/.ssm``, span ``state``: a state-space or hybrid
  model's) as the portable contract has it: an input of decode and model and an output of every
  graph, of its fixed shape, the step returning its replacement. It is not a buffer written in
  place: the caller binds a second buffer as its output and swaps the two each step
  (``targets.onnx.states`` says why). A model without keys (Mamba2) has no ``write_indices``.

The buffers' bytes follow from the config alone (``cache_bytes``), and so does what the export
needs for them (``oversized_reasons``, before the trace): the buffers at ``--max-batch`` (what a
runtime serving the graphs allocates), and parity's peak, ``PARITY_PEAK`` times the buffers of the
rows parity runs at once. Either past half this machine's memory is refused in one line, not met by
an allocator's failure after the trace.

``PARITY_PEAK`` is measured (issue 38; ``/usr/bin/time -v`` and psutil's RSS sampled through
``kiln export --target onnx`` of tiny models at 2000 and 150000-200000 slots, the slope taken, so
the trace and the weights, the same at every context, drop out). All of the growth is parity of the
static graphs, none is the trace (RSS per progress stage). What holds buffer-sized arrays there
(read from the code, not each measured): each step feeds new zeroed buffers (``static_feeds``), ONNX
Runtime returns presents of the buffers' size (the graphs' TensorScatter writes a copy, since
parity does not bind one OrtValue as both) and computes attention over every slot, the previous
step's presents stay alive until the next (``portable_outputs`` keeps views of them), and each of
the three graphs' sessions (a small model's stay open together: ``OrtRunner``) keeps its own arena
at its high-water mark. Per slot, against the buffers of parity's rows: 8.4x (2 layers, 4 heads, 2
KV heads, head_dim 8, 4 rows, 200000 slots; 12x at 400000), 8.5x (4 KV heads), 8.7x (head_dim 32),
15x (the first at 1 row: ``--max-batch 1``) and 17x (8 heads over 2 KV heads): not one constant,
since ONNX Runtime's arena grows in power-of-two steps and a peak lands on one step or the next.
The rule takes the largest, against half the machine: the arena asks for each step in one piece,
about as large as all it holds, and the system may refuse that piece long before the memory is
used (the issue's 1000000 slots held 7 GB of a 24 GB machine when a request failed).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from kiln.exporter.contract.io import BATCH, GraphIO, GraphKind, TensorSpec, graph_io
from kiln.exporter.contract.limits import MIN_CONTEXT
from kiln.plugins.base import DecoderSpec
from kiln.plugins.cache_layout import Span

__all__ = [
    "WRITE_INDICES", "CacheBuffers", "cache_bytes", "machine_memory", "PARITY_PEAK", "oversized_reasons", "static_io",
    "static_feeds", "portable_outputs",
]  # fmt: skip

WRITE_INDICES = "write_indices"
PARITY_PEAK = (
    17  # an export's peak over the buffers of the rows parity runs at once: the largest measured (module docstring)
)
CacheBuffers = Mapping[
    str, tuple[tuple[int, ...], np.dtype]
]  # each cache input: its shape without the batch, its dtype


def static_io(
    spec: DecoderSpec, kind: GraphKind, *, max_context: int, kv_dtype: str = "float32", last_logits_only: bool = False
) -> GraphIO:
    """The inputs and outputs of one static-cache graph, in order: the portable contract's with
    every growing cache tensor (keys, values) ``[batch, heads, max_context, width]`` and, after
    ``position_ids``, ``write_indices`` (decode, model; none where no layer has keys) and prefill's
    key/value buffers. A recurrent state (``conv``, ``ssm``: span ``state``) keeps the portable
    contract's fixed shape, an input (decode, model) and an output (every graph) of its own."""
    portable = graph_io(spec, kind, last_logits_only=last_logits_only, kv_dtype=kv_dtype)
    grown = [(i, t) for i, t in spec.cache_layout.tensors() if t.span is Span.SEQUENCE]
    buffers = {
        name: (BATCH, t.heads, max_context, t.width)
        for i, t in grown
        for name in (f"past_key_values.{i}.{t.suffix}", f"present.{i}.{t.suffix}")
    }
    ids = portable.inputs[:3]  # input_ids, attention_mask, position_ids
    writes = () if kind is GraphKind.PREFILL or not grown else (TensorSpec(WRITE_INDICES, "int64", (BATCH,)),)
    pasts = tuple(TensorSpec(t.name, t.dtype, buffers.get(t.name, t.dims)) for t in portable.inputs[3:])
    if kind is GraphKind.PREFILL:  # the key/value buffers, which prefill writes too
        pasts = tuple(
            TensorSpec(f"past_key_values.{i}.{t.suffix}", kv_dtype, buffers[f"present.{i}.{t.suffix}"])
            for i, t in grown
        )
    outputs = tuple(TensorSpec(t.name, t.dtype, buffers.get(t.name, t.dims)) for t in portable.outputs)
    return GraphIO((*ids, *writes, *pasts), outputs)


def static_feeds(
    kind: GraphKind, feeds: Mapping[str, np.ndarray], caches: CacheBuffers
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Feeds of the portable contract (a past of ``past_seq`` slots, none for prefill) as this
    contract's: each key/value past copied into a zeroed buffer of its capacity, ``write_indices``
    the past length in every row (kiln's batches are left-padded: every row writes at one slot),
    prefill's buffers zeroed; a recurrent state (a past already of its input's shape) as it is.
    Returns them and, per present to cut, the slots of it that the portable contract returns
    (``past_seq + seq``: ``portable_outputs``). Every runner of these graphs asks through this one
    function: ONNX Runtime's (``targets.onnx.runner``) and TensorRT's (``engine.static_runner``)."""
    batch, seq = feeds["input_ids"].shape
    pasts = {name: value for name, value in feeds.items() if name.startswith("past_key_values.")}
    static = {name: value for name, value in feeds.items() if name not in pasts}
    if kind is GraphKind.PREFILL:  # the graph's cache inputs (key/value buffers only), zeroed
        static.update({name: np.zeros((batch, *shape), dtype=dtype) for name, (shape, dtype) in caches.items()})
        return static, {_present(name): seq for name in caches}
    cuts, past_seq = {}, 0
    for name, past in pasts.items():
        if name in caches and tuple(past.shape[1:]) == tuple(caches[name][0]):
            static[name] = past  # a state, or a buffer given whole
            continue
        buffer = np.zeros((past.shape[0], *caches[name][0]), dtype=past.dtype)
        buffer[:, :, : past.shape[2]] = past
        static[name], past_seq = buffer, past.shape[2]
        cuts[_present(name)] = past.shape[2] + seq
    if cuts:
        static[WRITE_INDICES] = np.full((batch,), past_seq, dtype=np.int64)
    return static, cuts


def _present(past: str) -> str:
    return past.replace("past_key_values.", "present.", 1)


def portable_outputs(outputs: Mapping[str, np.ndarray], cuts: Mapping[str, int]) -> dict[str, np.ndarray]:
    """A step's outputs in the portable contract: each buffer's present cut to its first ``cuts[name]``
    slots (``static_feeds``); the rest (logits, a recurrent state) as they are."""
    return {name: value[:, :, : cuts[name]] if name in cuts else value for name, value in outputs.items()}


def cache_bytes(spec: DecoderSpec, *, batch: int, max_context: int, kv_dtype: str) -> int:
    """The bytes of the static cache's buffers at ``batch`` rows: one ``[batch, heads, max_context,
    width]`` buffer per growing cache tensor (a key and a value per attention layer; a recurrent
    state's fixed size is not a buffer of ``max_context`` slots)."""
    per_slot = sum(t.heads * t.width for _, t in spec.cache_layout.tensors() if t.span is Span.SEQUENCE)
    return per_slot * batch * max_context * np.dtype(kv_dtype).itemsize


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


def oversized_reasons(
    spec: DecoderSpec, *, max_batch: int, parity_rows: int, max_context: int, kv_dtype: str
) -> list[str]:
    """Why a static cache does not fit this machine (asked before anything is traced): its
    buffers at ``max_batch`` rows, or parity's peak at its ``parity_rows`` rows (``PARITY_PEAK`` times
    their buffers), past half this machine's memory (module docstring). The figures are the config's."""
    limit, row = machine_memory() // 2, cache_bytes(spec, batch=1, max_context=max_context, kv_dtype=kv_dtype)
    if not row:
        return []  # no key/value buffer: a state-space model's recurrent state is of fixed size
    fits = max(
        MIN_CONTEXT, max_context * limit // (max(max_batch, PARITY_PEAK * parity_rows) * row)
    )  # the longest that passes both
    machine = f"more than half this machine's memory ({limit} bytes, {limit / 2**30:.1f} GiB)"
    figures = (
        f"{spec.n_layers} layers x 2 (key, value) x {spec.n_kv_heads} KV heads x {max_context} slots x {spec.head_dim}"
        f" x {np.dtype(kv_dtype).itemsize} bytes ({kv_dtype})"
    )
    if (need := max_batch * row) > limit:
        return [
            f"--max-context {max_context}: the static KV cache of --target onnx takes {max_batch} rows "
            f"(--max-batch) x {figures}"
            f" = {need} bytes ({need / 2**30:.1f} GiB), {machine}; pass --max-context {fits} or less, or a "
            "smaller --max-batch"
        ]
    if (need := PARITY_PEAK * parity_rows * row) > limit:
        return [
            f"--max-context {max_context}: the export's parity runs the static KV cache of --target onnx at "
            f"{parity_rows} row{'s' if parity_rows != 1 else ''} of"
            f" {figures} = {row} bytes each, and needs about {PARITY_PEAK}x those buffers (ONNX Runtime's copies "
            "of them and its"
            f" attention over every slot, measured) = {need} bytes ({need / 2**30:.1f} GiB), {machine}; pass "
            f"--max-context {fits} or less"
        ]
    return []
