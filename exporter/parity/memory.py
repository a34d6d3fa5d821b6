"""Whether parity keeps the PyTorch model in memory while the graphs run, or frees it and loads it
again to score their tokens: PyTorch's and a runtime's weights are in memory together only when
the model adds little to what the graphs' session holds anyway (the export's peak stays near the
larger of the two) and both fit comfortably."""

from __future__ import annotations

import itertools

from torch import nn

from kiln.exporter.contract.static_cache import machine_memory

__all__ = ["KEEP_ALWAYS_BYTES", "KEEP_BESIDE", "KEEP_FRACTION", "keeps_model", "module_bytes"]

KEEP_FRACTION = 0.5  # the model and the largest graph set's weights together under half this machine's memory
# A graph set's session holds about its weights' bytes (ONNX Runtime's prepacked copies, measured 2.5 GB for the
# 1.98 GB of the Qwen2-0.5B shape's fp32 weights): a model kept beside it adds its own bytes to the graphs' peak.
KEEP_BESIDE = 0.25  # kept when it adds at most this fraction of the graph set's weights to that peak
KEEP_ALWAYS_BYTES = 256 * 2**20  # or when it is this small (loading it again costs more than holding it)


def module_bytes(module: nn.Module) -> int:
    """The bytes of the module's parameters and buffers as they are held now (shared ones once)."""
    seen: dict[int, int] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def keeps_model(module: nn.Module, weight_bytes: int, memory: int | None = None) -> bool:
    """Whether ``module`` may stay in memory beside a graph set whose weights files hold
    ``weight_bytes`` (the largest one parity opens): the module at most ``KEEP_BESIDE`` of those
    bytes or ``KEEP_ALWAYS_BYTES``, and both under ``KEEP_FRACTION`` of ``memory`` (default:
    this machine's, ``machine_memory``)."""
    held = module_bytes(module)
    if held > max(KEEP_ALWAYS_BYTES, KEEP_BESIDE * weight_bytes):
        return False
    return held + weight_bytes <= KEEP_FRACTION * (machine_memory() if memory is None else memory)
