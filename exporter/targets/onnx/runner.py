"""Parity over ``--target onnx``'s graphs: ONNX Runtime (CPU) sessions fed the portable contract.

Parity asks every runner the same question in the portable contract (a past of ``past_seq``
rows, presents of ``past_seq + seq``). ``StaticCacheRunner`` answers it through the static
contract (``contract.static_cache.static_feeds``, which TensorRT's ``engine.static_runner`` shares):
each key/value past goes into a zeroed ``max_context`` buffer, ``write_indices`` is the past length
in every row (kiln's batches are left-padded, so all rows write at one slot), and each such present
returned is the buffer's first ``past_seq + seq`` slots; a recurrent state (``conv``, ``ssm``) goes in
and comes back as it is, its fixed shape being the same in both contracts.
That adaptation copies, which parity can afford; ``kiln generate --target onnx`` runs the
graphs in place (one buffer bound as past and present: ``runtime.generate``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.contract.static_cache import portable_outputs, static_feeds
from kiln.exporter.runners.base import Feeds
from kiln.exporter.runners.ort_runner import OrtRunner

__all__ = ["StaticCacheRunner", "cache_inputs"]


def cache_inputs(graph: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """A static-cache graph's cache inputs: each one's shape without the batch (its sequence dim is
    the buffers' capacity, ``max_context``) and its dtype, read once from the graph file."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    model = onnx.load(str(graph), load_external_data=False)
    caches = {
        v.name: (
            tuple(d.dim_value for d in v.type.tensor_type.shape.dim[1:]),
            np.dtype(tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)),
        )
        for v in model.graph.input
        if v.name.startswith("past_key_values.")
    }
    return caches  # empty: a prefill graph with no key/value buffer (a state-space model's)


class StaticCacheRunner(OrtRunner):
    """``OrtRunner`` over static-cache graphs, in the portable contract (module docstring)."""

    name = "onnxruntime (static cache)"

    def __init__(
        self, paths: dict[GraphKind, Path], threads: int | None = None, extra_feeds: Feeds | None = None
    ) -> None:
        super().__init__(paths, threads, extra_feeds)
        # each graph's own cache inputs: prefill takes the key/value buffers only, decode and model a state too
        self._caches = {kind: cache_inputs(path) for kind, path in paths.items()}

    @classmethod
    def opener(cls, paths: dict[GraphKind, Path], extra_feeds: Feeds | None = None) -> Callable[[], StaticCacheRunner]:
        return lambda: cls(paths, extra_feeds=extra_feeds)

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        static, cuts = static_feeds(kind, feeds, self._caches[kind])
        return portable_outputs(super().run(kind, static), cuts)
