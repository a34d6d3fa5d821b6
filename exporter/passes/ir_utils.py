"""Small onnx-ir helpers the ONNX Runtime target passes share: constants, scalar reads, walks."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

__all__ = [
    "MS_DOMAIN",
    "constant",
    "copy_type",
    "replace_value",
    "set_dtype",
    "clone",
    "scalar_of",
    "producer",
    "single_consumer",
    "skip_casts",
    "use_ms_domain",
    "read_uncached",
]

MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops


def use_ms_domain(model: ir.Model) -> None:
    """Declare the ``com.microsoft`` opset on ``model`` (and its graph), once."""
    model.graph.opset_imports.setdefault(MS_DOMAIN, 1)
    model.opset_imports.setdefault(MS_DOMAIN, 1)


def constant(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """An initializer ``name`` holding ``array`` (reused when the graph already has that name)."""
    if name in graph.initializers:
        return graph.initializers[name]
    value = ir.val(name, const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


def scalar_of(value: ir.Value | None) -> float | None:
    """The value of a one-element constant (initializer or ``Constant`` node), else None."""
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None:
        node = value.producer()
        if node is None or node.op_type != "Constant" or "value" not in node.attributes:
            return None
        tensor = node.attributes["value"].as_tensor()
    array = tensor.numpy()
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def producer(value: ir.Value | None, op_type: str | tuple[str, ...]) -> ir.Node | None:
    """The node that makes ``value`` when it has one of the given op types."""
    if value is None:
        return None
    node = value.producer()
    types = (op_type,) if isinstance(op_type, str) else op_type
    return node if node is not None and node.op_type in types and node.domain == "" else None


def single_consumer(value: ir.Value, op_type: str) -> ir.Node | None:
    """The only node reading ``value``, when it has ``op_type`` and ``value`` is no graph output."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    node = uses[0].node
    return node if node.op_type == op_type and node.domain == "" else None


def skip_casts(value: ir.Value) -> ir.Value:
    """Walk back through no-op float32->float32 Casts (the tracer leaves some around softmax)."""
    node = value.producer()
    while (
        node is not None
        and node.op_type == "Cast"
        and node.inputs[0] is not None
        and node.inputs[0].dtype == value.dtype
    ):
        value = node.inputs[0]
        node = value.producer()
    return value


def replace_value(old: ir.Value, new: ir.Value) -> None:
    """Every use of ``old`` (graph outputs too) reads ``new``; a graph output keeps its name
    (``new`` takes it, ``old`` is renamed ``<name>.replaced``): rewrites never rename the contract."""
    output = old.is_graph_output()
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    if output and old.name is not None:
        name = old.name
        old.name, new.name = f"{name}.replaced", name


def clone(model: ir.Model) -> ir.Model:
    """A copy of ``model`` that shares its tensors (weights are not copied) but no type or shape
    object: ``Model.clone()`` shares those (onnx-ir 1.1), so a pass that refines one in place
    (shape inference, a dtype change) would change every copy."""
    copy = model.clone()
    graph = copy.graph
    for value in [*graph.inputs, *graph.initializers.values(), *(o for n in graph for o in n.outputs)]:
        if isinstance(value.type, ir.TensorType):
            value.type = ir.TensorType(value.type.dtype)
        if value.shape is not None:
            value.shape = ir.Shape(list(value.shape))
    return copy


def set_dtype(value: ir.Value, dtype: ir.DataType) -> None:
    """Give ``value`` a new tensor type of ``dtype``. Never ``value.dtype = ...``: that changes
    the type object in place, which ``Model.clone()`` shares between the copies (onnx-ir 1.1),
    so converting one graph of a set would convert the others' values too."""
    value.type = ir.TensorType(dtype)


def copy_type(dst: ir.Value, src: ir.Value) -> None:
    """Give ``dst`` the dtype and shape of ``src`` when it has them (setting a None dtype would
    serialize as an invalid tensor type)."""
    if src.dtype is not None:
        set_dtype(dst, src.dtype)
        dst.shape = src.shape


def read_uncached(tensor: ir.TensorProtocol, dtype: np.dtype) -> np.ndarray:
    """``tensor``'s values as a new ``dtype`` array, leaving nothing cached: an external tensor
    keeps what it loaded (an int4 weight unpacked to a byte per value) until released, so reading
    every int4 weight of an 8B graph through ``numpy()`` held 7 GB more until the graph was freed
    (an OOM of the ORT target's rewrite and of parity's int4 reference, measured on the
    Llama-3-8B shape)."""
    values = np.asarray(tensor.numpy()).astype(dtype)  # a copy, whatever numpy() returned
    if isinstance(tensor, ir.ExternalTensor):
        tensor.release()  # loaded again (a memory map) if read again
    return values
