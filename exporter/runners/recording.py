"""A runner that records another runner's outputs and then only replays them."""

from __future__ import annotations

import hashlib

import numpy as np

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.runners.base import Feeds, Runner

__all__ = ["RecordingRunner"]


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
                raise RuntimeError(
                    f"no recorded {self.name} output for these {kind.value} inputs (the recording is frozen)"
                )
            self._recorded[key] = self._inner.run(kind, feeds)
        return self._recorded[key]

    def freeze(self) -> None:
        self._inner = None
