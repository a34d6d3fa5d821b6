"""Which nodes stay in fp32 when a graph is converted to fp16.

A rule is one of:
- an op type (``Softmax``): every node of that type;
- a node name (``/layers.0.attn/MatMul``): that node;
- a module name between slashes (``/layers.0.mlp/``): the nodes of exactly that module, not of
  its submodules (``/layers.0.mlp.fc1/`` is another module; ``/`` alone: nodes outside any);
- a module suffix starting with ``*.`` (``*.rotary``): every node of every module so named.

The default policy keeps norm statistics, softmax and rotary angles in fp32 (the final logits
are kept fp32 at the graph output). Nodes whose float inputs all come from kept nodes or
constants, are element-wise and sit in the same module as one of those are kept too (the
``eps`` Add between ReduceMean and Sqrt of an RMSNorm, say), so a rule names the start of a
statistic, not every node of it; propagation never crosses into another module.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from kiln.errors import ConfigError
from kiln.exporter.passes.names import module_of

__all__ = ["Fp16Policy", "KeepFloat", "DEFAULT_KEEP_FP32", "resolve_kept_nodes", "rule_matches"]

DEFAULT_KEEP_FP32: tuple[str, ...] = (
    "LayerNormalization",  # mean/variance over d_model
    "ReduceMean",  # RMSNorm's mean of squares (and a decomposed LayerNorm's)
    "Pow",
    "Sqrt",
    "Reciprocal",
    "Softmax",  # exp of scores
    "*.rotary",  # position angles: positions up to thousands lose their fraction in fp16
)

_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16)
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Sqrt", "Reciprocal", "Pow", "Neg", "Exp", "Log", "Abs"})


@dataclasses.dataclass(frozen=True)
class Fp16Policy:
    keep: tuple[str, ...] = DEFAULT_KEEP_FP32

    def widened(self, extra: tuple[str, ...]) -> Fp16Policy:
        return Fp16Policy(self.keep + tuple(r for r in extra if r not in self.keep))


@dataclasses.dataclass(frozen=True)
class KeepFloat:
    """The MatMuls a quantizing kind (int8, int4, fp8) leaves in float: rules as above, matched
    against each MatMul/Gemm node (each kind's defaults: ``precision.int8.Int8Policy``, ...)."""

    keep_float: tuple[str, ...] = ()


def rule_matches(rule: str, node: ir.Node) -> bool:
    if rule.startswith("*."):
        module = module_of(node)
        return module == rule[2:] or module.endswith(rule[1:])
    if rule.endswith("/"):
        return module_of(node) == rule[1:-1]
    if rule.startswith("/"):
        return node.name == rule
    return node.op_type == rule


def resolve_kept_nodes(graph: ir.Graph, policy: Fp16Policy) -> list[str]:
    """Names of the nodes the policy keeps in fp32, in graph order. A node-name or module rule
    that matches nothing is an error (a typo would silently keep nothing)."""
    nodes = list(graph)
    kept: set[str] = set()
    for rule in policy.keep:
        hits = [n for n in nodes if rule_matches(rule, n)]
        if not hits and (rule.startswith("/")):
            raise ConfigError(
                f"--keep-fp32 {rule}: no node of the {graph.name} graph has that name (node names look like "
                "/layers.0.attn/Softmax)"
            )
        kept.update(n.name for n in hits if n.name)
    changed = True
    while changed:  # propagate to element-wise nodes of the same module fed only by kept nodes and constants
        changed = False
        for node in nodes:
            if (
                node.name in kept
                or node.op_type not in _ELEMENTWISE
                or not any(o.dtype in _FLOATS for o in node.outputs)
            ):
                continue
            producers = [
                v.producer() for v in node.inputs if v is not None and v.dtype in _FLOATS and v.const_value is None
            ]
            if any(p is None for p in producers):
                continue  # fed by a graph input
            real = [p for p in producers if p is not None and p.op_type != "Constant"]  # constants may feed it too
            if real and all(p.name in kept for p in real) and any(module_of(p) == module_of(node) for p in real):
                kept.add(node.name or "")
                changed = True
    return [n.name for n in nodes if n.name in kept]
