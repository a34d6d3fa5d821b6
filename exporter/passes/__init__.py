"""ONNX graph passes on onnx-ir's pass infrastructure, one file each (the graph sets compose them:
``exporter.graphs`` for the portable graphs, ``exporter.targets.ort`` for the ONNX Runtime target)."""

from __future__ import annotations

from kiln.exporter.passes.base import GraphRewrite, run_passes
from kiln.exporter.passes.contract import ApplyContract, apply_contract
from kiln.exporter.passes.names import NameNodes, name_nodes
from kiln.exporter.passes.ple_inputs import PleTablesToInputs, ple_tables_to_inputs
from kiln.exporter.passes.weights import (
    WEIGHTS_FILE,
    ExternalizeWeights,
    SharedWeights,
    WeightsWriter,
)

__all__ = [
    "ApplyContract",
    "ExternalizeWeights",
    "GraphRewrite",
    "NameNodes",
    "PleTablesToInputs",
    "SharedWeights",
    "WEIGHTS_FILE",
    "WeightsWriter",
    "apply_contract",
    "name_nodes",
    "ple_tables_to_inputs",
    "run_passes",
]
