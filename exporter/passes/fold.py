"""Pass: constant folding of everything but the weights, and dead code removal.

The graphs are traced without the exporter's generic optimizer (it would read every weight, and
its pattern rewrites cost more than the rest of the trace); what folding they need is this:
onnxscript's constant folder (its public ``onnxscript.optimizer.fold_constants``), told never to
fold a node that reads a weight (``passes.bind``), so that shape arithmetic, small constants and
the specialised dims (``passes.specialise``) fold while the weights stay lazy. Constants are then
lifted to initializers, which every layer of the graph shares.
"""

from __future__ import annotations

import onnx_ir as ir
import onnxscript.optimizer
from onnx_ir.passes.common import LiftConstantsToInitializersPass, RemoveUnusedNodesPass

from kiln.exporter.passes.bind import ModuleWeight

__all__ = ["FoldConstants"]

_INPUT_LIMIT = 8192  # elements: bigger constants are not folded (the exporter's default)
_OUTPUT_LIMIT = 512 * 512


def _reads_weight(node: ir.Node) -> bool | None:
    if any(v is not None and isinstance(v.const_value, ModuleWeight) for v in node.inputs):
        return False
    return None  # the folder's own rules


class FoldConstants(ir.passes.InPlacePass):
    """Folds what reads no weight (inputs up to ``_INPUT_LIMIT`` elements, results up to
    ``_OUTPUT_LIMIT``), removes dead nodes and lifts every constant to an initializer."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        folded = onnxscript.optimizer.fold_constants(
            model,
            onnx_shape_inference=True,
            input_size_limit=_INPUT_LIMIT,
            output_size_limit=_OUTPUT_LIMIT,
            should_fold=_reads_weight,
        )
        modified = folded.modified
        modified |= RemoveUnusedNodesPass()(model).modified
        modified |= LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model).modified
        return ir.passes.PassResult(model, modified=modified)
