"""ONNX Runtime's allocation failures as one line (``MemoryLimitError``) instead of a traceback.

ONNX Runtime's CPU allocator (its BFC arena) reports a buffer it cannot get as an ordinary
``onnxruntime`` exception (``Fail`` from a run, ``RuntimeException`` from a session's start) whose
message names ``BFCArena`` and says "Failed to allocate memory for requested buffer of size N"
(the system refused the memory) or "Available memory of A is smaller than requested bytes of N"
(an arena limit). ``OrtRunner`` (parity, ``kiln check``) and ``ort_session`` turn them into
``MemoryLimitError`` naming the graph; ``cli`` does the same for any other ONNX Runtime run
(``kiln generate``, ``kiln bench``). Nothing here imports onnxruntime: the CLI asks it of an
exception it caught.
"""

from __future__ import annotations

import re

from kiln.errors import MemoryLimitError

__all__ = ["allocation_failure", "memory_error"]

_MARKERS = ("BFCArena", "Failed to allocate memory", "std::bad_alloc")
_REQUESTED = re.compile(r"(?:requested buffer of size|requested bytes of) (\d+)")


def allocation_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is ONNX Runtime's report of a buffer its allocator could not get."""
    return type(exc).__module__.startswith("onnxruntime") and any(marker in str(exc) for marker in _MARKERS)


def memory_error(exc: BaseException, what: str) -> MemoryLimitError:
    """One line for ``allocation_failure(exc)``: what ran out of memory, the bytes it asked for, the
    machine's memory, and what to ask for instead."""
    from kiln.exporter.contract.static_cache import machine_memory

    found = _REQUESTED.search(str(exc))
    asked = (
        f" a buffer of {int(found.group(1))} bytes ({int(found.group(1)) / 2**30:.1f} GiB)" if found else " a buffer"
    )
    memory = machine_memory()
    return MemoryLimitError(
        f"{what}: ONNX Runtime could not allocate{asked}: out of memory (this machine has {memory / 2**30:.1f} GiB);"
        " ask for less (a smaller --max-context, --max-batch, batch or --past) or run on a machine with more memory"
    )
