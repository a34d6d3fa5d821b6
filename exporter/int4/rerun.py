"""``kiln check``'s int4 numbers: the export's quantizer run again on the checkpoint (issue 40).

An int4 export's proof is built apart from its graphs (``int4.proof``): the quantizer's own
codes and scales, PyTorch on them, and every graph weight checked bit for bit against them. ``kiln
check`` has no quantizer left, so it makes one with what the manifest records (``export.quantization``:
method and block size; each portable graph's ``passes.int4``: the MatMuls quantized and their
blocks; the graphs' float type for the scales) and places on it each quantized module's weight
from the checkpoint, as the export's ``QuantizeInt4`` placed the traced weight (``[K, N]``: an
``nn.Linear``'s weight transposed, a Conv1D's as it is). RTN is deterministic; GPTQ runs again,
layer by layer, over the export's calibration data as ``check_calibration`` reads it: the file
passed with ``kiln check --calib-data`` once its token windows hash as recorded, ``synthetic``, or the
bundled demo text, never the path the manifest records. Where no such data is given or the weights
were merged with ``--adapter``, one line says so (``Rerun.reason``) and the check judges against the
numbers read back from the graphs; a manifest without the method and block size (which every int4
export records) is refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import onnx_ir as ir
from torch import nn

from kiln.errors import ArtifactError
from kiln.exporter.artifacts.manifest import Manifest
from kiln.exporter.check_calibration import Recorded, Skip, rerun_source
from kiln.exporter.int4.quantize import Int4Quantizer, Layerwise, gptq_over
from kiln.exporter.load import Reference
from kiln.exporter.passes.bind import ModuleWeight, WeightSource
from kiln.exporter.passes.transposes import TRANSPOSE
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln.exporter.precision.kinds.plan import Precision
from kiln.exporter.progress import Progress
from kiln.plugins import LoadedModel

__all__ = ["Rerun", "rerun_quantizer"]


@dataclasses.dataclass(frozen=True)
class Rerun:
    """The quantizer made again with every quantized module placed, or why it could not be."""

    quantizer: Int4Quantizer | None
    reason: str | None = None


def rerun_quantizer(
    manifest: Manifest, loaded: LoadedModel, progress: Progress, calib_data: Path | None = None
) -> Rerun:
    """The export's int4 quantizer on ``loaded`` (the checkpoint as loaded, before any adapter
    reference is built over it), its modules placed as the export placed them; GPTQ over
    ``calib_data`` (``kiln check --calib-data``)."""
    record: dict[str, Any] = manifest.export.quantization or {}
    method, block = record.get("method"), record.get("block_size")
    if method not in {m.value for m in Int4Method} or not isinstance(block, int):
        # every kiln int4 export records both (since int4 landed): without them a check read back from the graphs
        # would be one manifest edit away, so it is refused rather than loosened
        raise ArtifactError(
            f"the manifest's export.quantization records no int4 method and block size (found {method!r}, {block!r}), "
            "which every kiln int4 export records: kiln check cannot make the quantizer's numbers again; export again"
        )
    if manifest.checkpoint.adapters:
        return Rerun(
            None, "its int4 weights are of the checkpoint merged with --adapter, which kiln check does not merge"
        )
    layerwise: Layerwise | None = None
    if Int4Method(method) is Int4Method.GPTQ:
        found = _gptq(record.get("calibration"), calib_data, loaded, manifest.limits.max_context, progress)
        if isinstance(found, str):
            return Rerun(None, found)
        layerwise = found
    quantizer = Int4Quantizer(Int4Method(method), block, layerwise)
    scales = ir.DataType.FLOAT16 if Precision.parse(manifest.precision).float16 else ir.DataType.FLOAT
    source = WeightSource(loaded.module)
    for node, node_block in _quantized_nodes(manifest).items():
        module = node[1 : node.rfind("/")] if node.startswith("/") and node.count("/") >= 2 else ""
        tensor = _graph_weight(loaded.module, source, module, node)
        quantizer.place(module, tensor, tensor.key, tensor.module_name, node_block, scales)
    return Rerun(quantizer)


def _quantized_nodes(manifest: Manifest) -> dict[str, int]:
    """Every portable graph's int4 MatMuls (``passes.int4``) and each one's block, in graph order."""
    nodes: dict[str, int] = {}
    for entry in manifest.graphs.values():
        report = entry.report("int4")
        blocks = report.get("blocks", {})
        for node in report.get("nodes", []):
            nodes.setdefault(str(node), int(blocks.get(node, 0)))
    if not nodes:
        raise ArtifactError("the manifest records no int4 MatMul in its graphs (passes.int4), which an int4 export has")
    return nodes


def _graph_weight(root: nn.Module, source: WeightSource, module: str, node: str) -> ModuleWeight:
    """``module``'s weight as its MatMul reads it, ``[K, N]``: the recipe the trace bound (the
    module tensor ``model.<module>.weight``, transposed for an ``nn.Linear``)."""
    try:
        sub = root.get_submodule(module)
    except AttributeError:
        raise ArtifactError(
            f"{node}: the manifest's int4 MatMul belongs to {module!r}, which the model has no module of"
        ) from None
    weight = ModuleWeight(source, f"model.{module}.weight", ir.DataType.FLOAT)
    if isinstance(sub, nn.Linear):
        return weight.then(TRANSPOSE)
    if type(sub).__name__ == "Conv1D":
        return weight
    raise ArtifactError(f"{node}: its int4 weight belongs to {module} ({type(sub).__name__}), no nn.Linear or Conv1D")


def _gptq(
    calibration: Any, given: Path | None, loaded: LoadedModel, max_context: int, progress: Progress
) -> Layerwise | str:
    """GPTQ's layer-by-layer run over the export's calibration data (``given``, else what
    ``check_calibration`` reads without it), or why not."""
    from kiln.calibration import load_calibration_data

    if not isinstance(calibration, dict) or not {"source", "data_sha256", "windows", "window"} <= set(calibration):
        return "the manifest records no calibration data for its GPTQ"
    recorded = Recorded(
        str(calibration["source"]),
        str(calibration["data_sha256"]),
        int(calibration["windows"]),
        int(calibration["window"]),
    )
    source = rerun_source(recorded, given, loaded)
    if isinstance(source, Skip):
        return source.reason
    data = load_calibration_data(
        source,
        tokenizer=loaded.tokenizer,
        vocab_size=loaded.spec.vocab_size,
        samples=recorded.samples,
        window=recorded.window,
    )
    if data.sha256 != calibration["data_sha256"]:
        return f"its GPTQ calibration data {source} gives other token windows than the export's (sha256 differs)"
    return gptq_over(Reference(loaded, loaded.module, max_context), data.windows, progress)
