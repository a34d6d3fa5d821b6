"""Parity of a target's graphs, folded into the export's one parity result.

A target's graphs keep the I/O contract, so ``run_parity`` checks them exactly as it checks the
portable ones (tensor parity with left-padded batches and a non-empty past, greedy generation
through prefill + decode and model.onnx). Their checks are added to the portable result under
the target's name (``prefill.ort``, ``ort:prefill+decode``) with the tolerance of the target's
own precision, so ``passed``, the reports and ``kiln check`` cover both sets of graphs.
"""

from __future__ import annotations

import dataclasses

from kiln.exporter.parity import ParityResult

__all__ = ["merge_target_parity"]


def merge_target_parity(result: ParityResult, target: str, target_result: ParityResult) -> ParityResult:
    """Append ``target_result``'s checks to ``result`` (in place) under ``target``'s name."""
    result.tensors += [dataclasses.replace(t, graph=f"{t.graph}.{target}") for t in target_result.tensors]
    result.generation += [dataclasses.replace(g, path=f"{target}:{g.path}") for g in target_result.generation]
    targets = result.extra.setdefault("targets", {})
    targets[target] = {
        "backend": target_result.backend,
        "precision": target_result.precision,
        "passed": target_result.passed,
        "tolerance": dataclasses.asdict(target_result.tolerance),
    }
    return result
