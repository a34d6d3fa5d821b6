"""Inputs for any ONNX decoder graph, built from the graph's own declared inputs and dim names.

``kiln bench`` times kiln's graphs beside other tools' exports (Optimum, ONNX Runtime GenAI's
model builder), which name their dims differently (``batch`` / ``batch_size``, ``past_seq`` /
``past_sequence_length``, ``past_sequence_length + 1``, ...). Rather than one feed function per
tool, every symbolic dim is resolved from a few sizes (batch, new tokens, past, encoder length),
and every input gets a value by its role (token ids, mask, positions, anything else float),
so a graph with new inputs (cross-attention's ``encoder_hidden_states``) still gets feeds.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kiln.errors import BenchError
from kiln.exporter.contract.static_cache import machine_memory

__all__ = ["InputDecl", "Sizes", "build_feeds", "declared_inputs", "resolve_dim"]


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes a benchmark call is made at; ``capacity`` is the KV buffer length of graphs that
    share one buffer between past and present (ONNX Runtime GenAI's ``past_present_share_buffer``)."""

    seq: int  # new tokens this call
    past: int  # tokens already in the cache
    batch: int = 1
    encoder: int = 64  # encoder_seq of cross-attention models (at least 1: their graphs are traced for 1..max_context)
    capacity: int | None = None  # None: past inputs hold exactly ``past`` tokens
    named: tuple[tuple[str, int], ...] = ()  # tool-specific dims with a fixed size (GenAI's kv_cache_dim = head size)

    @property
    def total(self) -> int:
        return self.past + self.seq


# Dim names of kiln, Optimum (torch.onnx) and the GenAI builder, lower-cased, spaces removed.
_BATCH = {"batch", "batch_size", "n", "b"}
_SEQ = {"seq", "seq_len", "sequence", "sequence_length", "decoder_sequence_length", "num_tokens"}
_PAST = {"past_seq", "past_seq_len", "past_sequence_length", "past_decoder_sequence_length"}
_TOTAL = {
    "total_seq",
    "total_seq_len",
    "total_sequence_length",
    "attention_mask_sequence_length",
    "past_sequence_length+sequence_length",
}
_ENCODER = {"encoder_seq", "encoder_sequence_length", "encoder_seq_len", "encoder_sequence_length_out"}
_CAPACITY = {"max_seq_len", "max_sequence_length", "max_length"}


def resolve_dim(dim: str | int | None, sizes: Sizes, *, kv_buffer: bool = False, where: str = "") -> int:
    """The size of one declared dim. ``kv_buffer``: the dim is the sequence axis of a past
    key/value input (it is ``capacity`` for shared-buffer graphs)."""
    if isinstance(dim, int):
        return dim
    if dim is None or dim == "":
        raise BenchError(f"{where}: a dim has neither a size nor a name; cannot build feeds for it")
    name = dim.lower().replace(" ", "")
    named = dict(sizes.named)
    if dim in named:
        return named[dim]
    if "+" in name:  # torch.onnx writes e.g. "past_sequence_length + 1"
        if name in _TOTAL:
            return sizes.total
        return sum(
            int(p) if p.isdigit() else resolve_dim(p, sizes, kv_buffer=kv_buffer, where=where) for p in name.split("+")
        )
    if name in _BATCH:
        return sizes.batch
    if name in _SEQ:
        return sizes.seq
    if name in _PAST:
        return sizes.capacity if (kv_buffer and sizes.capacity is not None) else sizes.past
    if name in _TOTAL:
        return sizes.capacity if (kv_buffer and sizes.capacity is not None) else sizes.total
    if name in _ENCODER:
        return sizes.encoder
    if name in _CAPACITY:
        return sizes.capacity if sizes.capacity is not None else sizes.total
    raise BenchError(
        f"{where}: unknown dim name {dim!r}; known: batch, seq, past_seq, total_seq, encoder_seq and their "
        "Optimum/GenAI spellings"
    )


@dataclasses.dataclass(frozen=True)
class InputDecl:
    name: str
    dtype: np.dtype
    dims: tuple[str | int | None, ...]


_ORT_TYPES = {
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(bool)": np.bool_,
}


def declared_inputs(session: Any) -> list[InputDecl]:
    """The inputs an ONNX Runtime session declares (name, numpy dtype, dims as declared)."""
    out = []
    for arg in session.get_inputs():
        if arg.type not in _ORT_TYPES:
            raise BenchError(f"input {arg.name}: type {arg.type} is not supported by the feed builder")
        out.append(InputDecl(arg.name, np.dtype(_ORT_TYPES[arg.type]), tuple(arg.shape)))
    return out


_IDS = re.compile(r"(^|_)input_ids$")
_MASK = re.compile(r"attention_mask$")
_POS = re.compile(r"position_ids$")
_WRITES = re.compile(r"^write_indices$")
_KV = re.compile(r"(past|cache|key|value)", re.IGNORECASE)


def _shape(decl: InputDecl, sizes: Sizes, roles: Mapping[str, str]) -> tuple[int, ...]:
    kv = (roles.get(decl.name) or _role(decl.name)) == "other" and bool(_KV.search(decl.name))
    return tuple(resolve_dim(d, sizes, kv_buffer=kv, where=f"input {decl.name}") for d in decl.dims)


def _require_memory(needed: int, sizes: Sizes) -> None:
    """Refuse feeds that cannot fit, before allocating them (``--past 100000000`` asked for 47.7 GiB of
    past keys and values): at most half the machine's memory, the graphs and the session need the rest."""
    total = machine_memory()  # the export's static-cache rule uses the same figure
    if needed > total // 2:
        raise BenchError(
            f"the inputs of one call at past {sizes.past}, {sizes.seq} new tokens need {needed / 2**30:.1f} GiB,"
            f" more than half of this machine's {total / 2**30:.1f} GiB of memory; choose a smaller --past or "
            "--prefill-seq"
        )


def build_feeds(
    inputs: Iterable[InputDecl],
    sizes: Sizes,
    *,
    vocab: int = 2,
    roles: Mapping[str, str] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Feeds for one call at ``sizes``: token ids in ``[0, vocab)``, an all-ones mask, positions
    ``past .. past+seq-1``, and small random normals for every other float input (past keys and
    values, encoder states). ``roles`` maps input names to ``input_ids``/``attention_mask``/
    ``position_ids`` for graphs whose names differ (GenAI's config names them)."""
    rng = np.random.default_rng(seed)
    roles = dict(roles or {})
    decls = list(inputs)
    shapes = {decl.name: _shape(decl, sizes, roles) for decl in decls}
    _require_memory(sum(math.prod(shapes[decl.name]) * np.dtype(decl.dtype).itemsize for decl in decls), sizes)
    feeds: dict[str, np.ndarray] = {}
    for decl in decls:
        role = roles.get(decl.name) or _role(decl.name)
        shape = shapes[decl.name]
        value: np.ndarray
        if role == "input_ids":
            value = rng.integers(0, vocab, size=shape)
        elif role == "attention_mask":
            value = np.ones(shape)
        elif role == "position_ids":
            value = np.broadcast_to(np.arange(sizes.past, sizes.past + shape[-1]), shape)
        elif role == "write_indices":  # a static cache's write slot of each row (contract.static_cache): after the past
            value = np.full(shape, sizes.past)
        elif np.issubdtype(decl.dtype, np.floating):
            value = rng.standard_normal(shape) * 0.5
        else:
            raise BenchError(
                f"input {decl.name}: {decl.dtype} input with no known role (input ids, mask, positions); cannot "
                "build a value for it"
            )
        feeds[decl.name] = np.array(value, dtype=decl.dtype, order="C")  # a writable copy
    return feeds


def _role(name: str) -> str:
    if _IDS.search(name):
        return "input_ids"
    if _MASK.search(name):
        return "attention_mask"
    if _POS.search(name):
        return "position_ids"
    if _WRITES.search(name):
        return "write_indices"
    return "other"
