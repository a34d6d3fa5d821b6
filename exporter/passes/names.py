"""Pass: name every node after the PyTorch module that produced it, then drop exporter metadata.

``/layers.0/attn/q_proj/MatMul`` maps straight back to ``model.layers[0].attn.q_proj``; the
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

__all__ = ["name_nodes"]

_SCOPES = "pkg.torch.onnx.name_scopes"
_WRAPPER_SCOPES = ("", "model")  # GraphModule (root) and its .model attribute


def _module_path(node: ir.Node) -> list[str]:
    raw = node.metadata_props.get(_SCOPES)
    if not raw:
        return []
    try:
        scopes = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return []
    scopes = [str(s) for s in scopes][:-1]  # the last scope is the FX node, not a module
    while scopes and scopes[0] in _WRAPPER_SCOPES:
        scopes = scopes[1:]
    return scopes


def name_nodes(model: ir.Model) -> ir.Model:
    """Rename nodes ``/<module path>/<OpType>[_k]`` and clear metadata, in place."""
    seen: Counter[str] = Counter()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        base = "/" + "/".join([*_module_path(node), node.op_type])
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
