"""Whether parity keeps the PyTorch model in memory while the graphs run, or frees it and loads it
again to score their tokens: PyTorch's and a runtime's weights are never in memory together
unless both fit comfortably."""

from __future__ import annotations

import itertools

from torch import nn

from kiln.exporter.contract.static_cache import machine_memory

__all__ = ["KEEP_FRACTION", "keeps_model", "module_bytes"]

KEEP_FRACTION = 0.5  # the model and the largest graph set's weights together under half this machine's memory


def module_bytes(module: nn.Module) -> int:
    """The bytes of the module's parameters and buffers as they are held now (shared ones once)."""
    seen: dict[int, int] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def keeps_model(module: nn.Module, weight_bytes: int, memory: int | None = None) -> bool:
    """Whether ``module`` may stay in memory beside a graph set whose weights files hold
    ``weight_bytes`` (the largest one parity opens): both under ``KEEP_FRACTION`` of ``memory``
    (default: this machine's, ``machine_memory``)."""
    return module_bytes(module) + weight_bytes <= KEEP_FRACTION * (machine_memory() if memory is None else memory)
