"""Pass: name every node after the PyTorch module that produced it, then drop exporter metadata.

``/layers.0.attn.q_proj/MatMul`` maps straight back to ``model.get_submodule("layers.0.attn.q_proj")``; the
precision policy, the sensitivity search and the reports all speak these names.

The torch exporter stores stack traces (absolute source paths), FX node text and class
hierarchies in ``metadata_props`` on every node and value. They make graphs several times
larger and differ between machines and checkouts, so they are removed here: two exports of the
same checkpoint must be byte-identical.
"""

from __future__ import annotations

import ast
from collections import Counter

import onnx_ir as ir

__all__ = ["NameNodes", "name_nodes", "module_of"]

_SCOPES = "pkg.torch.onnx.name_scopes"
_WRAPPED = "model."  # GraphModule wraps the decoder as .model


def _module_path(node: ir.Node) -> str:
    """The qualified name of the innermost module, e.g. ``layers.0.attn.q_proj`` ("" at the root)."""
    raw = node.metadata_props.get(_SCOPES)
    if not raw:
        return ""
    try:
        scopes = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return ""
    # scopes are cumulative qualified names, root first; the last one is the FX node itself
    modules = [str(s) for s in scopes[:-1] if str(s).startswith(_WRAPPED)]
    return modules[-1][len(_WRAPPED) :] if modules else ""


def name_nodes(model: ir.Model) -> ir.Model:
    """Rename nodes ``/<module qualified name>/<OpType>[_k]`` and clear metadata, in place."""
    seen: Counter[str] = Counter()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        path = _module_path(node)
        base = f"/{path}/{node.op_type}" if path else f"/{node.op_type}"
        count = seen[base]
        seen[base] += 1
        node.name = base if count == 0 else f"{base}_{count}"
        node.metadata_props.clear()
        for value in node.outputs:
            value.metadata_props.clear()
    for value in [*model.graph.inputs, *model.graph.initializers.values()]:
        value.metadata_props.clear()
    model.metadata_props.clear()
    model.graph.metadata_props.clear()
    return model


class NameNodes(ir.passes.InPlacePass):
    """Nodes named after their module, exporter metadata dropped (``name_nodes``)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(name_nodes(model), modified=True)


def module_of(node: ir.Node) -> str:
    """The module a node belongs to: ``layers.0.attn`` for ``/layers.0.attn/MatMul`` (kiln names
    nodes after their module, ``name_nodes``); empty for other names."""
    name = node.name or ""
    return name[1 : name.rfind("/")] if name.startswith("/") and name.count("/") >= 2 else ""
