"""Pass: a graph traced with the model's first few layers, grown to all of them.

Tracing costs seconds per decoder layer (torch.export, decompositions, translation), so kiln
traces a template: the model with only as many layers as it takes for every distinct layer
structure (``LayerPlan.signatures``) to appear after the first layer (usually 2), and stamps the
last traced layer of each structure once per remaining layer. A copy reads:

- its own weights: the template layer's, renamed (``model.layers.1.`` -> ``model.layers.7.``)
  and bound to the module's tensors of that name (``passes.bind``);
- its own cache: ``past_key_values.7.*`` inputs, ``present.7.*`` outputs;
- the hidden state the layer before hands on, and the values every layer shares (positions,
  the mask, rotary tables, shapes, constants) as they are.

Which node belongs to which layer is decided by data flow, not names alone: a node of layer i's
module (its name scope), or a node outside every layer that reads one layer's data only (a
cache update the model's forward does before calling the layer), is layer i's; a node that reads
no layer's data (a constant, a shape: every layer of one structure has the same) is shared. The
pass refuses (``ExportError``) a template whose layers exchange anything but one hidden state;
the caller then traces the whole model. Parity then checks the stamped graph against the model.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import onnx_ir as ir

from kiln.errors import ExportError
from kiln.exporter.passes.bind import ModuleWeight
from kiln.plugins.base import LayerPlan

__all__ = ["StampPlan", "StampLayers"]

_SHAPES = ("Shape", "Size")  # what they read is the same in every layer of one structure
_CACHE = re.compile(r"^(past_key_values|present)\.(\d+)\.")
Assignment = dict[int, int | None]  # id(node) -> its layer (None: shared, or the head's)


@dataclasses.dataclass(frozen=True)
class StampPlan:
    prefix: str  # layer i's module path in the traced module, ``{}`` for i
    traced: int  # layers in the template
    templates: tuple[int, ...]  # per layer of the model: the traced layer it copies (itself below ``traced``)

    @classmethod
    def of(cls, plan: LayerPlan) -> StampPlan:
        """The shortest template in which every structure appears after the first layer."""
        signatures = plan.signatures
        traced = len(signatures)
        for k in range(2, len(signatures) + 1):
            if set(signatures) <= set(signatures[1:k]):
                traced = k
                break
        last = {signatures[i]: i for i in range(1, traced)}
        return cls(plan.prefix, traced, tuple(i if i < traced else last[signatures[i]] for i in range(len(signatures))))

    @property
    def stamps(self) -> bool:
        return len(self.templates) > self.traced


class _Layers:
    """The template graph's nodes by layer, and each layer's one hidden state in and out."""

    def __init__(self, graph: ir.Graph, plan: StampPlan) -> None:
        self.graph, self.plan = graph, plan
        self._scope = re.compile("^/" + re.escape(plan.prefix).replace(r"\{\}", r"(\d+)") + r"[./]")
        self._weights = re.compile(
            r"^(?:val_transposed\.)?model\." + re.escape(plan.prefix).replace(r"\{\}", r"(\d+)") + r"\."
        )
        self.assign = self._assign()
        self.nodes = {i: [n for n in graph if self.assign[id(n)] == i] for i in range(plan.traced)}

    def seed(self, value: ir.Value) -> int | None:
        """The layer a graph input (its cache) or an initializer (its weight) belongs to."""
        name = value.name or ""
        match = (
            _CACHE.match(name)
            if value.is_graph_input() or value.is_graph_output()
            else self._weights.match(name)
            if value.is_initializer()
            else None
        )
        return int(match.group(match.lastindex or 1)) if match else None

    def _traced_scope(self, node: ir.Node) -> int | None:
        match = self._scope.match(node.name or "")
        return int(match.group(1)) if match else None

    def _scopes(self) -> dict[int, int | None]:
        """Each node's layer by its module (``/layers.1.attn/...``: 1; another module: None). A
        node a pass made (constant folding: its name has no module) takes its consumers' layer
        when they agree, else the latest layer it reads from."""
        scopes: dict[int, int | None] = {}
        made = [n for n in self.graph if not (n.name or "").startswith("/")]
        for node in self.graph:
            if (node.name or "").startswith("/"):
                scopes[id(node)] = self._traced_scope(node)
        for node in reversed(made):
            users = {
                scopes.get(id(use.node))
                for out in node.outputs
                for use in out.uses()
                if use.node.op_type not in _SHAPES
            }
            if len(users) == 1:
                scopes[id(node)] = users.pop()
            else:
                producers = [
                    scopes.get(id(v.producer())) for v in node.inputs if v is not None and v.producer() is not None
                ]
                scopes[id(node)] = max((p for p in producers if p is not None), default=None)
        return scopes

    def _assign(self) -> Assignment:
        deps: dict[int, frozenset[int]] = {
            id(v): frozenset({s} if (s := self.seed(v)) is not None else ())
            for v in (*self.graph.inputs, *self.graph.initializers.values())
        }
        scopes = self._scopes()
        assign: Assignment = {}
        for node in self.graph:
            reads = frozenset().union(*(deps.get(id(v), frozenset()) for v in node.inputs if v is not None))
            for out in node.outputs:
                deps[id(out)] = frozenset() if node.op_type in _SHAPES else reads
            scope = scopes[id(node)]
            if not reads or node.op_type in _SHAPES:
                assign[id(node)] = None  # shared
            elif scope is not None:
                assign[id(node)] = scope
            else:
                assign[id(node)] = next(iter(reads)) if len(reads) == 1 else None  # one layer's satellite, or the head
        return assign

    def boundary(self, layer: int) -> tuple[ir.Value, ir.Value]:
        """The one value ``layer`` reads from the layer before, and the one it hands on."""
        mine = {id(n) for n in self.nodes[layer]}
        before = {id(n) for n in self.nodes.get(layer - 1, [])}
        ins = {
            id(v): v
            for n in self.nodes[layer]
            for v in n.inputs
            if v is not None and v.producer() is not None and id(v.producer()) in before
        }
        outs = {
            id(o): o
            for n in self.nodes[layer]
            for o in n.outputs
            if any(id(use.node) not in mine and use.node.op_type not in _SHAPES for use in o.uses())
        }
        if len(ins) != 1 or len(outs) != 1:
            raise ExportError(
                f"layer {layer} of the template reads {len(ins)} and hands on {len(outs)} values; stamping needs "
                "one hidden state each"
            )
        return next(iter(ins.values())), next(iter(outs.values()))


def _renamed(name: str, plan: StampPlan, template: int, layer: int) -> str:
    old, new = plan.prefix.format(template), plan.prefix.format(layer)
    return (
        re.sub(r"(?<=[/.])" + re.escape(old) + r"(?=[./])", new, name, count=1)
        if old in name
        else f"{name}.layer{layer}"
    )


class _Copy:
    """One stamped layer: the template layer's nodes with their inputs mapped."""

    def __init__(
        self, layers: _Layers, template: int, layer: int, boundary: tuple[ir.Value, ir.Value], hidden: ir.Value
    ) -> None:
        self.layers, self.template, self.layer = layers, template, layer
        self.map: dict[int, ir.Value] = {id(boundary[0]): hidden}
        for value in [
            v for v in layers.graph.inputs if layers.seed(v) == template
        ]:  # its cache inputs, in the contract's order
            copy = ir.Value(name=self._cache_name(value), type=value.type, shape=value.shape)
            layers.graph.inputs.append(copy)
            self.map[id(value)] = copy

    def _cache_name(self, value: ir.Value) -> str:
        return _CACHE.sub(lambda m: f"{m.group(1)}.{self.layer}.", value.name or "")

    def value(self, value: ir.Value) -> ir.Value:
        if id(value) in self.map:
            return self.map[id(value)]
        if not value.is_initializer() or self.layers.seed(value) != self.template:
            return value  # shared
        graph, plan = self.layers.graph, self.layers.plan
        name = _renamed("/" + (value.name or ""), plan, self.template, self.layer)[1:]
        if name not in graph.initializers:
            weight = value.const_value
            tensor = (
                weight.renamed(_renamed("/" + weight.module_name, plan, self.template, self.layer)[1:])
                if isinstance(weight, ModuleWeight)
                else weight
            )
            graph.register_initializer(ir.Value(name=name, type=value.type, shape=value.shape, const_value=tensor))
        self.map[id(value)] = graph.initializers[name]
        return self.map[id(value)]

    def stamp(self, nodes: Iterable[ir.Node]) -> None:
        plan = self.layers.plan
        for node in nodes:
            inputs = [self.value(v) if v is not None else None for v in node.inputs]
            attributes = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
            name = _renamed(node.name, plan, self.template, self.layer) if node.name else None
            copy = ir.Node(
                node.domain, node.op_type, inputs, attributes=attributes, num_outputs=len(node.outputs), name=name
            )
            for old, new in zip(node.outputs, copy.outputs, strict=True):
                new.name = self._cache_name(old) if old.is_graph_output() else f"layer{self.layer}/{old.name}"
                new.type, new.shape = old.type, old.shape
                self.map[id(old)] = new
            self.layers.graph.append(copy)

    def outputs(self) -> list[ir.Value]:
        """The copy's cache outputs, in the template layer's (the contract's) order."""
        return [
            self.map[id(v)]
            for v in self.layers.graph.outputs
            if self.layers.seed(v) == self.template and id(v) in self.map
        ]


class StampLayers(ir.passes.InPlacePass):
    """The template's layers copied to the model's depth (``StampPlan.templates``)."""

    def __init__(self, plan: StampPlan) -> None:
        super().__init__()
        self.plan = plan

    def check(self, model: ir.Model) -> None:
        """Raise ``ExportError`` now if the template cannot be stamped (its layers' boundaries)."""
        layers = _Layers(model.graph, self.plan)
        for template in range(1, self.plan.traced):
            layers.boundary(template)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if not self.plan.stamps:
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        layers = _Layers(graph, self.plan)
        boundaries = {t: layers.boundary(t) for t in range(1, self.plan.traced)}
        handed = boundaries[self.plan.traced - 1][1]
        head = [use for use in handed.uses() if layers.assign[id(use.node)] is None and use.node.op_type not in _SHAPES]
        outputs = list(graph.outputs)
        for layer, template in enumerate(self.plan.templates[self.plan.traced :], start=self.plan.traced):
            copy = _Copy(layers, template, layer, boundaries[template], handed)
            copy.stamp(layers.nodes[template])
            handed = copy.map[id(boundaries[template][1])]
            outputs += copy.outputs()
        for use in head:
            use.node.replace_input_with(use.idx, handed)
        graph.outputs.clear()
        graph.outputs.extend(outputs)
        graph.sort()
        return ir.passes.PassResult(model, modified=True)
