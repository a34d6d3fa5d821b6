"""calibration/: turns data into activation ranges for int8 Q/DQ.

``Calibration`` ties the pieces together for one export: the data (``data.py``), the feeds
that run prefill and teacher-forced decode steps (``feeds.py``), ONNX Runtime's calibrators or
the MSE observer (``methods.py``), and the caches (``cache.py``): ranges keyed by sha256 of the
weights, the data and the settings, reused when all three match; and the legacy TensorRT
calibration cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import onnx_ir as ir

from kiln.calibration.cache import cache_key, read_cache, trt_calibration_cache, write_cache
from kiln.calibration.data import SYNTHETIC, CalibrationData, load_calibration_data
from kiln.calibration.feeds import DECODE_STEPS, calibration_feeds
from kiln.calibration.methods import CalibMethod, collect_ranges, mse_threshold
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.progress import Progress
from kiln.exporter.runners import Feeds, TorchRunner
from kiln.plugins.base import DecoderSpec

__all__ = [
    "SYNTHETIC",
    "CalibMethod",
    "Calibration",
    "CalibrationData",
    "load_calibration_data",
    "calibration_feeds",
    "collect_ranges",
    "mse_threshold",
    "trt_calibration_cache",
]

WINDOW = 128  # tokens per calibration sample


@dataclasses.dataclass
class Calibration:
    data: CalibrationData
    method: CalibMethod
    percentile: float
    key: str
    settings: dict[str, object]
    cache_dir: Path | None
    ranges: dict[str, dict[str, tuple[float, float]]]
    cache_hit: bool

    @classmethod
    def prepare(
        cls,
        source: str,
        *,
        spec: DecoderSpec,
        tokenizer: Path | None,
        weights_sha256: str,
        samples: int,
        method: str,
        percentile: float,
        context: int,
        graph_settings: dict[str, object],
        cache_dir: Path | None,
    ) -> Calibration:
        window = min(WINDOW, context)
        data = load_calibration_data(
            source, tokenizer=tokenizer, vocab_size=spec.vocab_size, samples=samples, window=window
        )
        settings: dict[str, object] = {
            "method": method,
            "percentile": percentile if method == "percentile" else None,
            "samples": len(data.windows),
            "window": window,
            "decode_steps": DECODE_STEPS,
            **graph_settings,  # the traced graphs' tensor names depend on these
        }
        key = cache_key(weights_sha256, data.sha256, settings)
        cached = read_cache(cache_dir, key) if cache_dir is not None else None
        return cls(data, CalibMethod(method), percentile, key, settings, cache_dir, cached or {}, cached is not None)

    def ranges_for(
        self, kind: GraphKind, model: ir.Model, spec: DecoderSpec, reference: TorchRunner, progress: Progress
    ) -> dict[str, tuple[float, float]]:
        """The ranges of ``kind``'s graph (``model``): cached, or calibrated now in a stage of its
        own that counts the samples (each: PyTorch's teacher-forced steps, then ONNX Runtime's)."""
        if kind.value not in self.ranges:
            windows = self.data.windows
            with progress.stage(f"calibrate {kind.value}.onnx ({self.method.value})", total=len(windows)) as bar:

                def samples() -> Iterator[list[Feeds]]:
                    for window in windows:
                        yield calibration_feeds(spec, kind, window, reference)
                        bar.advance()  # resumed when the sample's ranges are merged

                self.ranges[kind.value] = collect_ranges(model, samples(), self.method, self.percentile)
        return self.ranges[kind.value]

    def finish(self, directory: Path) -> dict[str, object]:
        """Write the cache (on a miss) and the legacy TensorRT caches into ``directory``."""
        cache_path = None
        if self.cache_dir is not None:
            cache_path = self.cache_dir / f"{self.key}.json"
            if not self.cache_hit:
                write_cache(self.cache_dir, self.key, self.ranges, self.settings)
        directory.mkdir(parents=True, exist_ok=True)
        for graph, ranges in sorted(self.ranges.items()):
            (directory / f"{graph}.trt-calibration.cache").write_text(trt_calibration_cache(ranges))
        return {
            "source": self.data.source,
            "data_sha256": self.data.sha256,
            "key": self.key,
            "cache": None if cache_path is None else ("reused" if self.cache_hit else "written"),
            "settings": self.settings,
        }
