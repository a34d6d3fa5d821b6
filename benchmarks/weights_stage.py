"""The weights stage alone, in process: ``kiln export`` of a checkpoint up to its portable graphs,
whose writing (``exporter.graphs.write_portable_graphs``: graph passes, then each graph's weights
into ``weights.bin``) is run ``--repeat`` times into ``--work``, the export stopped after it (no
target, no parity). Prints one JSON line per run: the seconds of the graphs' "weights" stages,
the bytes of ``weights.bin``, MB/s, the ``sync`` after it, and the load average.

    python -c "import sys; sys.path.insert(0, 'benchmarks'); import export_scale as e; from pathlib import Path; \\
        e.write_checkpoint(Path('l8b2'), e.shape_config('llama3-8b@2'))"   # Llama-3-8B's shapes, 2 layers
    python benchmarks/weights_stage.py l8b2 --precision fp16 --repeat 2

Before/after a change: run it once per tree in turn (``PYTHONPATH=<a copy of the older tree,
as a directory named kiln>`` for the older), on the same checkpoint, and ``cmp`` the two outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import kiln.exporter.graphs as graphs
from kiln.exporter import pipeline
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.progress import NullProgress, Timed


class _Done(Exception):
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--precision", default="fp32", help="a precision as the manifest names it (fp32, fp16, ...)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/kiln-weights-stage"))
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    write = graphs.write_portable_graphs

    def timed(*given: Any) -> Any:
        given_list = list(given)  # (reference, folded, options, traced, precision, onnx_dir, progress, lora)
        for run in range(args.repeat):
            out = args.work / "onnx"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            given_list[5], given_list[6] = out, (progress := Timed(NullProgress()))
            written = write(*given_list)
            start = time.perf_counter()
            os.sync()
            seconds = sum(s for stage, s in progress.seconds.items() if stage.endswith(": weights"))
            mb = written.weights.bytes / 1e6
            line = {"run": run, "weights_s": round(seconds, 2), "mb": round(mb), "mb_per_s": round(mb / seconds)}
            line |= {"sync_s": round(time.perf_counter() - start, 2), "load": os.getloadavg()[0]}
            print(json.dumps(line), flush=True)
        raise _Done

    pipeline.write_portable_graphs = timed  # type: ignore[assignment]
    options = ExportOptions(precision=Precision.parse(args.precision), force=True)
    try:
        pipeline.export(args.model, args.work / "export", options)
    except _Done:
        pass


if __name__ == "__main__":
    main()
