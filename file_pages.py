"""A checkpoint's weight pages handed back once read: kept in the page cache, out of the process.

transformers maps a safetensors checkpoint's tensors from the file (private, copy-on-write
mappings) when their dtype is the file's: a bf16 checkpoint's weights are the file's pages. Every
page a stage reads stays mapped, and counts in the process's resident memory, until the model is
freed: at 8B (16 GB of bf16 weights) the checkpoint's pages alone were most of the int4 export's
peak, beside the quantizer's numbers and a runtime's session (docs/benchmarks.md). Reading the
weights once per stage does not need them resident between reads: ``release_file_pages`` unmaps a
tensor's pages that still hold the file's bytes (``madvise(MADV_DONTNEED)``, Linux's documented
semantics for a private file mapping: the next read maps the file's page again, from the page cache
while the system has memory for it, else from the disk).

Only pages that are the file's own are released: ``/proc/self/pagemap`` marks a page a write has
made private (an in-place change to a weight, e.g. a merged LoRA adapter) as anonymous, and such a
page is kept, as is any page of anonymous memory (a weight converted to fp32, a tensor kiln
computed): releasing those would lose their contents. Nothing is released where the kernel offers
no pagemap or madvise (not Linux). The pages are read and released by the one thread that reads the
weights (a concurrent write into a released range is the only race, and kiln writes no checkpoint
weight after the load's adapters are merged)."""

from __future__ import annotations

import ctypes
import functools
import itertools
import mmap
from collections.abc import Callable, Iterable
from typing import BinaryIO

import numpy as np
import torch

__all__ = ["release_file_pages", "release_module_pages"]

_PAGE = mmap.PAGESIZE
# a pagemap entry's bits 63 (present) and 61 (file-page or shared-anon): Documentation/admin-guide/mm/pagemap.rst
_FILE_PRESENT = np.uint64((1 << 63) | (1 << 61))
_MADV_DONTNEED = 4
_SPAN = 1 << 18  # pagemap entries read at a time (2 MiB of them: 1 GiB of memory)


def release_file_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Unmap the pages of ``tensors``' CPU memory that still hold their file's bytes; returns the
    bytes released (0 where the system cannot say which pages those are). No other thread may write
    that memory meanwhile: a page it made its own between the pagemap's read and the ``madvise``
    would be dropped with its write (reads, such as the weights writer's thread, are safe)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    released = 0
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
            for start, end in _page_ranges(tensors):
                released += _release(pagemap, madvise, start, end)
    except OSError:
        return released
    return released


def release_module_pages(module: torch.nn.Module) -> int:
    """``release_file_pages`` of every parameter and buffer of ``module``."""
    return release_file_pages(itertools.chain(module.parameters(), module.buffers()))


def _page_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The pages of the memory each CPU tensor spans (not its storage's: a checkpoint file's tensors
    may share one), merged where they touch; tied weights once. A page the tensor shares with its
    neighbour is included: releasing a file's page is safe whoever reads it next."""
    ranges: set[tuple[int, int]] = set()
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.numel() == 0:
            continue
        pointer = tensor.data_ptr()
        span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
        ranges.add((pointer // _PAGE * _PAGE, -(-(pointer + span * tensor.element_size()) // _PAGE) * _PAGE))
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _release(pagemap: BinaryIO, madvise: Callable[[int, int, int], int], start: int, end: int) -> int:
    """Release the file's pages of ``[start, end)``: each run of present file-backed pages, one
    ``madvise`` a run."""
    released = 0
    for first in range(start, end, _SPAN * _PAGE):
        count = min(_SPAN, (end - first) // _PAGE)
        pagemap.seek(first // _PAGE * 8)
        entries = np.frombuffer(pagemap.read(8 * count), dtype=np.uint64)
        ours = np.concatenate(([False], (entries & _FILE_PRESENT) == _FILE_PRESENT, [False]))
        edges = np.flatnonzero(ours[1:] != ours[:-1])  # each run's first page, then the page after it
        for run_start, run_end in zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True):
            if madvise(first + run_start * _PAGE, (run_end - run_start) * _PAGE, _MADV_DONTNEED) == 0:
                released += (run_end - run_start) * _PAGE
    return released


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise``, where ``/proc/self/pagemap`` says which pages are a file's (Linux)."""
    try:
        with open("/proc/self/pagemap", "rb"):
            pass
        function = ctypes.CDLL(None, use_errno=True).madvise  # the process's own symbols: the C library's
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    advise: Callable[[int, int, int], int] = function
    return advise
