"""int4's proof, built apart from the graphs it judges: the quantizer's own numbers, kept from the
quantization step, PyTorch's model on them, and a check that every graph weight holds them.

The quantizer's codes and scales (``int4.quantize``: RTN or GPTQ) are spilled, once the graphs are
written, to a safetensors file in the export's staging directory (``write_numbers``: the packed
codes as ONNX INT4 bytes, half a byte a weight, and the scales, per module the MatMul belongs to;
deleted once the reference has read them), so the quantizer's memory is freed before parity as it was.
``kiln check`` gets the same numbers by running the quantizer again on the checkpoint with the
export's recorded options (``int4.rerun``) and judges with the same functions.
``quantizer_model`` makes the second reference compute on them (``parity.quantized``), and
``check_graph_weights`` reads every int4 weight of every graph set, the portable
``DequantizeLinear`` blocks and the ``--target ort`` ``MatMulNBits`` (packed q/k/v or gate/up
side by side, split by their ``Split``), and compares codes and scales bit for bit with the
quantizer's, naming the first weight and block that differ. A wrong number written into a graph
is therefore refused by name, and never copied into its own reference (docs/parity.md).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import onnx_ir as ir

from kiln.errors import ParityError
from kiln.exporter.parity.driver import QuantizedModel
from kiln.exporter.parity.quantized import Int4Weight
from kiln.exporter.passes.ir_utils import read_uncached
from kiln.exporter.passes.names import module_of

__all__ = [
    "NUMBERS_FILE",
    "QuantizerNumbers",
    "write_numbers",
    "proved_numbers",
    "quantizer_model",
    "check_graph_weights",
]

NUMBERS_FILE = ".kiln-int4-numbers.safetensors"  # in the staging directory, removed after parity
_DTYPES = {np.dtype(np.uint8): "U8", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
_MS = "com.microsoft"


def write_numbers(
    path: Path, numbers: Iterable[tuple[str, np.ndarray, np.ndarray, tuple[int, int]]]
) -> QuantizerNumbers:
    """``numbers`` (module, packed codes, scale [K/B, N], (K, N)) as a safetensors file at ``path``,
    written tensor by tensor (no second copy of them in memory)."""
    items = [
        (module, np.ascontiguousarray(packed), np.ascontiguousarray(scale), shape)
        for module, packed, scale, shape in numbers
    ]
    header: dict[str, object] = {"__metadata__": {"int4": json.dumps({m: list(s) for m, _, _, s in items})}}
    offset = 0
    for module, packed, scale, _ in items:
        for name, array in ((f"{module}.q", packed), (f"{module}.scale", scale)):
            header[name] = {
                "dtype": _DTYPES[array.dtype],
                "shape": list(array.shape),
                "data_offsets": [offset, offset + array.nbytes],
            }
            offset += array.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, packed, scale, _ in items:
            f.write(packed.tobytes())
            f.write(scale.tobytes())
    return QuantizerNumbers(path)


class QuantizerNumbers:
    """The quantizer's numbers as spilled: per module, codes int8 [K, N] and scale [K/B, N]."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        self._file: Any = cast(Any, safe_open(str(path), framework="numpy"))  # its numpy readers are untyped
        shapes = json.loads((self._file.metadata() or {})["int4"])
        self.shapes: dict[str, tuple[int, int]] = {m: (int(k), int(n)) for m, (k, n) in shapes.items()}

    @property
    def modules(self) -> list[str]:
        return list(self.shapes)

    def numbers(self, module: str) -> tuple[np.ndarray, np.ndarray]:
        packed = self._file.get_tensor(f"{module}.q")
        return _unpack_int4(packed, self.shapes[module]), self._file.get_tensor(f"{module}.scale")

    def weights(self) -> Iterator[Int4Weight]:
        """The reference's weights (``use_int4_weights``), one module at a time; the file is
        deleted once they are read (or the reading stopped): nothing reads it again."""
        try:
            for module in self.shapes:
                q, scale = self.numbers(module)
                yield Int4Weight(module, f"the quantizer's {module}", q, np.array(scale, dtype=np.float32))
        finally:
            self.close()

    def close(self) -> None:
        self._file = None
        self.path.unlink(missing_ok=True)


def proved_numbers(
    path: Path,
    numbers: Iterable[tuple[str, np.ndarray, np.ndarray, tuple[int, int]]],
    sets: Sequence[tuple[str, Sequence[Path]]],
    refused: str,
) -> QuantizerNumbers:
    """The quantizer's ``numbers`` spilled to ``path`` (``write_numbers``) once every graph set's
    int4 weights are checked bit for bit against them (``check_graph_weights``), or a
    ``ParityError`` of ``refused`` and the first difference (the file removed): the one path of an
    export's proof and of ``kiln check``'s."""
    spilled = write_numbers(path, numbers)
    failure = check_graph_weights(spilled, sets)
    if failure is not None:
        spilled.close()
        raise ParityError(f"{refused}: {failure}")
    return spilled


def quantizer_model(numbers: QuantizerNumbers, agreement_gates: bool = True) -> QuantizedModel:
    """The second reference of an ``--int4`` export: PyTorch on the quantizer's own numbers."""
    return QuantizedModel(numbers.weights, agreement_gates)


def _unpack_int4(packed: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """ONNX INT4 bytes (element 2j in the low nibble) -> int8 codes of ``shape``."""
    nibbles = np.empty(2 * packed.size, np.uint8)
    nibbles[0::2], nibbles[1::2] = packed & 0x0F, packed >> 4
    codes = nibbles[: shape[0] * shape[1]].view(np.int8)
    codes ^= 8  # 0..15 as two's complement int4: (x ^ 8) - 8, in place
    codes -= 8
    return codes.reshape(shape)


def _nbits_numbers(node: ir.Node) -> tuple[np.ndarray, np.ndarray] | None:
    """A 4-bit ``MatMulNBits``' codes [K, N] (its ``q + 8`` uint4 of ``[N, K/B, B/2]``) and scales [K/B, N]."""
    attrs = {name: attr.value for name, attr in node.attributes.items()}
    b, s = node.inputs[1], node.inputs[2]
    if attrs.get("bits") != 4 or b is None or s is None or b.const_value is None or s.const_value is None:
        return None
    k, n, block = int(attrs["K"]), int(attrs["N"]), int(attrs["block_size"])
    packed = read_uncached(b.const_value, np.dtype(np.uint8)).reshape(n, -1)
    codes = np.empty((n, 2 * packed.shape[1]), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = packed & 0x0F, packed >> 4
    q = codes[:, :k].view(np.int8)
    q -= 8  # q + 8 as uint4: in place
    scale = np.asarray(s.const_value.numpy()).reshape(n, -(-k // block)).T
    return np.ascontiguousarray(q.T), np.ascontiguousarray(scale)


def _first_difference(q: np.ndarray, scale: np.ndarray, want_q: np.ndarray, want_scale: np.ndarray) -> str | None:
    """Where a graph weight's codes and scales first differ, bit for bit, from the quantizer's."""
    if q.shape != want_q.shape or scale.shape != want_scale.shape:
        return (
            f"codes {list(q.shape)} and scales {list(scale.shape)} where the quantizer made {list(want_q.shape)} and "
            f"{list(want_scale.shape)}"
        )
    if scale.dtype != want_scale.dtype:
        return f"{scale.dtype} scales where the quantizer made {want_scale.dtype}"
    blocks, n = scale.shape
    block = q.shape[0] // blocks
    bits = np.dtype(f"u{scale.dtype.itemsize}")
    bad_scale = scale.view(bits) != want_scale.view(bits)
    bad_codes = (q != want_q).reshape(blocks, block, n)
    bad = bad_scale | bad_codes.any(axis=1)
    if not bad.any():
        return None
    at, col = (int(i) for i in np.argwhere(bad)[0])
    where = f"block {at} (rows {at * block}-{(at + 1) * block - 1}), column {col}"
    if bad_scale[at, col]:
        return f"{where}: scale {float(scale[at, col]):.8g} where the quantizer made {float(want_scale[at, col]):.8g}"
    row = at * block + int(np.argmax(bad_codes[at, :, col]))
    return f"{where}: code {int(q[row, col])} at row {row} where the quantizer made {int(want_q[row, col])}"


def _dq_weight(node: ir.Node) -> tuple[list[str], np.ndarray, np.ndarray] | None:
    """A portable int4 ``DequantizeLinear``'s module (its MatMul's), codes and scales."""
    weight = node.inputs[0] if node.op_type == "DequantizeLinear" and node.domain == "" and node.inputs else None
    if (
        weight is None
        or weight.dtype != ir.DataType.INT4
        or weight.const_value is None
        or len(node.inputs) < 2
        or node.inputs[1] is None
    ):
        return None
    scale = node.inputs[1].const_value
    modules = sorted({module_of(u.node) for u in node.outputs[0].uses()})
    q = read_uncached(weight.const_value, np.dtype(np.int8))
    return modules, q, np.asarray(scale.numpy()) if scale is not None else np.zeros((0, 0), np.float32)


def _split_sizes(node: ir.Node) -> list[int] | None:
    """The column sizes of the ``Split`` a packed MatMulNBits feeds (None: it feeds no Split), through
    the ``Add`` nodes between them (a bias, or ``--lora-slots``' low-rank delta added before the split).
    A part split again (a packed q/k/v packed once more with a parallel MLP's gate/up: Cohere2's
    layers without rotary) gives its own parts' sizes in its place."""
    split = _split_of(node.outputs[0])
    sizes = _sizes(split) if split is not None else None
    if split is None or sizes is None or len(sizes) != len(split.outputs):
        return None
    parts: list[int] = []
    for size, part in zip(sizes, split.outputs, strict=True):
        inner = _split_of(part)
        inner_sizes = _sizes(inner) if inner is not None else None
        parts += inner_sizes if inner_sizes is not None and sum(inner_sizes) == size else [size]
    return parts


def _split_of(value: ir.Value) -> ir.Node | None:
    """The ``Split`` that ``value`` alone feeds, through up to three ``Add`` nodes (None: none)."""
    for _ in range(4):
        users = [u.node for u in value.uses()]
        if len(users) != 1:
            return None
        if users[0].op_type == "Split":
            return users[0]
        if users[0].op_type != "Add":
            return None
        value = users[0].outputs[0]
    return None


def _sizes(split: ir.Node) -> list[int] | None:
    sizes = split.inputs[1].const_value if len(split.inputs) > 1 and split.inputs[1] is not None else None
    return [int(v) for v in np.asarray(sizes.numpy()).reshape(-1)] if sizes is not None else None


class _Judge:
    """One graph set's int4 weights against the quantizer's numbers: the first difference, and the
    modules the set holds (each must hold every one the quantizer made)."""

    def __init__(self, numbers: QuantizerNumbers, label: str) -> None:
        self.numbers, self.label = numbers, label
        self.covered: set[str] = set()
        self.failure: str | None = None

    def fail(self, where: str, what: str) -> None:
        if self.failure is None:
            self.failure = f"{self.label}: {where}: {what}"

    def one(self, where: str, module: str, q: np.ndarray, scale: np.ndarray) -> None:
        if module not in self.numbers.shapes:
            return self.fail(where, f"an int4 weight of {module!r}, which the quantizer made no numbers for")
        self.covered.add(module)
        found = _first_difference(q, scale, *self.numbers.numbers(module))
        if found is not None:
            self.fail(where, f"{module}'s int4 weight differs from the quantizer's numbers at {found}")

    def packed(self, where: str, prefix: str, q: np.ndarray, scale: np.ndarray, sizes: list[int]) -> None:
        """Side-by-side weights: each part the next same-shaped module not matched yet of the packed
        node's layer (its ``<name>.<index>``, as ``layers.0``: a fused attention's packed node is named
        after no module of its own), in the quantizer's order."""
        layer = re.search(r"(?:^|\.)([A-Za-z_]\w*\.\d+)\.", prefix)
        scope = layer.group(1) if layer else ""
        candidates = [
            m for m in self.numbers.modules if _in_layer(m, scope) and self.numbers.shapes[m][0] == q.shape[0]
        ]
        start = 0
        for part, size in enumerate(sizes):
            pq, ps = q[:, start : start + size], scale[:, start : start + size]
            start += size
            shaped = [m for m in candidates if self.numbers.shapes[m][1] == size and m not in self.covered]
            match = next((m for m in shaped if _first_difference(pq, ps, *self.numbers.numbers(m)) is None), None)
            if match is not None:
                self.covered.add(match)
            elif shaped:
                self.one(f"{where} (part {part}, columns {start - size}-{start - 1})", shaped[0], pq, ps)
            else:
                self.fail(
                    where,
                    f"part {part} ({size} columns) matches no int4 weight the quantizer made in {scope or 'the model'}",
                )

    def node(self, node: ir.Node) -> None:
        where = node.name or node.op_type
        dq = _dq_weight(node)
        if dq is not None:
            modules, q, scale = dq
            if len(modules) != 1 or not modules[0]:
                return self.fail(
                    where, f"its int4 weight does not feed the MatMul of one named module (found {modules})"
                )
            return self.one(where, modules[0], q, scale)
        nbits = _nbits_numbers(node) if node.op_type == "MatMulNBits" and node.domain == _MS else None
        if nbits is None:
            return None
        if len(node.inputs) > 3 and node.inputs[3] is not None:
            return self.fail(where, "a zero point where the quantizer's codes are symmetric (the default zero point 8)")
        sizes, module = _split_sizes(node), module_of(node)
        # one module's whole weight whose output the model itself splits (Mamba2's in_proj) is no packed node
        if sizes is None or self.numbers.shapes.get(module, (0, 0))[1] == sum(sizes):
            return self.one(where, module, *nbits)
        return self.packed(where, where.split("/")[1] if where.count("/") >= 2 else "", *nbits, sizes)


def _in_layer(module: str, layer: str) -> bool:
    return not layer or module.startswith(f"{layer}.") or f".{layer}." in module


def _tensor_key(node: ir.Node) -> tuple[object, ...]:
    """What a weight is stored as (the graphs of one set share their weights file): read once per set."""
    tensor = node.inputs[0 if node.op_type == "DequantizeLinear" else 1] if len(node.inputs) > 1 else None
    const = tensor.const_value if tensor is not None else None
    if isinstance(const, ir.ExternalTensor):
        return (str(const.location), const.offset, const.length, node.op_type)
    return (id(const), node.name)


def check_graph_weights(numbers: QuantizerNumbers, sets: Sequence[tuple[str, Sequence[Path]]]) -> str | None:
    """The first int4 graph weight, over every graph of every set (its label, its graph paths),
    whose codes or scales are not bit for bit the quantizer's, or a set missing one: None when all hold them."""
    for label, paths in sets:
        judge, seen = _Judge(numbers, label), set()
        for path in paths:
            judge.label = f"{label} {path.name}"
            for node in ir.load(path).graph:
                if node.op_type in ("DequantizeLinear", "MatMulNBits") and (key := _tensor_key(node)) not in seen:
                    seen.add(key)
                    judge.node(node)
                if judge.failure is not None:
                    return judge.failure
        missing = [m for m in numbers.modules if m not in judge.covered]
        if missing:
            return (
                f"{label}: holds no int4 weight for {missing[:3]}{' and more' if len(missing) > 3 else ''}, which "
                "the quantizer made numbers for"
            )
    return None
