"""Input Hessians ``H = 2/n X^T X`` of a model's weights, for GPTQ (``exporter.precision.gptq``).

The calibration windows run through the PyTorch model, and a forward pre-hook on the module that
owns each weight accumulates ``X^T X`` of its input. A whole window through the causal model
gives every position the activations that prefill and the teacher-forced decode steps of
``feeds.calibration_feeds`` give it (the same tokens, the same past), so this is the same data
the int8 ranges see, collected once instead of through each graph.

Memory: one ``[K, K]`` float64 matrix per weight (``K`` its input channels), all at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
from kiln.errors import CalibrationError
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.contract.steps import prompt_feeds
from kiln.exporter.runners import TorchRunner
from torch import nn

__all__ = ["collect_hessians", "owner_of"]

_BATCH = 16  # windows per forward


def owner_of(weight_name: str) -> str:
    """The module path that owns a graph weight: ``model.layers.0.attn.q_proj.weight`` (the
    contract wrapper's ``model.`` + the qualified parameter name) -> ``layers.0.attn.q_proj``."""
    return weight_name.removeprefix("model.").rpartition(".")[0]


def collect_hessians(
    module: nn.Module, n_layers: int, weights: Iterable[str], windows: Sequence[np.ndarray], advance: Callable[[int], None] = lambda windows: None
) -> dict[str, np.ndarray]:
    """``{weight name: H [K, K]}`` over ``windows`` for each of ``weights`` (graph weight names);
    ``advance(n)`` after each forward of ``n`` windows (progress)."""
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    handles = []
    for name in sorted(set(weights)):
        try:
            owner = module.get_submodule(owner_of(name))
        except AttributeError:
            raise CalibrationError(f"GPTQ: the graph's weight {name} has no module {owner_of(name)!r} to collect its inputs from") from None

        def hook(mod: nn.Module, args: tuple[object, ...], name: str = name) -> None:
            x = args[0]
            assert isinstance(x, torch.Tensor), "a weight's module is called with its input first"
            flat = x.detach().reshape(-1, x.shape[-1]).double()
            product = (flat.T @ flat).numpy()
            if name in sums:
                sums[name] += product
            else:
                sums[name] = product
            counts[name] = counts.get(name, 0) + flat.shape[0]

        handles.append(owner.register_forward_pre_hook(hook))
    try:
        runner = TorchRunner(module, n_layers)
        by_length: dict[int, list[np.ndarray]] = {}
        for window in windows:
            by_length.setdefault(len(window), []).append(window)
        for same in by_length.values():  # unpadded batches: every row's positions are real tokens
            for start in range(0, len(same), _BATCH):
                batch = same[start : start + _BATCH]
                runner.run(GraphKind.PREFILL, prompt_feeds([w.tolist() for w in batch], 0))
                advance(len(batch))
    finally:
        for handle in handles:
            handle.remove()
    missing = sorted(set(weights) - set(sums))
    if missing:
        raise CalibrationError(f"GPTQ: the calibration run never called the modules of {missing[:3]}")
    return {name: 2.0 * total / counts[name] for name, total in sums.items()}
