"""GPTQ's calibration, layer by layer (the order of GPTQ's reference implementation): each decoder
layer's input Hessians ``H = 2/n X^T X`` from that layer's inputs, its weights quantized, and the
next layer's inputs computed by the layer with its quantized weights.

    capture layer 0's inputs, and every layer's other arguments (``layers.capture``)
    for each layer:
        run it on its inputs, forward pre-hooks summing X^T X of each weight's module input
        quantize(name, H) for each of its weights (``exporter.int4.quantize``: GPTQ's numbers;
            it hands back the dequantized weight)
        run it again with those weights in place of its own (restored after): the next inputs
    weights outside the layers (the LM head with --int4-all-matmuls): one forward per batch, the
        layers replaced by the last layer's outputs, hooks on their modules

The windows are whole causal windows through prefill: every position sees the tokens before it,
the activations prefill and teacher-forced decode steps give it. Memory: the model, the hidden
states of the calibration windows (``[windows, window, d]`` float32) and one layer's Hessians
(float32 ``[K, K]``, one per input read: q/k/v share one, gate/up another), never two layers'.
A family without a ``LayerPlan`` (no layer list to step through) gets one forward over the whole
model, every weight's Hessian at once (GPTQ without the quantized inputs: the numbers before
issue 24).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from kiln.calibration.layers import Batch, Form, Stop, capture, decoder_layers, layer_feeds, replaced_forwards
from kiln.errors import CalibrationError
from kiln.exporter.progress import Progress
from kiln.exporter.runners.device import current, on, resolve
from kiln.exporter.runners.torch_runner import computes_in_fp32

__all__ = ["ACCUMULATE", "HessianSums", "Quantize", "live_hessians", "owner_of", "quantize_layerwise"]

# X^T X summed in float32: against float64 on the study's Llama, ... (docs/benchmarks.md, issue 24)
ACCUMULATE = torch.float32

# (weight name, its Hessian, or None for a weight quantized already) -> its dequantized values in
# the module tensor's layout (float32): what the layer computes with from then on
Quantize = Callable[[str, np.ndarray | None], np.ndarray]

_LIVE: dict[int, weakref.ref[Any]] = {}  # every Hessian not yet freed (a sum's tensor, then its array), by id


def _track(matrix: Any) -> None:
    key = id(matrix)
    _LIVE[key] = weakref.ref(matrix, lambda _, key=key: _LIVE.pop(key, None))  # type: ignore[misc]


def live_hessians() -> int:
    """How many Hessian matrices exist now (the memory bound: one layer's)."""
    return len(_LIVE)


def owner_of(weight_name: str) -> str:
    """The module path that owns a graph weight: ``model.layers.0.attn.q_proj.weight`` (the
    contract wrapper's ``model.`` + the qualified parameter name) -> ``layers.0.attn.q_proj``."""
    return weight_name.removeprefix("model.").rpartition(".")[0]


class HessianSums:
    """``X^T X`` of the input of each weight's module, summed over the forwards run inside (forward
    pre-hooks), in ``ACCUMULATE``; weights whose modules read the very same tensor in a forward
    (q/k/v, gate/up) share one sum. ``next_batch()`` between forwards. With ``stop``, a forward
    ends (``Stop``) once every module has been called in it (nothing after is computed)."""

    def __init__(self, owners: Mapping[str, nn.Module], stop: bool = False) -> None:
        self._owners, self._stop = owners, stop
        self._sums: dict[str, torch.Tensor] = {}  # by the first weight of each group
        self._rows: dict[str, int] = {}
        self._group: dict[str, str] = {}  # weight -> the weight whose sum it shares
        self._seen: dict[int, tuple[torch.Tensor, str]] = {}  # this forward's inputs so far
        self._fired: set[str] = set()
        self._handles: list[Any] = []

    def __enter__(self) -> HessianSums:
        for name, owner in self._owners.items():
            self._handles.append(owner.register_forward_pre_hook(functools.partial(self._hook, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def next_batch(self) -> None:
        self._seen.clear()
        self._fired.clear()

    def _hook(self, name: str, module: nn.Module, args: tuple[object, ...]) -> None:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor):
            raise CalibrationError(
                f"GPTQ: the module of {name} was called without a tensor input first; its input Hessian cannot "
                "be collected"
            )
        seen = self._seen.get(id(x))
        leader = seen[1] if seen is not None and seen[0] is x else name
        if self._group.setdefault(name, leader) != leader:
            raise CalibrationError(
                f"GPTQ: the module of {name} read another input than in the first batch ({leader}'s); its "
                "Hessian cannot be shared"
            )
        if leader == name:
            self._seen[id(x)] = (x, name)
            # [rows, K], on parity's device (runners.device: the GPU's X^T X with --parity-device cuda)
            flat = x.detach().reshape(-1, x.shape[-1]).to(device=current().name, dtype=ACCUMULATE)
            if name not in self._sums:
                self._sums[name] = torch.zeros(flat.shape[1], flat.shape[1], dtype=ACCUMULATE, device=flat.device)
                _track(self._sums[name])
            self._sums[name].addmm_(flat.T, flat)
            self._rows[name] = self._rows.get(name, 0) + flat.shape[0]
        self._fired.add(name)
        if self._stop and len(self._fired) == len(self._owners):
            raise Stop

    def finish(self) -> dict[str, np.ndarray]:
        """``{weight: H = 2/n X^T X}`` (a shared input's weights: the same array); the sums are
        handed over (this object keeps none)."""
        missing = sorted(set(self._owners) - set(self._group))
        if missing:
            raise CalibrationError(f"GPTQ: the calibration run never called the modules of {missing[:3]}")
        arrays = {leader: _host(total.mul_(2.0 / self._rows[leader])) for leader, total in self._sums.items()}
        for array in arrays.values():
            _track(array)
        self._sums.clear()
        return {name: arrays[self._group[name]] for name in self._owners}


def _host(tensor: torch.Tensor) -> np.ndarray:
    """A sum as a CPU array (on the CPU: the tensor's own memory)."""
    return tensor.numpy() if tensor.device.type == "cpu" else tensor.cpu().numpy()


def _owners(module: nn.Module, names: Collection[str]) -> dict[str, nn.Module]:
    owners = {}
    for name in sorted(names):
        try:
            owners[name] = module.get_submodule(owner_of(name))
        except AttributeError:
            raise CalibrationError(
                f"GPTQ: the graph's weight {name} has no module {owner_of(name)!r} to collect its inputs from"
            ) from None
    return owners


@contextlib.contextmanager
def _weights_in_place(module: nn.Module, weights: Mapping[str, np.ndarray]) -> Iterator[None]:
    """The module's parameters named in ``weights`` compute with those values inside; their own
    tensors are put back after (the reference module is left exactly as it was)."""
    saved: list[tuple[nn.Parameter, torch.Tensor]] = []
    try:
        for name, values in weights.items():
            param = _parameter(module, name)
            if tuple(values.shape) != tuple(param.shape):
                raise CalibrationError(
                    f"GPTQ: the quantized {name} is {tuple(values.shape)}, the module's tensor {tuple(param.shape)}"
                )
            saved.append((param, param.data))
            param.data = torch.from_numpy(values)
        yield
    finally:
        for param, data in reversed(saved):
            param.data = data


def _parameter(module: nn.Module, name: str) -> nn.Parameter:
    try:
        return module.get_parameter(name.removeprefix("model."))
    except AttributeError:
        raise CalibrationError(
            f"GPTQ: the graph's weight {name} is no parameter of the model: its quantized layer cannot be run"
        ) from None


def _quantize_layer(
    module: nn.Module,
    layer: nn.Module,
    index: int,
    batches: Sequence[Batch],
    todo: Collection[str],
    done: Collection[str],
    quantize: Quantize,
) -> None:
    """One layer: its weights' Hessians from its inputs, its weights quantized, its inputs replaced
    by its outputs computed with them."""
    hessians: dict[str, np.ndarray] = {}
    if todo:
        with HessianSums(_owners(module, todo)) as sums:
            for batch in batches:
                batch.calls[index].run(layer, batch.hidden)
                sums.next_batch()
        hessians = sums.finish()
    shared: dict[int, list[str]] = {}  # the weights of each Hessian, one after the other
    for name in sorted(todo):
        shared.setdefault(id(hessians[name]), []).append(name)
    weights = {
        name: quantize(name, hessians.pop(name)) for names in shared.values() for name in names
    }  # each Hessian freed once its weights are done
    weights.update({name: quantize(name, None) for name in sorted(done)})
    with _weights_in_place(module, weights):
        for batch in batches:
            batch.hidden.copy_(batch.calls[index].run(layer, batch.hidden))


def _quantize_outside(
    module: nn.Module,
    layers: Sequence[nn.Module],
    batches: Sequence[Batch],
    form: Form | None,
    todo: Collection[str],
    quantize: Quantize,
) -> None:
    """Weights outside the decoder layers: forwards of the whole model with every layer handing on
    the last layer's output (the quantized layers'), until their modules have all been called."""
    current: list[torch.Tensor] = []

    def last(index: int, *args: object, **kwargs: object) -> object:
        assert form is not None, "layers were captured"
        return form.wrap(current[0])

    with HessianSums(_owners(module, todo), stop=True) as sums, replaced_forwards(layers, last):
        for batch in batches:
            current[:] = [batch.hidden]
            with contextlib.suppress(Stop):
                module(*batch.feeds)
            sums.next_batch()
    hessians = sums.finish()
    for name in sorted(todo):
        quantize(name, hessians.pop(name))


def _by_layer(names: Collection[str], prefix: str | None, n_layers: int) -> dict[int | None, list[str]]:
    """Weight names by the index of the decoder layer whose module owns them (None: outside)."""
    paths = {prefix.format(i): i for i in range(n_layers)} if prefix is not None else {}
    out: dict[int | None, list[str]] = {}
    for name in names:
        owner = owner_of(name)
        index = next((i for path, i in paths.items() if owner == path or owner.startswith(path + ".")), None)
        out.setdefault(index, []).append(name)
    return out


def quantize_layerwise(
    module: nn.Module,
    prefix: str | None,
    n_layers: int,
    windows: Sequence[np.ndarray],
    todo: Collection[str],
    done: Collection[str],
    quantize: Quantize,
    progress: Progress,
    device: str | None = None,
) -> None:
    """Quantize the weights ``todo`` (graph weight names) layer by layer over ``windows``: call
    ``quantize(name, H)`` for each, in layer order, and ``quantize(name, None)`` for each of
    ``done`` (quantized earlier: the layer computes with those numbers too). ``prefix`` is the
    family's ``LayerPlan.prefix`` (None: no plan). Progress: one step per layer. The Hessians and
    solves run on ``device`` (``--parity-device``: ``runners.device``; None: the device set)."""
    with on(resolve(device) if device is not None else current()):
        _quantize_layerwise(module, prefix, n_layers, windows, todo, done, quantize, progress)


def _quantize_layerwise(
    module: nn.Module,
    prefix: str | None,
    n_layers: int,
    windows: Sequence[np.ndarray],
    todo: Collection[str],
    done: Collection[str],
    quantize: Quantize,
    progress: Progress,
) -> None:
    computes_in_fp32(module)
    layers = decoder_layers(module, prefix, n_layers)
    todo_at, done_at = _by_layer(todo, prefix, n_layers), _by_layer(done, prefix, n_layers)
    outside = todo_at.get(None, [])
    stage_name = f"GPTQ: {len(todo)} weights, {len(windows)} windows, layer by layer"
    with progress.stage(stage_name, total=len(layers) + bool(outside)) as stage, torch.no_grad():
        if layers:
            batches, form = capture(module, layers, layer_feeds(windows))
        else:
            batches, form = [Batch(feeds, torch.empty(0), ()) for feeds in layer_feeds(windows)], None
        for index, layer in enumerate(layers):
            _quantize_layer(module, layer, index, batches, todo_at.get(index, []), done_at.get(index, []), quantize)
            stage.advance()
        if outside:
            _quantize_outside(module, layers, batches, form, outside, quantize)
            stage.advance()
