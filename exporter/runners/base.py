"""The runner interface every backend implements."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kiln.exporter.contract.io import GraphKind

__all__ = ["Feeds", "Runner"]

Feeds = dict[str, np.ndarray]


class Runner(Protocol):
    name: str

    def graphs(self) -> tuple[GraphKind, ...]:
        """The graphs this runner can execute."""
        ...

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds: ...
