"""Pass: a traced graph's initializers bound, lazily, to the model's own tensors.

The graphs are traced from a model whose weights are on the meta device (no memory:
``exporter.trace``), so their initializers hold no data. Each one is named after the module
tensor it is (``model.layers.0.attn.q_proj.weight``: the exporter names a parameter by its
qualified name), and this pass points it at that tensor through a ``ModuleWeight``: a lazy
tensor, a recipe (the module tensor's name, then transforms such as a transpose or an fp16
conversion) that is read only when a pass needs its values or the weights writer writes it, one
tensor at a time. So no graph holds a copy of the model's weights, whatever the model's size,
and a bf16 checkpoint is converted tensor by tensor, never as a whole. The recipe is also what
the per-layer stamp renames (``passes.stamp``) and what the weights writer dedupes by.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
import onnx_ir as ir
import torch
from torch import nn

from kiln.errors import ExportError
from kiln.file_pages import release_file_pages

__all__ = ["Transform", "ModuleWeight", "WeightSource", "BindWeights"]

_UNBOUND = "kiln-trace-cache-unbound"  # trace.cache.UNBOUND (kept apart: passes do not import the trace stage)

_TORCH_DTYPES = {
    ir.DataType.FLOAT: torch.float32,
    ir.DataType.FLOAT16: torch.float16,
    ir.DataType.INT64: torch.int64,
    ir.DataType.INT32: torch.int32,
    ir.DataType.BOOL: torch.bool,
}


@dataclasses.dataclass(frozen=True)
class Transform:
    """One step of a weight's recipe: ``func`` on its values (torch: its kernels are threaded and
    its transposes blocked; any float dtype in, the same values as from fp32), ``shape`` on its
    shape."""

    name: str
    func: Callable[[torch.Tensor], torch.Tensor]
    shape: Callable[[tuple[int, ...]], tuple[int, ...]] = lambda shape: shape
    dtype: ir.DataType | None = None  # the dtype it converts to (None: unchanged)
    # how the weights writer makes the result a slice of rows at a time (``ModuleWeight.chunks``): "view" (``func``
    # returns a view: applied to the whole tensor), "values" (``func`` maps each value alone: applied to each
    # slice); "" (neither): the result is made whole
    slices: str = ""


class WeightSource:
    """The tensors of the module a graph was traced from (the reference, folded), by the name the
    exporter gives them: ``model.`` (the contract wrapper's attribute) + the qualified name.
    Tied parameters answer to every name they have."""

    def __init__(self, module: nn.Module) -> None:
        named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        self._tensors = {f"model.{name}": tensor for name, tensor in named}
        self._abs_max: dict[str, float] = {}

    def abs_max(self, name: str) -> float:
        """The largest magnitude in a module tensor, computed once (each graph's fp16 rules ask)."""
        if name not in self._abs_max:
            flat = self.tensor(name).detach().reshape(-1)
            step = 1 << 24  # elements at a time: no full-size temporary
            self._abs_max[name] = max(
                (float(flat[i : i + step].abs().max()) for i in range(0, flat.numel(), step)), default=0.0
            )
        return self._abs_max[name]

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise ExportError(f"the graph reads {name}, which the model has no tensor of that name for")
        return self._tensors[name]


class ModuleWeight(ir.LazyTensor):
    """A module tensor as ``dtype``, then ``transforms``, computed on demand (``tobytes()``,
    ``numpy()``). ``key`` names the recipe: the same key in two graphs is the same bytes."""

    def __init__(
        self, source: WeightSource, name: str, dtype: ir.DataType, transforms: tuple[Transform, ...] = ()
    ) -> None:
        tensor = source.tensor(name)
        shape, final = tuple(int(d) for d in tensor.shape), dtype
        for transform in transforms:
            shape, final = transform.shape(shape), transform.dtype or final
        super().__init__(self._compute, final, ir.Shape(shape), name=name)
        self.source, self.module_name, self.base_dtype, self.transforms = source, name, dtype, transforms
        self.key = "|".join([name, dtype.name, *(t.name for t in transforms)])

    def _compute(self) -> ir.TensorProtocol:
        return ir.tensor(self.array())

    def array(self) -> np.ndarray:
        """The values, contiguous (of an fp32 module tensor without transforms: its own memory).

        A float tensor goes through the transforms in its own dtype (a bf16 weight is transposed
        and rounded to fp16 directly: the same values as through fp32, without an fp32 copy of
        it) and is converted to the final dtype in the one copy that also makes it contiguous."""
        source = self.source.tensor(self.module_name).detach()
        tensor = source
        if not (tensor.is_floating_point() and self.transforms):
            tensor = tensor.to(_TORCH_DTYPES[self.base_dtype])
        for transform in self.transforms:
            tensor = transform.func(tensor)
        final = _TORCH_DTYPES[self.dtype]
        if tensor.dtype != final or not tensor.is_contiguous():
            tensor = torch.empty(tensor.shape, dtype=final).copy_(tensor)
        if tensor.untyped_storage().data_ptr() != source.untyped_storage().data_ptr():
            self._read()  # else the values are the module tensor's own memory, which the caller reads
        return tensor.numpy()

    def chunks(self, limit: int) -> Iterator[np.ndarray]:
        """``array()``'s values, contiguous, a slice of rows of at most ``limit`` bytes at a time (one row
        where a row is more): the weights writer streams a weight without a whole-size copy of it. The
        view transforms are applied to the whole tensor, the per-value ones and the conversion slice by
        slice (the same values: neither depends on a value's neighbours). A recipe with a transform that
        cannot be sliced, or a tensor without rows, comes whole."""
        tensor = self.source.tensor(self.module_name).detach()
        views = [t for t in self.transforms if t.slices == "view"]
        values = [t for t in self.transforms if t.slices == "values"]
        if len(views) + len(values) < len(self.transforms) or tensor.dim() == 0 or tensor.numel() == 0:
            yield self.array()
            return
        base = None if tensor.is_floating_point() and self.transforms else _TORCH_DTYPES[self.base_dtype]
        for transform in views:
            tensor = transform.func(tensor)
        final = _TORCH_DTYPES[self.dtype]
        rows = max(1, limit // (tensor[0].numel() * final.itemsize))
        for start in range(0, tensor.shape[0], rows):
            part = _contiguous(tensor[start : start + rows])
            part = part.to(base) if base is not None else part
            for transform in values:
                part = transform.func(part)
            same = part.dtype == final and part.is_contiguous()
            yield (part if same else torch.empty(part.shape, dtype=final).copy_(part)).numpy()
        self._read()

    def _read(self) -> None:
        """The module tensor's values are read (into new memory, or written out chunk by chunk): its
        checkpoint file's pages go back to the page cache (``file_pages``; a bf16 8B model's would
        otherwise stay in the process until it ends)."""
        release_file_pages([self.source.tensor(self.module_name)])

    @property
    def identity(self) -> tuple[object, ...]:
        """What the bytes are computed from: the module tensor's memory and view (tied parameters share
        them under two names) and the recipe. The same identity is the same bytes, read once."""
        tensor = self.source.tensor(self.module_name)
        memory = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.stride()))
        return (*memory, tuple(tensor.shape), tensor.dtype, self.base_dtype, *(t.name for t in self.transforms))

    def abs_max(self) -> float:
        """The largest magnitude of the module tensor (a transpose does not change it)."""
        assert all(t.dtype is None for t in self.transforms), "abs_max is of the unconverted values"
        return self.source.abs_max(self.module_name)

    def then(self, transform: Transform) -> ModuleWeight:
        return ModuleWeight(self.source, self.module_name, self.base_dtype, (*self.transforms, transform))

    def renamed(self, name: str) -> ModuleWeight:
        """The same recipe on another module tensor (a stamped layer's)."""
        return ModuleWeight(self.source, name, self.base_dtype, self.transforms)

    @property
    def module_tensor(self) -> torch.Tensor:
        return self.source.tensor(self.module_name)


_SHORT_ROW = 2048  # values: a transposed slice with rows up to this long is copied as it is


def _contiguous(part: torch.Tensor) -> torch.Tensor:
    """``part`` in contiguous memory. A slice of a transposed matrix with long rows (the matrix's
    columns) is gathered as the matrix's column block, then transposed by torch's blocked copy: a
    plain strided copy reads a cache line per value, which the next row reuses only while a row's
    lines stay in cache (2-4x slower at Llama-8B's shapes; about even at 896-wide rows)."""
    if part.is_contiguous():
        return part
    if part.dim() == 2 and part.stride(0) == 1 and part.shape[1] > _SHORT_ROW:
        block = part.t().contiguous()
        return torch.empty(part.shape, dtype=part.dtype).copy_(block.t())
    return part.contiguous()


def _unbound(value: ir.Value) -> bool:
    """An initializer still holding the exporter's tensor of a meta-device parameter (or the
    trace cache's placeholder of one: ``trace.cache``)."""
    raw = getattr(value.const_value, "raw", None)
    placeholder = isinstance(value.const_value, ir.ExternalTensor) and value.const_value.location == _UNBOUND
    return placeholder or (isinstance(raw, torch.Tensor) and raw.device.type == "meta")


def _bound(source: WeightSource, name: str, value: ir.Value) -> ModuleWeight:
    """``value`` (the traced initializer ``name``) as the module tensor of that name, which must
    have the traced shape (a shape the trace did not see would break every reader)."""
    assert value.dtype is not None
    weight = ModuleWeight(source, name, value.dtype)
    traced = (
        value.shape if value.shape is not None else value.const_value.shape if value.const_value is not None else None
    )
    if traced is not None and list(traced) != list(weight.shape):
        raise ExportError(
            f"the traced graph reads {name} as {list(traced)}, but the model's tensor of that name is "
            f"{list(weight.shape)}"
        )
    return weight


class BindWeights(ir.passes.InPlacePass):
    """Every initializer named after a module tensor -> that tensor, lazily (``ModuleWeight``),
    refused (``ExportError``) when its shape is not the traced one. Postcondition: no
    initializer is left without data (a meta tensor the module lacks)."""

    def __init__(self, source: WeightSource) -> None:
        super().__init__()
        self.source = source

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        for name, value in model.graph.initializers.items():
            if name in self.source and value.dtype in _TORCH_DTYPES:
                value.const_value = _bound(self.source, name, value)
        return ir.passes.PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        unbound = sorted(name for name, value in model.graph.initializers.items() if _unbound(value))
        if unbound:
            raise ExportError(f"the traced graph reads {unbound[:3]}, which the model has no tensor of that name for")
