"""The C heap's free pages handed back to the system once a runtime's session is closed.

A session's prepacked weights are many allocations that glibc's malloc serves from its heap once its
dynamic mmap threshold has risen (any freed mapped block raises it), so closing the session frees
them to malloc, not to the system: measured on the 0.5B fp32 export, 1.44 GB of the decode session's
2 GB stayed in the process and added to the next session's (docs/benchmarks.md). ``malloc_trim(0)``
returns the heap's free pages, as glibc documents it."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

__all__ = ["return_freed_memory"]


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system; nothing where the C library has no
    ``malloc_trim`` (it is glibc's: musl and macOS lack it)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        function = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if function is None:
        return None
    function.argtypes, function.restype = [ctypes.c_size_t], ctypes.c_int
    trim: Callable[[int], int] = function
    return trim
