"""The calibration stage of an export whose kinds read activation ranges (int8, fp8): the data
and settings prepared once (``calibration.Calibration``, ranges from the cache when it has
them), and each graph's ranges computed on its fp32 graph through PyTorch's teacher-forced
feeds. ``kiln export`` (``pipeline``) and ``kiln check``'s calibration run again
(``qdq_rerun``) both calibrate through these two functions."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence

import onnx_ir as ir

from kiln.calibration import Calibration
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.load import Reference
from kiln.exporter.options import ExportOptions
from kiln.exporter.precision.kinds.base import Needs, Ranges
from kiln.exporter.progress import Progress
from kiln.exporter.runners import TorchRunner

__all__ = ["prepare_calibration", "graph_ranges", "weights_identity"]


def weights_identity(checkpoint: Mapping[str, str], adapters: Sequence[tuple[Mapping[str, str], float]] = ()) -> str:
    """The calibration cache's key for the weights calibrated: a sha256 over every checkpoint file's sha256 (by
    name: each shard of a sharded checkpoint, its config) and every merged adapter's (its files' sha256 and its
    weight in the sum, in ``--adapter`` order). It was one file's hash (a sharded checkpoint's first shard): an
    export of a checkpoint that differed in another shard, in its config or by a merged adapter reused ranges
    calibrated on other weights."""
    record = {
        "checkpoint": dict(sorted(checkpoint.items())),
        "adapters": [[dict(sorted(files.items())), weight] for files, weight in adapters],
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def prepare_calibration(
    reference: Reference, options: ExportOptions, weights: Callable[[], str], progress: Progress
) -> Calibration | None:
    """The kinds that read activation ranges (int8, fp8): the calibration data and settings (and
    ranges, when the cache has them); ``weights``: the weights' ``weights_identity`` (the cache's key),
    asked for only here (the export hashes its checkpoint ahead, beside its stages: ``HashAhead``)."""
    if not options.precision.needs(Needs.RANGES):
        return None
    assert options.calibration.data is not None, "the kinds that read ranges refuse to go without --calib-data"
    calibration = Calibration.prepare(
        options.calibration.data,
        spec=reference.spec,
        tokenizer=reference.loaded.tokenizer,
        weights_sha256=weights(),
        samples=options.samples,
        method=options.calibration.method,
        percentile=options.calibration.percentile,
        context=reference.max_context,
        graph_settings={
            "opset": options.graphs.opset,
            "logits": options.graphs.logits.value,
            "ple_extend": options.ple.extend,
            "ple_extend_mode": options.ple.extend_mode.value,
            "ple_tables": options.ple.tables.value,
        },
        cache_dir=options.calibration.cache,
    )
    if calibration.cache_hit:
        progress.note(f"calibration: reusing cached ranges {options.calibration.cache}/{calibration.key}.json")
    return calibration


def graph_ranges(
    reference: Reference, options: ExportOptions, calibration: Calibration | None, progress: Progress
) -> Callable[[GraphKind, ir.Model], Ranges] | None:
    """A graph's ranges (its kind, its fp32 model): the precision kinds' ``context.ranges``."""
    if calibration is None:
        return None
    runner = TorchRunner(
        reference.module, reference.spec.n_layers, options.graphs.last_logits_only
    )  # runs the teacher-forced decode feeds
    return lambda kind, model: calibration.ranges_for(kind, model, reference.spec, runner, progress)
