"""The quantized model: PyTorch computing with the int4 numbers an export's graphs hold.

A random-weight model's int4 logits are near-ties, so agreement with the checkpoint's model
(cosine, tokens) cannot tell a correct int4 graph from a broken one there. This is the second
reference: the same module, each int4 MatMul's module computing ``x @ (q * scale) + bias`` in
fp32 with an export's ``q`` and ``scale`` (every graph of an export holds the same numbers), so
a graph is judged against it at its float precision's tolerance, whatever the weights (issue 24;
docs/parity.md).

An export builds it on the quantizer's own numbers (``int4.proof``, which also checks
every graph weight against them bit for bit), and so does ``kiln check``, with the quantizer run
again on the checkpoint (``int4.rerun``); only where that cannot run (a manifest without
the int4 method, GPTQ's calibration data gone) does it read them back from the graph files
(``read_int4_weights``), and says so. Each int4 ``DequantizeLinear`` feeds ``/<module>/MatMul``
(``passes.names``); its module must be an ``nn.Linear`` (``weight [N, K]``) or a Conv1D
(transformers' GPT-2 layers, ``weight [K, N]``), any other is refused by name. The module's own
float weight is freed (unless another module shares it: a tied LM head), so the quantized model
holds about one byte per int4 weight more than the float model's other tensors.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch
from torch import nn

from kiln.errors import ExportError
from kiln.exporter.passes.ir_utils import read_uncached
from kiln.exporter.passes.names import module_of
from kiln.exporter.runners.torch_runner import Scratch, computes_in_fp32, fp32_scratch

__all__ = ["Int4Weight", "read_int4_weights", "use_int4_weights"]

_Q, _SCALE = "_kiln_int4_q", "_kiln_int4_scale"  # buffers: freed with the module's other tensors


@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """One MatMul's int4 weight as its graph holds it: ``q`` int8 [K, N] and ``scale`` [K/B, N]."""

    module: str  # the qualified name of the module whose MatMul it is
    node: str  # the DequantizeLinear, for messages
    q: np.ndarray
    scale: np.ndarray


def read_int4_weights(paths: Iterable[Path]) -> Iterator[Int4Weight]:
    """Every int4 block DQ weight of the graphs at ``paths``, one module at a time (the first
    graph that holds a module's weight gives it: the graphs of one export share their numbers),
    read from the weights file as it is asked for."""
    seen: set[str] = set()
    for path in paths:
        for node in ir.load(path).graph:
            found = _int4_weight(node)
            if found is not None and found.module not in seen:
                seen.add(found.module)
                yield found


def _int4_weight(node: ir.Node) -> Int4Weight | None:
    weight = node.inputs[0] if node.op_type == "DequantizeLinear" and node.inputs else None
    if weight is None or weight.dtype != ir.DataType.INT4 or weight.const_value is None:
        return None
    scale = node.inputs[1].const_value if len(node.inputs) > 1 and node.inputs[1] is not None else None
    users = [u.node for u in node.outputs[0].uses()]
    modules = {module_of(u) for u in users}
    if scale is None or not users or len(modules) != 1 or "" in modules:
        raise ExportError(
            f"parity: the int4 weight of {node.name} does not feed the MatMul of one named module (found "
            f"{sorted(modules)})"
        )
    q = read_uncached(weight.const_value, np.dtype(np.int8))
    return Int4Weight(
        modules.pop(), node.name or "", q, np.array(scale.numpy(), dtype=np.float32)
    )  # a copy: torch wants it writable


def use_int4_weights(module: nn.Module, weights: Iterable[Int4Weight]) -> list[str]:
    """Make each weight's submodule of ``module`` compute with it (in place, for the rest of the
    module's life; its float weight freed as it goes, so the two are never whole in memory
    together); the modules changed. Refuses a module it cannot map."""
    shared, changed, scratch = _shared_parameters(module), [], fp32_scratch(computes_in_fp32(module))
    for weight in weights:
        sub = _module(module, weight.module, weight)
        sub.register_buffer(_Q, torch.from_numpy(weight.q), persistent=False)
        sub.register_buffer(_SCALE, torch.from_numpy(weight.scale), persistent=False)
        sub.forward = functools.partial(
            _int4_forward, sub, weight.q.shape[0] // weight.scale.shape[0], scratch
        )  # this instance only
        own = sub._parameters["weight"]
        if own is not None and id(own) not in shared:
            own.data = torch.empty(0, dtype=own.dtype)  # its float values are never read again
        changed.append(weight.module)
    if not changed:
        raise ExportError(
            "parity: the graphs hold no int4 weight to check against (an int4 export without one is refused when "
            "written)"
        )
    return changed


def _module(root: nn.Module, name: str, weight: Int4Weight) -> nn.Module:
    """The submodule ``name``, checked to hold the float weight the int4 one replaced."""
    try:
        sub = root.get_submodule(name)
    except AttributeError:
        raise ExportError(f"parity: {weight.node} belongs to {name}, which the model has no module of") from None
    # PEFT's model of an adapter over this base (an export with --lora-slots, kiln adapter's
    # parity): the Linear is its LoRA layer's base_layer, which the LoRA layer calls
    sub = getattr(sub, "base_layer", sub)
    k, n = weight.q.shape
    own = getattr(sub, "weight", None)
    expected = (n, k) if isinstance(sub, nn.Linear) else (k, n) if type(sub).__name__ == "Conv1D" else None
    if expected is None or not isinstance(own, torch.Tensor) or tuple(own.shape) != expected:
        found = tuple(own.shape) if isinstance(own, torch.Tensor) else None
        raise ExportError(
            f"parity: {weight.node}'s int4 weight [K={k}, N={n}] cannot be mapped onto {name} "
            f"({type(sub).__name__}, weight {found}): "
            "only an nn.Linear's or a Conv1D's weight can be"
        )
    return sub


def _shared_parameters(module: nn.Module) -> set[int]:
    """The parameters that more than one module holds (tied weights)."""
    seen: dict[int, int] = {}
    for _, tensor in module.named_parameters(remove_duplicate=False):
        seen[id(tensor)] = seen.get(id(tensor), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def _int4_forward(module: nn.Module, block: int, scratch: Scratch, x: torch.Tensor) -> torch.Tensor:
    """``x @ (q * scale) + bias`` in fp32: what the graph's ``MatMul(x, DequantizeLinear(q,
    scale, axis=0, block_size))`` computes (and the bias its Add adds). The fp32 weight is written
    in one pass into a buffer the model's other calls reuse (an 8B model's weights dequantized at
    every step would otherwise allocate and fault in 28 GB per step)."""
    q, scale = module.get_buffer(_Q), module.get_buffer(_SCALE)
    k, n = q.shape
    weight = scratch.empty((k, n), q.device).copy_(q)  # int8 to fp32 exactly, then scaled in place: 2.7x faster
    weight.view(k // block, block, n).mul_(scale[:, None, :])  # than one mixed-dtype torch.mul(out=)
    out = x.float() @ weight
    scratch.give_back(weight)
    bias = getattr(module, "bias", None)
    return out + bias.float() if isinstance(bias, torch.Tensor) else out
