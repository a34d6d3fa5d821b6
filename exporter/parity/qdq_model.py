"""The quantized model of an int8 or fp8 Q/DQ export: PyTorch with the scales its quantization
made (``parity.qdq_numbers``, never read from the graphs) applied as the graphs' Q/DQ apply them.

Each quantized MatMul's module computes ``Q(x) @ W' (+ bias)``: ``Q`` is its input's
``QuantizeLinear -> DequantizeLinear`` (int8: ``clamp(round_half_even(x / s), -128, 127) * s`` in
float32; fp8: ``fp16(e4m3(clamp(fp16(x) / s, +-448)) * s)``, as ONNX Runtime computes a float16
graph's pair), ``W'`` its weight quantized per column with the numbers' scales and dequantized
the same way (the codes ``round(w / s)`` of the checkpoint's fp32 weight, as the quantizer makes
them), and with an output scale (int8) ``Q`` again on the MatMul's output before the bias.

The graphs are calibrated one by one, so their activation scales differ: prefill's apply to the
positions a prefill graph computes, decode's to a decode step's, the unified graph's to every
position it computes. ``QdqReference.runner(first, boundary, rest)`` gives a runner whose
forwards apply ``first``'s scales to the positions before ``boundary`` and ``rest``'s from there
on: the prefill + decode path scored teacher-forced (``parity.scoring``) is ``(prefill, prompt
length, decode)``; the unified path, and one graph's tensor checks, one kind throughout. A
static scale makes Q/DQ element-wise, so one teacher-forced forward computes every position as
the step that computed it in the graphs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from kiln.errors import ExportError
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.parity.qdq_numbers import QdqModule, QdqNumbers
from kiln.exporter.runners import TorchRunner
from kiln.exporter.runners.base import Feeds

__all__ = ["QdqReference"]

_FP8_MAX = 448.0


def _fake(x: torch.Tensor, scale: torch.Tensor, form: str, half: bool) -> torch.Tensor:
    """``DequantizeLinear(QuantizeLinear(x, scale), scale)`` with zero points 0, in float32; with
    ``half`` (a float16 graph's pair) its input and output rounded to float16 as the graph's are."""
    x = x.half().float() if half else x
    if form == "int8":
        y = torch.clamp(torch.round(x / scale), -128, 127) * scale
    else:
        y = torch.clamp(x / scale, -_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    return y.half().float() if half else y


def _scalar(scale: np.ndarray) -> torch.Tensor:
    """A scale as the reference computes with it: its value (as the graph holds it) in float32."""
    return torch.tensor(float(scale), dtype=torch.float32)


class _Columns:
    """Which graph's scales the next forward's positions take: ``kinds[i]`` for column ``i``."""

    def __init__(self) -> None:
        self.kinds: list[str] = []

    def scales(self, per_kind: Mapping[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
        """The scale of each position of an input of ``shape`` (``[..., positions, features]``)."""
        kinds = self.kinds
        if len(set(kinds)) == 1:
            return per_kind[kinds[0]]
        if len(shape) < 2 or shape[-2] != len(kinds):  # as an MoE's gathered tokens would be
            raise ExportError(
                f"parity: the Q/DQ reference cannot tell which graph's scales apply to an input {list(shape)} of "
                f"a forward of {len(kinds)} positions"
            )
        return torch.stack([per_kind[k] for k in kinds]).reshape(len(kinds), 1)


def _qdq_forward(
    module: nn.Module,
    weight: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    outputs: dict[str, torch.Tensor] | None,
    columns: _Columns,
    form: str,
    half: bool,
    x: torch.Tensor,
) -> torch.Tensor:
    x = x.float()
    out = _fake(x, columns.scales(inputs, x.shape), form, half) @ weight
    if outputs is not None:
        out = _fake(out, columns.scales(outputs, x.shape), form, half)
    bias = getattr(module, "bias", None)
    return out + bias.float() if isinstance(bias, torch.Tensor) else out


def _dequantized(w: torch.Tensor, scale: np.ndarray, form: str, half: bool) -> torch.Tensor:
    """``w [K, N]`` (float32) quantized per column with ``scale [N]`` and dequantized, as the
    graph's weight; with ``half`` (a float16 graph) dequantized with the float16 scale into float16
    (int8's codes were made with the float32 scale, which the fp16 pass rounded after)."""
    s = torch.from_numpy(scale.astype(np.float32)).to(w.device)  # on parity's device, as the weight
    if form == "int8":
        q = torch.clamp(torch.round(w / s), -128, 127)
    else:
        q = torch.clamp(w / s, -_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * s.half().float()).half().float() if half else q * s


def _linear(root: nn.Module, name: str, numbers: QdqModule) -> tuple[nn.Module, torch.Tensor]:
    """The submodule ``name`` and its fp32 weight ``[K, N]``, checked against the numbers' columns."""
    try:
        sub = root.get_submodule(name)
    except AttributeError:
        raise ExportError(f"parity: {numbers.node} belongs to {name}, which the model has no module of") from None
    sub = getattr(sub, "base_layer", sub)  # PEFT's LoRA layer over the Linear (--lora-slots)
    own = getattr(sub, "weight", None)
    weight = own.detach().float().T if isinstance(sub, nn.Linear) and isinstance(own, torch.Tensor) else None
    if weight is None and type(sub).__name__ == "Conv1D" and isinstance(own, torch.Tensor):
        weight = own.detach().float()
    if weight is None or weight.shape[1] != numbers.weight.shape[0]:
        raise ExportError(
            f"parity: {numbers.node}'s Q/DQ weight ({numbers.weight.shape[0]} columns) cannot be mapped onto "
            f"{name} ({type(sub).__name__}): "
            "only an nn.Linear's or a Conv1D's weight of as many output features can be"
        )
    return sub, weight.contiguous()


class QdqReference:
    """``module`` made to compute with ``numbers`` (in place, for the rest of its life: its float
    weights replaced by their dequantized values), and runners of it per schedule of graphs."""

    def __init__(self, module: nn.Module, numbers: QdqNumbers, n_layers: int, last_logits_only: bool) -> None:
        self._columns, form = _Columns(), numbers.form
        # made first: computes_in_fp32 (a bf16 model's) wraps Linear forwards, and must not wrap these
        self._runners = {last: TorchRunner(module, n_layers, last) for last in (False, last_logits_only)}
        shared, graphs = _shared(module), numbers.graphs
        names = dict.fromkeys(name for modules in graphs.values() for name in modules)
        for name in names:
            per_kind = {kind: modules[name] for kind, modules in graphs.items() if name in modules}
            if len(per_kind) != len(graphs):
                raise ExportError(
                    f"parity: {name} is quantized in some graphs only ({sorted(per_kind)}): the Q/DQ reference "
                    "needs it in every graph"
                )
            first = next(iter(per_kind.values()))
            sub, weight = _linear(module, name, first)
            # the scales on the weight's device (parity on CUDA: the GPU, where TorchRunner put the module)
            inputs = {k: _scalar(numbers.held(m.input)).to(weight.device) for k, m in per_kind.items()}
            outputs = (
                {
                    k: _scalar(numbers.held(m.output)).to(weight.device)
                    for k, m in per_kind.items()
                    if m.output is not None
                }
                if first.output is not None
                else None
            )
            w = _dequantized(weight, first.weight, form, numbers.float16)
            sub.forward = functools.partial(
                _qdq_forward, sub, w, inputs, outputs, self._columns, form, numbers.float16
            )  # this instance only
            own = sub._parameters.get("weight")
            if own is not None and id(own) not in shared:
                own.data = torch.empty(
                    0, dtype=own.dtype
                )  # its float values are never read again (the dequantized ones are)
        if not names:
            raise ExportError("parity: the Q/DQ numbers name no quantized MatMul to check against")

    def runner(
        self, first: GraphKind, boundary: int = 0, rest: GraphKind | None = None, *, last_logits_only: bool = False
    ) -> _Scheduled:
        """A runner applying ``first``'s scales before position ``boundary`` and ``rest``'s (else
        ``first``'s) from there on; with ``last_logits_only`` its prefill returns the last position's logits."""
        return _Scheduled(self._runners[last_logits_only], self._columns, first.value, boundary, (rest or first).value)


def _shared(module: nn.Module) -> set[int]:
    """The parameters more than one module holds (a tied LM head's): never freed."""
    seen: dict[int, int] = {}
    for _, tensor in module.named_parameters(remove_duplicate=False):
        seen[id(tensor)] = seen.get(id(tensor), 0) + 1
    return {key for key, count in seen.items() if count > 1}


class _Scheduled:
    """``QdqReference``'s runner for one schedule (``runner``): each call sets the kinds of its
    positions (the feeds' mask is as long as the positions so far, their ids the new ones)."""

    name = "torch"

    def __init__(self, runner: TorchRunner, columns: _Columns, first: str, boundary: int, rest: str) -> None:
        self._runner, self._columns, self._first, self._boundary, self._rest = runner, columns, first, boundary, rest

    def graphs(self) -> tuple[GraphKind, ...]:
        return self._runner.graphs()

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        new, total = feeds["input_ids"].shape[1], feeds["attention_mask"].shape[1]
        self._columns.kinds = [self._first if p < self._boundary else self._rest for p in range(total - new, total)]
        return self._runner.run(kind, feeds)
