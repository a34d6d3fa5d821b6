"""The numbers an int8 or fp8 Q/DQ export's quantization made, kept apart from its graphs.

Per graph (prefill, decode, unified: each is calibrated on its own feeds, so its activation
scales are its own) and per quantized MatMul's module: the scale of its input's
``QuantizeLinear -> DequantizeLinear`` pair, int8's scale of its output's pair (ONNX Runtime's
``QDQQuantizer`` quantizes a quantized MatMul's output too; fp8's pass does not), and its
weight's per-column scales. Every zero point is zero (both forms are symmetric). The precision
passes make them from the calibrator's ranges and the fp32 weights by kiln's own formulas
(``precision.qdq_scales``), before the quantizer writes anything; the export spills them to its
staging directory (``write_qdq_numbers``) and parity reads them back from there: its reference
(``parity.qdq_model``) and its weight-level check (``parity.qdq_proof``) are built on them, never
on the graphs they judge.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np

__all__ = ["NUMBERS_FILE", "QdqModule", "QdqNumbers", "write_qdq_numbers", "read_qdq_numbers"]

NUMBERS_FILE = ".kiln-qdq-numbers.safetensors"  # in the staging directory, removed after parity
FORMS = ("int8", "fp8")  # int8: float32 scales, int8 codes; fp8: float16 scales, float8e4m3fn codes


@dataclasses.dataclass(frozen=True)
class QdqModule:
    """One quantized MatMul's scales in one graph: ``input`` and ``output`` scalars (``output``
    None: its output is not quantized), ``weight`` ``[N]``, in the form's scale dtype."""

    module: str  # the module whose MatMul it is (``passes.names.module_of``)
    node: str  # the MatMul's name, for messages
    input: np.ndarray
    output: np.ndarray | None
    weight: np.ndarray


@dataclasses.dataclass(frozen=True)
class QdqNumbers:
    """An export's Q/DQ numbers: its form, and per graph kind (``GraphKind.value``) its modules'."""

    form: str
    graphs: Mapping[str, Mapping[str, QdqModule]]
    float16: bool = False  # the graphs around the Q/DQ are float16 (fp8; int8 with --fp16)

    def in_float16(self) -> QdqNumbers:
        """The numbers of a float16 graph, whose fp16 pass rounds every float constant to float16,
        int8's float32 scales included (after the quantizer made its codes with the float32 ones)."""
        return dataclasses.replace(self, float16=True)

    def held(self, scale: np.ndarray) -> np.ndarray:
        """``scale`` as the graphs hold it (float16 in a float16 graph)."""
        return scale.astype(np.float16) if self.float16 else scale


def write_qdq_numbers(path: Path, numbers: QdqNumbers) -> QdqNumbers:
    """``numbers`` as a safetensors file at ``path`` (tensors ``<graph>|<module>|input`` and so on,
    the MatMuls' names in its metadata); what ``read_qdq_numbers`` reads back from it."""
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    nodes: dict[str, dict[str, str]] = {}
    for graph, modules in numbers.graphs.items():
        nodes[graph] = {}
        for name, m in modules.items():
            nodes[graph][name] = m.node
            parts = {"input": m.input, "weight": m.weight} | ({"output": m.output} if m.output is not None else {})
            tensors |= {f"{graph}|{name}|{part}": np.ascontiguousarray(value) for part, value in parts.items()}
    save_file(
        tensors, str(path), metadata={"form": numbers.form, "nodes": json.dumps(nodes), "float16": str(numbers.float16)}
    )
    return read_qdq_numbers(path)


def read_qdq_numbers(path: Path) -> QdqNumbers:
    from safetensors import safe_open

    with cast(Any, safe_open(str(path), framework="numpy")) as f:  # its numpy readers are untyped
        meta = f.metadata() or {}
        form, nodes = meta["form"], json.loads(meta["nodes"])
        if form not in FORMS:
            raise ValueError(f"{path}: Q/DQ numbers of form {form!r}, not one of {FORMS}")
        names = set(f.keys())

        def get(graph: str, module: str, part: str) -> np.ndarray | None:
            key = f"{graph}|{module}|{part}"
            return np.asarray(f.get_tensor(key)) if key in names else None

        graphs: dict[str, dict[str, QdqModule]] = {}
        for graph, modules in nodes.items():
            graphs[graph] = {}
            for module, node in modules.items():
                scale, weight = get(graph, module, "input"), get(graph, module, "weight")
                assert scale is not None and weight is not None, "write_qdq_numbers writes both"
                output = get(graph, module, "output")  # scalars: safetensors may give them back as [1]
                graphs[graph][module] = QdqModule(
                    module, node, scale.reshape(()), output.reshape(()) if output is not None else None, weight
                )
    return QdqNumbers(form, graphs, meta.get("float16") == "True")
