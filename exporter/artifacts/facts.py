"""What an export's graphs are, read from the graph files themselves: every fact that changes how
the export is run or judged. ``kiln verify`` holds the manifest's claims to them (``claims``).

A manifest is a claim, not a key: its hashes can be recomputed after any edit, so a field that
says how to run the graphs (the KV cache's kind, dtype and capacity, the logits, the PLE tables)
or how to judge them (the precision, whose tolerances ``kiln check`` applies) is worth only what
the graphs confirm. The graphs are read for their structure alone (``onnx.load`` without external
data: node types, attributes, dtypes and dims), never for their weights:

- precision: the MatMuls' kind from their quantization nodes (a QuantizeLinear to int8 or fp8, a
  DequantizeLinear of an int4, int8 or fp8 weight, ``MatMulNBits`` by its ``bits``), fp16 from the
  KV cache's dtype (every fp16 precision carries an fp16 cache);
- the KV dtype: of the past and present tensors;
- the cache kind (``contract.io.CacheUpdate``): ``static`` when the past inputs have a fixed
  sequence dim (the buffers ``contract.static_cache`` writes in place), ``shared`` when every
  layer's decode attention is a GroupQueryAttention and nothing else reads a past input (past and
  present one buffer, whose capacity another reader would take for the tokens), else ``grown``;
- the static cache's capacity (its sequence dim: the ``max_context`` it was built for), and the
  fewest rows of any table indexed by position (rotary cos/sin caches, tables gathered by
  ``position_ids``): no context may run past either;
- the logits: ``last`` when prefill's logits have one position, else ``all``;
- the PLE tables: ``input`` when the graphs take ``ple.{i}.scale/.shift`` inputs, else ``constant``;
- every graph's input and output names.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError
from kiln.exporter.contract.shared_buffer import reads_past_length
from kiln.exporter.precision.kinds.plan import Precision

__all__ = ["GraphFacts", "SetFacts", "facts_of", "graph_facts", "graph_precision"]

_PAST_KEY = re.compile(r"^past_key_values\.\d+\.key$")
# keys and values (a recurrent state's conv/ssm have fixed lengths too, but are no static cache's slots)
_PAST_KV = re.compile(r"^past_key_values\.\d+\.(?:key|value)$")
_PLE_INPUT = re.compile(r"^ple\.\d+\.(scale|shift)$")
_POSITIONS = "position_ids"
# the element types a quantization node's integer or fp8 side has, by the precision kind they make
_QUANTIZED = {"INT8": "int8", "UINT8": "int8", "INT4": "int4", "UINT4": "int4"} | {
    name: "fp8" for name in ("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ")
}


@dataclasses.dataclass(frozen=True)
class GraphFacts:
    """One graph file's facts (the module docstring says what each is)."""

    file: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    quantized: frozenset[str]  # the precision kinds its quantization nodes make: int8, int4, fp8
    kv_dtypes: frozenset[str]  # of its past and present tensors (numpy names)
    layers: int  # its past key inputs: the layers whose cache it reads
    static_slots: int | None  # the fixed sequence dim of its past inputs (a static cache), else None
    fused_attention: int  # GroupQueryAttention nodes
    pasts_elsewhere: bool  # a node may read a past's sequence length (``contract.shared_buffer``)
    positions: int | None  # the fewest rows of a table it indexes by position
    logits: str | None  # "last" (one position) or "all"; None: no logits output
    opset: int  # of the default (ai.onnx) domain


@dataclasses.dataclass(frozen=True)
class SetFacts:
    """A graph set's facts (the portable graphs, or one target's): what its graphs agree on."""

    graphs: dict[str, GraphFacts]  # by graph kind
    precision: str  # a precision name as the manifest writes it, or the kinds found joined by "+"
    kv_dtype: str | None  # None: no graph carries a cache
    kv_cache: str | None  # a ``CacheUpdate`` value; None: no graph reads a past
    capacity: int | None  # the static cache's slots
    positions: int | None
    logits: str | None
    ple_tables: str  # "input" or "constant"

    @property
    def files(self) -> str:
        return ", ".join(g.file for g in self.graphs.values())


def facts_of(graphs: Mapping[str, Mapping[str, Path]], root: Path | None = None) -> dict[str, SetFacts]:
    """The facts of every graph set: ``graphs`` maps a set's name (``portable``, a target's) to
    its graph files by kind, relative to ``root`` when given (the facts name them so)."""

    def read(path: Path) -> GraphFacts:
        return graph_facts(root / path if root is not None else path, path.as_posix())

    return {name: _set_facts({kind: read(path) for kind, path in files.items()}) for name, files in graphs.items()}


def graph_facts(path: Path, name: str | None = None) -> GraphFacts:
    """The facts of one graph file, its structure only (raises what ``onnx.load`` raises)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    constants = {t.name: t for t in graph.initializer} | _constant_nodes(graph.node)
    values = {v.name: v for v in (*graph.input, *graph.output)}
    pasts = [v for v in graph.input if v.name.startswith("past_key_values.")]
    caches = [*pasts, *(v for v in graph.output if v.name.startswith("present."))]
    logits = values.get("logits")
    return GraphFacts(
        file=name if name is not None else path.as_posix(),
        inputs=tuple(v.name for v in graph.input),
        outputs=tuple(v.name for v in graph.output),
        quantized=frozenset(_quantized(graph.node, constants)),
        kv_dtypes=frozenset(_dtype(v) for v in caches),
        layers=sum(1 for v in pasts if _PAST_KEY.match(v.name)),
        static_slots=_static_slots(v for v in pasts if _PAST_KV.match(v.name)),
        fused_attention=sum(1 for n in graph.node if n.op_type == "GroupQueryAttention"),
        pasts_elsewhere=_reads_past_length(graph.node, {v.name for v in pasts}),
        positions=min(_position_rows(graph.node, constants, values), default=None),
        logits=None if logits is None else "last" if _dims(logits)[1:2] == [1] else "all",
        opset=next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0),
    )


def _reads_past_length(nodes: Iterable[Any], pasts: set[str]) -> bool:
    """Whether a node that takes a past input may read its sequence length."""
    import onnx

    return any(
        set(n.input) & pasts
        and reads_past_length(n.op_type, {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute})
        for n in nodes
    )


def _constant_nodes(nodes: Iterable[Any]) -> dict[str, Any]:
    """The tensors of ``Constant`` nodes by their output, read as initializers are."""
    return {n.output[0]: a.t for n in nodes if n.op_type == "Constant" for a in n.attribute if a.name == "value"}


def _dims(value: Any) -> list[int | str]:
    """A graph input's or output's dims: a fixed one as an int, a named one as its name."""
    dims = value.type.tensor_type.shape.dim
    return [d.dim_param if d.dim_param or not d.HasField("dim_value") else d.dim_value for d in dims]


def _static_slots(pasts: Iterable[Any]) -> int | None:
    """The fixed sequence dim of past inputs ``[batch, heads, seq, head_dim]``: a static cache's slots."""
    slots = [dims[2] for dims in map(_dims, pasts) if len(dims) > 2 and isinstance(dims[2], int)]
    return min(slots, default=None)


def _dtype(value: Any) -> str:
    import onnx

    try:
        return str(onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name)
    except (KeyError, TypeError, ValueError):
        return f"elem_type {value.type.tensor_type.elem_type}"


def _quantized(nodes: Iterable[Any], constants: Mapping[str, Any]) -> Iterable[str]:
    """The precision kind each quantization node makes: what ``QuantizeLinear`` quantizes to (its
    zero point's type, else its ``output_dtype``, else uint8), what a constant (a weight)
    ``DequantizeLinear`` reads is stored as, and ``MatMulNBits``' bits."""
    import onnx

    for node in nodes:
        attributes = {a.name: a for a in node.attribute}
        if node.op_type == "MatMulNBits":
            yield "int8" if "bits" in attributes and attributes["bits"].i == 8 else "int4"
            continue
        if node.op_type == "QuantizeLinear":
            point = constants.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
            dtype = attributes["output_dtype"].i if "output_dtype" in attributes else onnx.TensorProto.UINT8
            dtype = point.data_type if point is not None else dtype
        elif node.op_type == "DequantizeLinear" and node.input[0] in constants:
            dtype = constants[node.input[0]].data_type
        else:
            continue
        kind = _QUANTIZED.get(onnx.TensorProto.DataType.Name(dtype))
        if kind is not None:
            yield kind


def _position_rows(nodes: Iterable[Any], constants: Mapping[str, Any], values: Mapping[str, Any]) -> Iterable[int]:
    """The rows of every table a position indexes: a rotary embedding's cos/sin caches (given
    ``position_ids``: ONNX's own ``[positions, rotary / 2]``, ONNX Runtime's contrib op's always)
    and a table gathered by ``position_ids`` (PLE tables, learned position embeddings)."""
    for node in nodes:
        tables: list[str] = []
        if node.op_type == "RotaryEmbedding" and node.domain == "com.microsoft":
            tables = list(node.input[2:4])
        elif node.op_type == "RotaryEmbedding" and len(node.input) > 3 and node.input[3]:
            tables = list(node.input[1:3])
        elif node.op_type == "Gather" and node.input[1:2] == [_POSITIONS] and not _axis(node):
            tables = [node.input[0]]
        for table in tables:
            rows = _rows(table, constants, values)
            if rows is not None:
                yield rows


def _axis(node: Any) -> int:
    return next((int(a.i) for a in node.attribute if a.name == "axis"), 0)


def _rows(table: str, constants: Mapping[str, Any], values: Mapping[str, Any]) -> int | None:
    """The first dim of a constant or a graph input, when it is fixed."""
    dims = list(constants[table].dims) if table in constants else _dims(values[table]) if table in values else []
    return dims[0] if dims and isinstance(dims[0], int) else None


def _set_facts(graphs: dict[str, GraphFacts]) -> SetFacts:
    stepping = graphs.get("decode") or graphs.get("model")  # the graph whose cache a step carries
    kv_dtypes = frozenset().union(*(g.kv_dtypes for g in graphs.values()))
    capacities = [g.static_slots for g in graphs.values() if g.static_slots is not None]
    prompt = graphs.get("prefill") or graphs.get("model")
    return SetFacts(
        graphs=graphs,
        precision=_precision(frozenset().union(*(g.quantized for g in graphs.values())), kv_dtypes == {"float16"}),
        kv_dtype="+".join(sorted(kv_dtypes)) or None,
        kv_cache=None if stepping is None or not stepping.layers else _cache_kind(stepping),
        capacity=min(capacities, default=None),
        positions=min((g.positions for g in graphs.values() if g.positions is not None), default=None),
        logits=prompt.logits if prompt is not None else None,
        ple_tables="input" if any(_PLE_INPUT.match(name) for g in graphs.values() for name in g.inputs) else "constant",
    )


def graph_precision(graph: GraphFacts) -> str:
    """One graph's precision name, as ``SetFacts.precision`` names a set's (fp16 only where it has a
    cache to show it)."""
    return _precision(graph.quantized, graph.kv_dtypes == {"float16"})


def _cache_kind(graph: GraphFacts) -> str:
    """How a step of ``graph`` carries the cache (``contract.io.CacheUpdate``'s values)."""
    if graph.static_slots is not None:
        return "static"
    return "shared" if graph.fused_attention >= graph.layers and not graph.pasts_elsewhere else "grown"


def _precision(quantized: frozenset[str], float16: bool) -> str:
    """The precision name of graphs quantized as ``quantized`` with (or without) an fp16 float
    type, as the manifest writes it; kinds kiln never combines are named joined by "+", which no
    manifest's precision equals."""
    parts = [*sorted(quantized), *(["fp16"] if float16 else [])]
    try:
        return Precision.parse("+".join(parts) or "fp32").value
    except ConfigError:
        return "+".join(parts)
