"""Which recurrent-state families ``--target onnx`` writes (cache kinds ``state`` and ``hybrid``:
``plugins/cache_layout.py``), each proved by a test (tests/export/test_onnx_target_state.py: fp32
and fp16 parity, and ``kiln generate``'s greedy tokens equal to transformers').

In the target's graphs a state tensor (the conv window, the SSM state) is a plain input and output
of its fixed shape, the step returning its replacement; only the keys and values of the attention
layers go into the static buffers written in place (``cache``). The state is not written in place:
the mixer reads its past after other nodes of the step have run, and TensorRT aliases an output to
an input only for ``IKVCacheUpdateLayer`` (``ICudaEngine.get_aliased_input_tensor``; binding one
buffer as a plain input and output is not supported: NVIDIA/TensorRT issue 4681 reports wrong
results), so a host keeps two buffers per state tensor and swaps them each step (``kiln generate``:
``runtime.kv_strategies.StaticKv``; Triton's implicit state does the same by default).

The traces of the proved families hold standard ONNX ops only, each one TensorRT's ONNX parser
imports (onnx-tensorrt ``docs/operators.md``): the mixers' ``Conv`` (grouped 1-D), ``CumSum`` (float,
its axis a constant), ``Einsum``, ``Trilu``, ``Softplus``, ``Exp``, ``Clip``, ``Where`` beside the
attention layers' ``Attention``/``TensorScatter``; ``standard_ops`` checks every written graph for a
node outside ONNX's own domain or a control-flow op.

Which families are proved is theirs to say (``DecoderSpec.static_state``, a ``StaticStateProof``:
the precisions a test proves, or why the trace cannot be written so); this folder names none.
Another family with such a state is refused by name until it declares a test's proof.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.errors import ExportError
from kiln.plugins.base import DecoderSpec

__all__ = ["proved_architectures", "refuse_state", "standard_ops"]

CONTROL_FLOW = ("Loop", "Scan", "If")  # a trace with these is not one TensorRT runs as the portable graph does
CUMSUM_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)  # onnx-tensorrt docs/operators.md
EXPORTED = "the portable graphs (and --target ort) export it"  # what a refused family's export writes instead


def proved_architectures() -> list[str]:
    """The architectures whose family declares their state proved here (``DecoderSpec.static_state``),
    asked of every registered family's rows (``plugins.family_rows``), in their order."""
    from kiln.plugins import family_rows

    return [
        _architecture(spec) for spec in family_rows() if spec.static_state is not None and spec.static_state.precisions
    ]


def _architecture(spec: DecoderSpec) -> str:
    return str(spec.config.get("architecture") or spec.family)


def refuse_state(spec: DecoderSpec, precision: str = "fp32") -> str | None:
    """Why ``--target onnx`` does not write this state or hybrid cache at ``precision`` (its value:
    fp32, fp16, int4...), or None when it does: what the family declares of it (``static_state``)."""
    arch, declared = _architecture(spec), spec.static_state
    proved = declared.precisions if declared is not None else ()
    if proved and precision not in proved:
        return (
            f"--target onnx writes a recurrent state ({spec.cache_layout.kind} cache) at {' and '.join(proved)} "
            f"only, each proved by a test; export {arch} at {precision} without --target onnx"
        )
    if proved:
        return None
    if declared is not None and declared.unparsed:
        return f"--target onnx does not write {arch}: {declared.unparsed}; {EXPORTED}"
    proved_here = ", ".join(proved_architectures()) or "no family yet"
    return (
        f"--target onnx writes a recurrent state ({spec.cache_layout.kind} cache) only for {proved_here}, each proved "
        f"by a test; this {arch} model is not one: {EXPORTED}"
    )


def standard_ops(model: ir.Model) -> list[str]:
    """Refuse a graph with a node outside ONNX's own domain (``com.microsoft`` ops are plugins to
    TensorRT's parser) or a control-flow op; returns the graph's op types, sorted (its report)."""
    for node in model.graph:
        if node.domain not in ("", "ai.onnx") or node.op_type in CONTROL_FLOW:
            raise ExportError(
                f"--target onnx: node {node.name!r} is {node.domain or 'ai.onnx'}::{node.op_type}, not a standard op "
                "TensorRT's ONNX parser imports; export without --target onnx"
            )
        summed = node.inputs[0].dtype if node.op_type == "CumSum" and node.inputs and node.inputs[0] else None
        if summed is not None and summed not in CUMSUM_TYPES:
            raise ExportError(
                f"--target onnx: CumSum {node.name!r} sums {summed.name}, and TensorRT's parser takes CumSum in FP32, "
                "FP16 and BF16 only; export without --target onnx"
            )
    return sorted({node.op_type for node in model.graph})
