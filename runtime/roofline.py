"""The memory roofline of a decode step: weight bytes read per step over the machine's read bandwidth.

At batch 1 a decode step reads every weight once and does ~2 flops per weight byte-ish, so on a
CPU it is bound by memory bandwidth: ``weights_bytes / bandwidth`` is the fastest it can be.
Reporting ``limit / measured`` says how much of that a graph achieves, independently of how
noisy the absolute numbers are.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kiln.exporter.progress import Stage

__all__ = ["BandwidthProbe", "read_bandwidths", "weights_bytes_per_step"]


class BandwidthProbe:
    """One call reads a ``mib`` MiB array (8x the 32 MiB L3 of the development machine, so DRAM)
    with ``threads`` threads, like a 2-thread runtime; numpy releases the GIL in reductions.
    ``max`` over float32, not ``sum``: numpy's pairwise float sum is compute-bound near 18 GB/s
    on the development machine, where ``max`` (SIMD) reaches 30+ GB/s, the memory's limit.
    Timed interleaved with the decode steps, its median is the bandwidth under the same load
    as theirs, which is what a roofline fraction on a shared machine must be divided by."""

    def __init__(self, threads: int = 2, mib: int = 256) -> None:
        self._data = np.ones(mib * 2**20 // 4, dtype=np.float32)
        self._chunks = np.array_split(self._data, threads)
        self._pool = ThreadPoolExecutor(threads)
        self()  # touch every page once

    @property
    def nbytes(self) -> int:
        return int(self._data.nbytes)

    def __call__(self) -> None:
        list(self._pool.map(np.max, self._chunks))

    def alone(self, repeats: int, pause: float, stage: Stage | None = None) -> list[float]:
        """The seconds of ``repeats`` calls with nothing else timed between them, after an untimed
        one (a cold first call measures no memory), each followed by ``pause`` as among the decode
        steps. The best of 15 calls straight in a row was no peak: they fill a tenth of a second,
        which one burst of other work on a shared machine takes whole (on the development machine
        a whole series of 15 ran at 16-19 GB/s where the paused calls reached 28), so ``kiln bench``
        printed a best below its median. ``read_bandwidths`` takes the best over these and the
        interleaved calls."""
        self()
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            self()
            seconds.append(time.perf_counter() - start)
            time.sleep(pause)
            if stage is not None:
                stage.advance()
        return seconds

    def close(self) -> None:
        self._pool.shutdown()


def read_bandwidths(nbytes: int, interleaved: Sequence[float], alone: Sequence[float]) -> tuple[float, float]:
    """(median, best) read bandwidth in bytes/s from the probe's call seconds: the median of the
    calls interleaved with the decode steps (the bandwidth under their load: the roofline's
    denominator) and the fastest call of all, interleaved or alone. Taken over a sample that
    holds the median's, the best is never below it."""
    return nbytes / statistics.median(interleaved), nbytes / min([*interleaved, *alone])


# (op type, input slot) of a table read only at the rows of the step's positions or tokens: an
# embedding, the cos/sin caches of RotaryEmbedding and of GroupQueryAttention's own rotary
_GATHERED = {
    ("Gather", 0),
    ("RotaryEmbedding", 2),
    ("RotaryEmbedding", 3),
    ("GroupQueryAttention", 7),
    ("GroupQueryAttention", 8),
}


def weights_bytes_per_step(graph: Path, tokens: int = 1) -> int:
    """Bytes of initializers (inline and external data) one call with ``tokens`` new tokens reads.

    A table only gathered from (the token embedding; the cos/sin caches ONNX Runtime's
    ``RotaryEmbedding`` and ``GroupQueryAttention`` read at the positions) contributes the rows gathered, not its size;
    everything else (MatMul weights, norms, the LM head) is read whole. Constants created by
    ``Constant`` nodes are small and ignored."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    model = onnx.load(str(graph), load_external_data=False)
    consumers: dict[str, set[tuple[str, int]]] = defaultdict(set)
    node: Any
    for node in _all_nodes(model.graph):
        for slot, name in enumerate(node.input):
            consumers[name].add((node.op_type, slot))
    total = 0
    for init in model.graph.initializer:
        dims = tuple(init.dims)
        itemsize = (
            np.dtype(tensor_dtype_to_np_dtype(init.data_type)).itemsize
            if init.data_type != onnx.TensorProto.INT4
            else 0.5
        )
        use = consumers.get(init.name, set())
        if use and all((op, slot) in _GATHERED for op, slot in use) and len(dims) >= 2:
            total += int(np.prod(dims[1:]) * itemsize * tokens)
        else:
            total += int(np.prod(dims, dtype=np.int64) * itemsize)
    return total


def _all_nodes(graph: Any) -> list[Any]:
    """Nodes of a graph and of its subgraphs (If/Loop/Scan bodies)."""
    import onnx

    nodes = []
    for node in graph.node:
        nodes.append(node)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                nodes.extend(_all_nodes(attr.g))
    return nodes
