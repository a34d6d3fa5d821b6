"""The PyTorch reference runner."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import torch
from torch import nn

from kiln.exporter.contract.io import (
    ENCODER_FEATURES,
    ENCODER_MASK,
    ENCODER_STATES,
    GraphKind,
    cross_past_names,
    cross_present_names,
)
from kiln.exporter.runners.base import Feeds
from kiln.exporter.runners.device import current
from kiln.exporter.trace.wrapper import EncoderModule, FeaturesEncoderModule, GraphModule
from kiln.file_pages import release_file_pages

__all__ = ["TorchRunner", "computes_in_fp32", "drop_fp32_buffers", "fp32_scratch"]

PAST, PRESENT = "past_key_values", "present"  # the cache inputs' and outputs' prefixes (``contract.io``)


_SCRATCH = "_kiln_fp32_scratch"


class Scratch:
    """fp32 buffers by shape, lent for one module call and given back: the same few buffers serve
    every layer, so computing in fp32 allocates nothing per call (allocating and freeing a model's
    worth of fp32 weights per forward grows glibc's heap by GBs, or faults every page in again)."""

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.device], list[torch.Tensor]] = {}

    def lend(self, tensor: torch.Tensor) -> torch.Tensor:
        """An fp32 copy of ``tensor``, whose checkpoint file pages go back to the page cache
        (``file_pages``: a module-at-a-time forward maps one module's at a time)."""
        lent = self.empty(tuple(tensor.shape), tensor.device).copy_(tensor.detach())
        release_file_pages([tensor])
        return lent

    def empty(self, shape: tuple[int, ...], device: torch.device | None = None) -> torch.Tensor:
        """A buffer of ``shape`` to fill (uninitialised) on ``device`` (the CPU by default: parity
        on CUDA lends on the GPU), given back like a lent one."""
        device = device or torch.device("cpu")
        free = self._free.get((shape, device))
        return free.pop() if free else torch.empty(shape, dtype=torch.float32, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        self._free.setdefault((tuple(buffer.shape), buffer.device), []).append(buffer)

    def clear(self) -> None:
        self._free.clear()


def _upcast_output(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
    return output.float()


def computes_in_fp32(module: nn.Module, *, budget: int | None = None) -> nn.Module:
    """``module``, made to compute in fp32 whatever its weights are stored in (a bf16 checkpoint
    stays bf16 in memory). The graphs are fp32 (or fp16 from these fp32 values), so this is the
    reference parity measures them against. Each submodule that holds low-precision parameters
    gets them as fp32 copies for the duration of its own call (forward hooks, buffers from one
    ``Scratch``), so only the module being run has fp32 weights; an ``nn.Embedding`` instead
    gathers its bf16 rows and upcasts those (the same values, without converting the table).
    In place, once; a no-op for an fp32 module. A parameter read outside its own module's call
    stays low-precision and fails loudly on the dtype, never silently.

    When the fp32 copy of every low-precision weight fits ``budget`` bytes (default: half the
    memory the system has available), the weights are instead converted once, in place (the
    low-precision copies freed): the same fp32 values, without copying the whole model to fp32
    at every step, which was most of a bf16 model's reference time (issue 24). A model too
    large for that (an 8B bf16 model on 24 GB) computes as above, one module at a time."""
    if isinstance(getattr(module, _SCRATCH, None), Scratch):
        return module
    scratch = Scratch()
    setattr(module, _SCRATCH, scratch)  # also the marker that this module is done
    if _converted_in_place(module, budget):
        return module
    for sub in module.modules():
        for name, buffer in list(sub.named_buffers(recurse=False)):
            if buffer.is_floating_point() and buffer.dtype != torch.float32:
                setattr(sub, name, buffer.float())
        low = [n for n, t in sub.named_parameters(recurse=False) if t.is_floating_point() and t.dtype != torch.float32]
        if not low:
            continue
        if type(sub) is nn.Embedding and sub.max_norm is None:
            sub.register_forward_hook(_upcast_output)
        elif type(sub) is nn.Linear and sub.weight.numel() > _CHUNK_ELEMENTS:
            # this module's forward, on this instance only
            sub.forward = functools.partial(_linear_in_slices, sub, scratch)  # type: ignore[method-assign]
        else:
            _lend_during_calls(sub, low, scratch)
    return module


def _converted_in_place(module: nn.Module, budget: int | None) -> bool:
    """Whether ``module``'s low-precision weights and buffers fit ``budget`` bytes in fp32
    (``computes_in_fp32``), converted in place when they do."""
    weights = [
        t for t in module.parameters() if t.is_floating_point() and t.dtype != torch.float32
    ]  # shared (tied) ones once
    if sum(t.numel() * 4 for t in weights) > (_available_bytes() // 2 if budget is None else budget):
        return False
    for tensor in itertools.chain(weights, module.buffers()):
        if tensor.is_floating_point() and tensor.dtype != torch.float32:
            low = tensor.data
            tensor.data = low.float()
            release_file_pages([low])  # a checkpoint file kept mapped (its other tensors) keeps none of these pages
    return True


def _available_bytes() -> int:
    """The memory the system has available (``MemAvailable``); 0 where it cannot be read (then
    ``computes_in_fp32`` lends weights per call: never more memory than needed)."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


def fp32_scratch(module: nn.Module) -> Scratch:
    """The fp32 buffers of ``module`` (``computes_in_fp32``, which it must have been through):
    what a forward that computes its own fp32 weight (``parity.quantized``) fills and gives back."""
    scratch = getattr(module, _SCRATCH, None)
    assert isinstance(scratch, Scratch), "computes_in_fp32(module) attaches the scratch buffers"
    return scratch


def drop_fp32_buffers(module: nn.Module) -> None:
    """Free the fp32 buffers ``computes_in_fp32`` keeps between calls (about one layer's weights
    and the LM head's); the next call allocates them again."""
    scratch = getattr(module, _SCRATCH, None)
    if isinstance(scratch, Scratch):
        scratch.clear()


_CHUNK_ELEMENTS = 1 << 24  # a Linear weight above this (64 MB in fp32, e.g. an LM head) is lent in row slices


def _linear_in_slices(module: nn.Linear, scratch: Scratch, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` in fp32 with its weight's rows lent a slice at a time (the output features
    are independent dot products): a 152k-token LM head never exists whole in fp32."""
    weight, bias = module.weight, module.bias
    rows = max(1, _CHUNK_ELEMENTS // weight.shape[1])
    parts = []
    for start in range(0, weight.shape[0], rows):
        lent = scratch.lend(weight[start : start + rows])
        parts.append(torch.nn.functional.linear(x, lent, None if bias is None else bias[start : start + rows].float()))
        scratch.give_back(lent)
    return torch.cat(parts, dim=-1)


def _lend_during_calls(module: nn.Module, names: list[str], scratch: Scratch) -> None:
    stored: list[dict[str, nn.Parameter | None]] = []  # a stack: a module may be re-entered

    # Module._parameters is private, but no public API swaps a parameter for a plain tensor for one
    # call (setattr refuses a non-Parameter; torch.func.functional_call lends every tensor at once)
    def before(mod: nn.Module, args: object) -> None:
        originals = {name: mod._parameters[name] for name in names}
        stored.append(originals)
        for name, tensor in originals.items():
            assert tensor is not None, "names are of parameters that exist"
            # a plain tensor for one call (no autograd here)
            mod._parameters[name] = scratch.lend(tensor)  # type: ignore[assignment]

    def after(mod: nn.Module, args: object, output: object) -> None:
        for name, tensor in stored.pop().items():
            scratch.give_back(mod._parameters[name])  # type: ignore[arg-type]  # the tensor lent in before()
            mod._parameters[name] = tensor

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


class TorchRunner:
    """The PyTorch model, called through the same flat contract the graphs were traced from, on
    the parity device of its making (``runners.device.current``): on CUDA the module (in place)
    and each run's inputs are moved to the GPU and its outputs come back as CPU numpy arrays."""

    name = "torch"

    def __init__(self, module: nn.Module, n_layers: int, last_logits_only: bool = False) -> None:
        self._module, self._n_layers, self._last = computes_in_fp32(module), n_layers, last_logits_only
        self._cuda = current().cuda
        self._placed()
        # the cache tensors' names: one tuple for every layer (keys and values, or Mamba2's conv and ssm),
        # or one tuple per layer (a hybrid's: key/value on its attention layers, conv/ssm on the others)
        names = tuple(getattr(module, "cache_names", ("key", "value")))
        self._cache: tuple[tuple[str, ...], ...] = (
            tuple(tuple(n) for n in names) if names and not isinstance(names[0], str) else (names,) * n_layers
        )
        self._wrappers: dict[tuple[GraphKind, bool, bool], GraphModule] = {}

    def graphs(self) -> tuple[GraphKind, ...]:
        return tuple(GraphKind)

    def _placed(self) -> None:
        """On CUDA, the module's parameters and buffers on the GPU (a no-op for those there already:
        also those a parity stage attached after this runner was made, e.g. int4 codes)."""
        if self._cuda:
            self._module.to("cuda")

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """A feed as a tensor on the runner's device (on the CPU: the array's own memory)."""
        tensor = torch.from_numpy(array)
        return tensor.to("cuda") if self._cuda else tensor

    @torch.no_grad()
    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        self._placed()
        if kind is GraphKind.ENCODER and ENCODER_FEATURES in feeds:  # a speech encoder's (computes in fp32)
            features = self._tensor(feeds[ENCODER_FEATURES]).float()
            return {ENCODER_STATES: _numpy(FeaturesEncoderModule(self._module)(features))}
        if kind is GraphKind.ENCODER:
            states = EncoderModule(self._module)(
                self._tensor(feeds["input_ids"]), self._tensor(feeds["attention_mask"])
            )
            return {ENCODER_STATES: _numpy(states)}
        # a cross-attention decoder shows itself by its inputs: encoder states or a cross cache
        cross = ENCODER_STATES in feeds or cross_past_names(0)[0] in feeds
        masked = ENCODER_MASK in feeds  # an encoder-decoder's
        if (kind, cross, masked) not in self._wrappers:  # built once: kiln bench times this call
            self._wrappers[kind, cross, masked] = GraphModule(
                self._module, kind, self._n_layers, self._last, cross, masked
            ).eval()
        wrapper = self._wrappers[kind, cross, masked]
        ids, mask, pos = (self._tensor(feeds[n]) for n in ("input_ids", "attention_mask", "position_ids"))
        # the reference computes in fp32 whatever the graphs' float I/O dtype
        extra: torch.Tensor | list[torch.Tensor] | None
        if kind is GraphKind.PREFILL:
            extra = self._tensor(feeds[ENCODER_STATES]).float() if cross else None
        else:
            names = [
                n for i in range(self._n_layers) for n in (*self._own(PAST, i), *(cross_past_names(i) if cross else ()))
            ]
            # a shared_kv layout's last layers take no cache (plugins/cache_layout.py): the contract gives them no feed
            extra = [self._tensor(feeds[n]).float() for n in names if n in feeds]
        outs = (
            wrapper(ids, mask, pos, self._tensor(feeds[ENCODER_MASK]), extra)
            if masked
            else wrapper(ids, mask, pos, extra)
        )
        names = ["logits"]
        for i in range(self._n_layers):  # a shared_kv layout's last layers return none: cut below
            names += [*self._own(PRESENT, i), *(cross_present_names(i) if cross and kind is GraphKind.PREFILL else ())]
        return {n: _numpy(t) for n, t in zip(names[: len(outs)], outs, strict=True)}

    def _own(self, prefix: str, layer: int) -> tuple[str, ...]:
        """Layer ``layer``'s own cache tensors' names (``past_names``/``present_names`` for keys and values)."""
        return tuple(f"{prefix}.{layer}.{name}" for name in self._cache[layer])


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """An output as a CPU numpy array (on the CPU: the tensor's own memory, as before the device)."""
    return tensor.numpy() if tensor.device.type == "cpu" else tensor.cpu().numpy()
