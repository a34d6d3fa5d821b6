"""Pass: weight-only int4, the portable form (docs/precisions.md, int4):

    MatMul(x, DequantizeLinear(W_int4 [K, N], scale [K/B, N], axis=0, block_size=B))

symmetric (no zero point), scales > 0 in the graph's float type (fp16 scales in an fp16 graph:
the DQ output takes the scale's type), no QuantizeLinear on weights, whole blocks (``B`` divides
``K``: a weight whose ``K`` the asked block does not divide gets the largest smaller power of two
that does, at least 16; none: it stays float, and is reported), opset >= 21 (``block_size`` is
unknown to DequantizeLinear before 21: onnx.checker rejects it). TensorRT 10+ builds it strongly
typed; ONNX Runtime's CPU runs it, so parity runs here.

The LM head stays float by default (rules as ``--int8-float``'s); only MatMuls with a constant
2-D float weight are candidates (the attention-score MatMuls have none). A plain ``Gemm`` the
policy targets (GPT-2's Conv1D) is first written as ``MatMul`` + ``Add`` (``passes.gemm``), its
MatMul then a candidate. A graph with no candidate at all is refused (its
export would be int4 in name only).

``Int4Quantizer`` computes every weight's ``(q, scale)`` once per export, lazily (a weight's
numbers are computed when a graph's writer or a check first reads them), and every graph of the
set reads the same numbers; the ``--target ort`` graphs read them back from the portable graphs'
weights file (the manifest's ``targets.ort.record.int4``), so both forms hold the same quantized weights.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from kiln.errors import ExportError
from kiln.exporter.int4.gptq import InverseFactor, gptq_factored, inverse_factor
from kiln.exporter.int4.numbers import dequantize, layer_block, pack_int4, rtn, unpack_int4
from kiln.exporter.passes.bind import ModuleWeight
from kiln.exporter.passes.gemm import plain_gemms_as_matmuls
from kiln.exporter.passes.ir_utils import set_dtype
from kiln.exporter.passes.names import module_of
from kiln.exporter.passes.reports import Report
from kiln.exporter.passes.transposes import TRANSPOSE
from kiln.exporter.precision.int8 import int8_targets
from kiln.exporter.precision.kinds.base import Prepared
from kiln.exporter.precision.kinds.int4 import DEFAULT_INT4_METHOD, MIN_INT4_OPSET, Int4Method
from kiln.exporter.precision.lowbit_check import CheckLowBit, check_int4, outside_tensorrt_int4, tensorrt_int4_reason
from kiln.exporter.precision.policy import KeepFloat

__all__ = [
    "Int4Method",
    "Int4Quantizer",
    "QuantizeInt4",
    "Int4Record",
    "check_int4",
    "raise_opset",
    "DEFAULT_INT4_FLOAT",
    "DEFAULT_INT4_METHOD",
    "MIN_INT4_OPSET",
    "gptq_layerwise",
    "gptq_over",
    "int4_quantizer",
    "prepare",
]

# the LM head: ``lm_head``, or Whisper's ``proj_out`` (the module exactly: other models' ``proj_out`` sit in layers)
DEFAULT_INT4_FLOAT: tuple[str, ...] = ("*.lm_head", "/model.proj_out/")
# ops whose meaning (not only their type lists) changed between opsets 19 and 21: a graph holding
# one is not raised to 21 silently (kiln's graphs hold none). ReduceMax and ReduceMin are not among
# them: their version 20 only adds bool inputs (onnx.defs' schemas of 18 and 20 say so), which an
# opset-19 graph cannot hold (PhiMoE's sparsemixer routing and attention sinks reduce with them)
_CHANGED_BY_21 = frozenset({"DFT", "GridSample", "GroupNormalization"})

if TYPE_CHECKING:
    from kiln.exporter.contract.io import GraphKind
    from kiln.exporter.load import Reference
    from kiln.exporter.precision.context import PrecisionContext
    from kiln.exporter.precision.kinds.base import GraphReports
    from kiln.exporter.precision.kinds.int4 import Int4
    from kiln.exporter.progress import Progress

# GPTQ, layer by layer (``int4.hessians.quantize_layerwise`` over the calibration data):
# (weights to quantize, weights quantized already, quantize) -> None, calling quantize(name, H)
# for each of the first in layer order and quantize(name, None) for each of the second
Quantize = Callable[[str, np.ndarray | None], np.ndarray]
Layerwise = Callable[[Collection[str], Collection[str], Quantize], None]


@dataclasses.dataclass(frozen=True)
class Int4Record:
    nodes: tuple[str, ...]  # the quantized MatMuls, in graph order
    blocks: dict[str, int]  # each one's block size
    float_nodes: dict[str, str]  # candidates left float, and why (no whole block divides K)


@dataclasses.dataclass(frozen=True)
class _Wanted:
    """One weight a graph quantizes: its tensor (the graph's ``[K, N]``), the module tensor it is
    (GPTQ's Hessian is of that module's input), its block and scale type."""

    tensor: ir.TensorProtocol
    key: str
    module: str
    block: int
    scale_dtype: ir.DataType

    @property
    def slot(self) -> tuple[str, int, ir.DataType]:
        return (self.key, self.block, self.scale_dtype)


def _weight_key(tensor: ir.TensorProtocol, name: str) -> str:
    return tensor.key if isinstance(tensor, ModuleWeight) else f"{name}:{tuple(tensor.shape)}"


class Int4Quantizer:
    """Each weight's ``(packed q, scale)``, computed once for all graphs of an export.

    GPTQ (``layerwise``) quantizes every weight wanted so far in one layer-by-layer run over the
    calibration data, the first time one is asked for: the pass registers the weights of each
    graph before asking (``want``); a weight wanted later gets a run of its own, in which the
    layers compute with the numbers already made."""

    def __init__(self, method: Int4Method, block: int, layerwise: Layerwise | None = None) -> None:
        if method is Int4Method.GPTQ and layerwise is None:
            raise ExportError("--int4-method gptq needs calibration data (--calib-data)")
        self.method, self.block = method, block
        self._layerwise = layerwise
        self._wanted: dict[tuple[str, int, ir.DataType], _Wanted] = {}
        self._done: dict[tuple[str, int, ir.DataType], tuple[np.ndarray, np.ndarray]] = {}
        self._placed: dict[
            str, tuple[str, int, ir.DataType]
        ] = {}  # the module whose MatMul each weight feeds -> its slot

    def place(
        self, module: str, tensor: ir.TensorProtocol, key: str, hessian_name: str, block: int, scale_dtype: ir.DataType
    ) -> None:
        """Record that ``module``'s MatMul computes with this weight's numbers (parity's reference
        is built on them: ``placed_numbers``)."""
        wanted = _Wanted(tensor, key, hessian_name, block, scale_dtype)
        self._wanted.setdefault(wanted.slot, wanted)
        self._placed.setdefault(module, wanted.slot)

    def placed_numbers(self) -> Iterator[tuple[str, np.ndarray, np.ndarray, tuple[int, int]]]:
        """Per module, in the order the graphs placed them: (module, packed q, scale, (K, N)) as
        this quantizer made them (computed now if no graph read them)."""
        for module, slot in self._placed.items():
            wanted = self._wanted[slot]
            packed, scale = self.numbers(wanted.tensor, wanted.key, wanted.module, wanted.block, wanted.scale_dtype)
            k, n = wanted.tensor.shape.numpy()
            yield module, packed, scale, (int(k), int(n))

    def want(
        self, tensor: ir.TensorProtocol, key: str, hessian_name: str, block: int, scale_dtype: ir.DataType
    ) -> None:
        wanted = _Wanted(tensor, key, hessian_name, block, scale_dtype)
        self._wanted.setdefault(wanted.slot, wanted)

    def numbers(
        self, tensor: ir.TensorProtocol, key: str, hessian_name: str, block: int, scale_dtype: ir.DataType
    ) -> tuple[np.ndarray, np.ndarray]:
        """(ONNX INT4 bytes of q [K, N], scale [K/B, N]) of ``tensor``."""
        wanted = _Wanted(tensor, key, hessian_name, block, scale_dtype)
        if wanted.slot not in self._done:
            if self.method is Int4Method.GPTQ:
                self._wanted.setdefault(wanted.slot, wanted)
                self._run_gptq()
            else:
                q, scale = rtn(np.asarray(tensor.numpy(), dtype=np.float32), block, scale_dtype.numpy())
                self._done[wanted.slot] = (pack_int4(q), scale)
        return self._done[wanted.slot]

    def _run_gptq(self) -> None:
        """GPTQ for every weight wanted and not done, layer by layer."""
        assert self._layerwise is not None, "checked in __init__"
        todo: dict[str, list[_Wanted]] = {}
        done: dict[str, list[_Wanted]] = {}
        for slot, wanted in self._wanted.items():
            (done if slot in self._done else todo).setdefault(wanted.module, []).append(wanted)
        done = {name: found for name, found in done.items() if name not in todo}
        factors = _Factors()

        def quantize(name: str, hessian: np.ndarray | None) -> np.ndarray:
            for wanted in todo.get(name, []):
                assert hessian is not None, "a weight to quantize comes with its Hessian"
                q, scale = gptq_factored(
                    np.asarray(wanted.tensor.numpy(), dtype=np.float32),
                    factors.of(hessian),
                    wanted.block,
                    wanted.scale_dtype.numpy(),
                )
                self._done[wanted.slot] = (pack_int4(q), scale)
            first = (todo.get(name) or done[name])[0]  # the layer computes with its first graph's numbers
            packed, scale = self._done[first.slot]
            k, n = first.tensor.shape.numpy()
            return module_layout(first.tensor, dequantize(unpack_int4(packed, (k, n)), scale))

        self._layerwise(tuple(todo), tuple(done), quantize)
        missing = sorted(w.module for s, w in self._wanted.items() if s not in self._done)
        if missing:
            raise ExportError(f"GPTQ quantized no numbers for {missing[:3]}")


class _Factors:
    """Each Hessian's ``InverseFactor``, computed once for the weights that share it (q/k/v read one
    input) and dropped when the Hessian is (the run frees each once its weights are done)."""

    def __init__(self) -> None:
        self._by_id: dict[int, InverseFactor] = {}

    def of(self, hessian: np.ndarray) -> InverseFactor:
        key = id(hessian)
        if key not in self._by_id:
            self._by_id[key] = inverse_factor(hessian)
            weakref.finalize(hessian, self._by_id.pop, key, None)
        return self._by_id[key]


def module_layout(tensor: ir.TensorProtocol, values: np.ndarray) -> np.ndarray:
    """A graph weight's values (``[K, N]``) in its module tensor's layout (an ``nn.Linear``'s
    ``[N, K]``): its recipe's transposes undone; any other transform cannot be, and is refused."""
    if not isinstance(tensor, ModuleWeight):
        raise ExportError(
            f"GPTQ: the graph weight {tensor.name} is no module tensor: the layer it belongs to cannot compute "
            "with its quantized values"
        )
    for transform in reversed(tensor.transforms):
        if transform.name != TRANSPOSE.name:
            raise ExportError(
                f"GPTQ: the graph weight {tensor.name} is the module tensor through {transform.name!r}, which "
                "cannot be undone to run its quantized layer"
            )
        values = values.T
    return np.ascontiguousarray(values, dtype=np.float32)


def gptq_layerwise(context: PrecisionContext) -> tuple[Layerwise, dict[str, Any]]:
    """GPTQ over ``--calib-data`` through the PyTorch reference, layer by layer as GPTQ's reference
    does (run when the first weight is quantized), and the record of that data."""
    from kiln.calibration import WINDOW, load_calibration_data

    reference, options, progress = context.reference, context.options, context.progress
    assert options.calibration.data is not None, "Int4.check refuses gptq without --calib-data"
    data = load_calibration_data(
        options.calibration.data,
        tokenizer=reference.loaded.tokenizer,
        vocab_size=reference.spec.vocab_size,
        samples=options.samples,
        window=min(WINDOW, reference.max_context),
    )
    return gptq_over(reference, data.windows, progress, options.parity.device), {
        "source": data.source,
        "data_sha256": data.sha256,
        "windows": len(data.windows),
        "window": int(len(data.windows[0])),
    }


def gptq_over(
    reference: Reference, windows: Sequence[np.ndarray], progress: Progress, device: str | None = None
) -> Layerwise:
    """GPTQ's layer-by-layer run of the reference module over the calibration ``windows``: the
    export's (``gptq_layerwise``) and ``kiln check``'s, which runs it again (``int4.rerun``). Its
    Hessians and solves on ``device`` (``--parity-device``; None: the one set, ``runners.device``)."""
    from kiln.exporter.int4.hessians import quantize_layerwise

    prefix = reference.loaded.layers.prefix if reference.loaded.layers is not None else None

    def layerwise(todo: Collection[str], done: Collection[str], quantize: Quantize) -> None:
        quantize_layerwise(
            reference.module, prefix, reference.spec.n_layers, windows, todo, done, quantize, progress, device
        )

    return layerwise


def raise_opset(model: ir.Model, opset: int) -> None:
    """The default-domain opset of ``model`` raised to ``opset`` (IR version 10 for it), refused
    when the graph holds an op whose semantics changed on the way."""
    if model.opset_imports.get("", 0) >= opset:
        return
    changed = sorted({n.op_type for n in model.graph if n.domain == "" and n.op_type in _CHANGED_BY_21})
    if changed:
        raise ExportError(
            f"the graph holds {changed}, whose meaning changed by opset {opset}; export with --opset {opset} or later"
        )
    model.opset_imports[""] = opset
    model.graph.opset_imports[""] = opset
    model.ir_version = max(model.ir_version or 0, 10)


def _lazy(name: str, dtype: ir.DataType, shape: tuple[int, ...], make: Callable[[], ir.TensorProtocol]) -> ir.Value:
    tensor = ir.LazyTensor(make, dtype, ir.Shape(shape), name=name)
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape), const_value=tensor)


class QuantizeInt4(ir.passes.InPlacePass):
    """The constant weights of the MatMuls ``policy`` does not keep float -> int4 block DQ.
    ``record`` says what it did; ``float_dtype`` is the graph's final float type (the scales')."""

    def __init__(self, quantizer: Int4Quantizer, policy: KeepFloat, float_dtype: ir.DataType) -> None:
        super().__init__()
        self.quantizer, self.policy, self.float_dtype = quantizer, policy, float_dtype
        self.record: Int4Record | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        raise_opset(model, MIN_INT4_OPSET)
        names = set(int8_targets(graph, self.policy))
        names |= plain_gemms_as_matmuls(graph, names)
        plan: list[tuple[ir.Node, ir.Value, int]] = []
        left: dict[str, str] = {}
        for node in graph:
            weight = (
                node.inputs[1]
                if node.op_type == "MatMul" and node.domain == "" and node.name in names and len(node.inputs) == 2
                else None
            )
            tensor = weight.const_value if weight is not None else None
            if weight is None or tensor is None or weight.dtype != ir.DataType.FLOAT or len(tensor.shape) != 2:
                continue
            block = layer_block(tensor.shape.numpy()[0], self.quantizer.block)
            if block is None:
                left[node.name or ""] = f"K={tensor.shape.numpy()[0]} has no whole block of at least 16"
                continue
            plan.append((node, weight, block))
            self.quantizer.want(
                tensor, _weight_key(tensor, weight.name or ""), _hessian_name(tensor, weight), block, self.float_dtype
            )
        if not plan and not left:
            raise ExportError(
                "--int4 found no MatMul or plain Gemm weight to quantize in this graph (a constant 2-D float "
                "weight outside the kept-float rules): its export would be int4 in name only"
            )
        for node, weight, block in plan:
            self._quantize(graph, node, weight, block)
        for _, weight, _ in plan:  # a float weight nothing else reads is not written
            if (
                not weight.uses()
                and not weight.is_graph_output()
                and weight.name is not None
                and weight.name in graph.initializers
            ):
                graph.initializers.pop(weight.name)
        self.record = Int4Record(tuple(n.name or "" for n, _, _ in plan), {n.name or "": b for n, _, b in plan}, left)
        return ir.passes.PassResult(model, modified=bool(plan))

    report_name = "int4"

    @property
    def report(self) -> Report | None:
        """The manifest's ``passes.int4``: the MatMuls with int4 weights, each one's block size, and
        the candidates left float with why."""
        if self.record is None:
            return None
        return {
            "nodes": list(self.record.nodes),
            "blocks": dict(self.record.blocks),
            "kept_float": dict(self.record.float_nodes),
        }

    def _quantize(self, graph: ir.Graph, node: ir.Node, weight: ir.Value, block: int) -> None:
        tensor = weight.const_value
        assert tensor is not None
        k, n = tensor.shape.numpy()
        key, hessian = _weight_key(tensor, weight.name or ""), _hessian_name(tensor, weight)
        quantizer, dtype = self.quantizer, self.float_dtype

        def numbers() -> tuple[np.ndarray, np.ndarray]:
            return quantizer.numbers(tensor, key, hessian, block, dtype)

        quantizer.place(module_of(node) or node.name or "", tensor, key, hessian, block, dtype)

        base = f"int4/{module_of(node) or node.name}"
        if f"{base}.weight" in graph.initializers:  # a second MatMul of the module (a Linear called twice): its own
            base = f"int4/{node.name}"
        q = _lazy(
            f"{base}.weight",
            ir.DataType.INT4,
            (k, n),
            lambda: ir.PackedTensor(numbers()[0], ir.DataType.INT4, shape=ir.Shape([k, n])),
        )
        scale = _lazy(f"{base}.scale", dtype, (k // block, n), lambda: ir.tensor(numbers()[1]))
        for value in (q, scale):
            graph.register_initializer(value)
        dq = ir.node(
            "DequantizeLinear",
            [q, scale],
            {"axis": 0, "block_size": block},
            name=f"{node.name}/weight/DequantizeLinear",
        )
        set_dtype(dq.outputs[0], dtype)
        dq.outputs[0].shape = ir.Shape([k, n])
        dq.outputs[0].name = f"{base}.weight_dq"
        graph.insert_before(node, dq)
        node.replace_input_with(1, dq.outputs[0])


def _hessian_name(tensor: ir.TensorProtocol, weight: ir.Value) -> str:
    """The module tensor a weight is (what GPTQ's Hessian is collected for)."""
    return tensor.module_name if isinstance(tensor, ModuleWeight) else weight.name or ""


_FORMAT = (
    "int4 weight-only: DequantizeLinear(INT4 [K, N], scale [K/B, N], axis=0, block_size=B), symmetric, no zero point"
)


def prepare(kind: Int4, context: PrecisionContext) -> Prepared:
    """The int4 kind's machinery (``kinds.int4``): the quantizer every graph shares (GPTQ:
    GPTQ layer by layer over --calib-data through PyTorch, the first time a weight is quantized)
    and the policy of what stays float."""
    policy = KeepFloat(() if kind.all_matmuls else DEFAULT_INT4_FLOAT + kind.float_rules)
    layerwise, record = gptq_layerwise(context) if kind.gptq else (None, None)
    quantizer = Int4Quantizer(kind.method, kind.block, layerwise)
    return _Int4Prepared(kind, quantizer, policy, record, context.precision.float16, context.progress)


@dataclasses.dataclass(frozen=True)
class _Int4Prepared(Prepared):
    kind: Int4
    quantizer: Int4Quantizer  # computes each weight's numbers once for all graphs
    policy: KeepFloat
    calibration: dict[str, Any] | None  # GPTQ: the data its Hessians come from
    float16: bool  # the graphs' float type (the scales')
    progress: Progress  # says when the graphs are for ONNX Runtime only

    def passes(self, kind: GraphKind) -> list[ir.passes.PassBase]:
        return [QuantizeInt4(self.quantizer, self.policy, ir.DataType.FLOAT16 if self.float16 else ir.DataType.FLOAT)]

    def checks(self, kind: GraphKind) -> list[ir.passes.PassBase]:
        return [CheckLowBit()]

    def record(self, reports: GraphReports) -> dict[str, Any]:
        """The manifest's ``export.quantization``; graphs whose blocks TensorRT does not build are
        recorded (``tensorrt``) and noted here, the one place that sees every graph's blocks, once."""
        passes = [r.get("int4", {}) for r in reports.values()]
        tensorrt = _tensorrt_note(b for r in passes for b in r.get("blocks", {}).values())
        if tensorrt is not None:
            self.progress.note(f"onnx/*.onnx: {tensorrt} (kiln build refuses them)")
        blocks = {n: b for r in passes for n, b in r.get("blocks", {}).items() if b != self.kind.block}
        kept = {n: why for r in passes for n, why in r.get("kept_float", {}).items()}
        return {
            "quantization": {
                "format": _FORMAT,
                "method": self.kind.method.value,
                "block_size": self.kind.block,
                "layer_block_sizes": dict(sorted(blocks.items())),  # layers whose K the block size does not divide
                "kept_float": {"rules": list(self.policy.keep_float), "nodes": dict(sorted(kept.items()))},
                "calibration": self.calibration,
                "tensorrt": tensorrt,  # null: TensorRT builds every block
            }
        }


def _tensorrt_note(blocks: Iterable[int]) -> str | None:
    """Why the int4 graphs are for ONNX Runtime only (their blocks outside TensorRT's sizes: an
    --int4-block it does not build, or a smaller block for a K the asked one does not divide), or None."""
    outside = outside_tensorrt_int4(blocks)
    return tensorrt_int4_reason(outside) if outside else None


def int4_quantizer(prepared: Iterable[Prepared]) -> Int4Quantizer | None:
    """The int4 kind's quantizer among an export's prepared kinds (None: not an int4 export)."""
    return next((p.quantizer for p in prepared if isinstance(p, _Int4Prepared)), None)
