"""``kiln bench``: prefill and decode-step latency at batch 1, PyTorch eager vs ONNX Runtime
(one row per export directory: fp32, fp16, int8 variants of one checkpoint side by side).

The machine is shared and noisy, so the backends are measured interleaved (one call of each in
turn), ONNX Runtime's spinning threads are switched off, and medians over many runs are
reported. Timings live here, never in tests.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.errors import BenchError
from kiln.exporter import manifest as manifest_mod
from kiln.exporter.io_contract import GraphKind, past_names
from kiln.exporter.runners import TorchRunner
from kiln.exporter.verify import require_verified
from kiln.plugins import load_model
from kiln.plugins.base import DecoderSpec

__all__ = ["BenchOptions", "run_bench", "render"]


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    prefill_seq: int = 128
    past: int = 256
    runs: int = 30
    threads: int = 2
    pause_s: float = 0.002  # between calls, so one backend's tail does not bleed into the next


def _feeds(spec: DecoderSpec, kind: GraphKind, seq: int, past: int, kv_dtype: str = "float32") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {
        "input_ids": rng.integers(0, spec.vocab_size, size=(1, seq), dtype=np.int64),
        "attention_mask": np.ones((1, past + seq), dtype=np.int64),
        "position_ids": np.arange(past, past + seq, dtype=np.int64)[None, :],
    }
    if kind is not GraphKind.PREFILL:
        for i in range(spec.n_layers):
            for name in past_names(i):
                feeds[name] = rng.standard_normal((1, spec.n_kv_heads, past, spec.head_dim)).astype(kv_dtype)
    return feeds


def _session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _interleaved(calls: dict[str, Callable[[], object]], runs: int, pause: float) -> dict[str, float]:
    for call in calls.values():  # warm-up
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
            time.sleep(pause)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def run_bench(directories: list[Path], options: BenchOptions) -> dict[str, Any]:
    """PyTorch eager and every directory's graphs on ONNX Runtime (e.g. fp32, fp16, int8
    exports of one checkpoint), measured interleaved."""
    manifests = [require_verified(d) for d in directories]
    first = manifests[0]
    for directory, manifest in zip(directories[1:], manifests[1:], strict=True):
        if manifest["checkpoint"]["files"] != first["checkpoint"]["files"]:
            raise BenchError(f"{directory}: exported from another checkpoint than {directories[0]}; bench compares exports of one model")
    ref = first["checkpoint"]["reference"]
    if ref is None:
        raise BenchError(f"{directories[0]}: the manifest does not name its checkpoint")
    loaded = load_model(ref)
    spec = loaded.spec
    limit = min(m["limits"]["max_context"] for m in manifests)
    seq = min(options.prefill_seq, limit)
    past = min(options.past, limit - 1)
    torch.set_num_threads(options.threads)
    torch_runner = TorchRunner(loaded.module, spec.n_layers)
    labels = [f"onnxruntime {m['precision']}" for m in manifests]
    if len(set(labels)) < len(labels):
        labels = [f"{label} ({d.name})" for label, d in zip(labels, directories, strict=True)]
    rows: dict[str, dict[str, float]] = {}
    for kind, s, p in ((GraphKind.PREFILL, seq, 0), (GraphKind.DECODE, 1, past)):
        calls: dict[str, Callable[[], object]] = {
            "pytorch eager": lambda k=kind, f=_feeds(spec, kind, s, p): torch_runner.run(k, f),
        }
        for label, directory, manifest in zip(labels, directories, manifests, strict=True):
            feeds = _feeds(spec, kind, s, p, manifest["kv_cache"]["dtype"])
            session = _session(directory / manifest["graphs"][kind.value]["file"], options.threads)
            calls[label] = lambda s=session, f=feeds: s.run(None, f)
        rows[kind.value] = _interleaved(calls, options.runs, options.pause_s)
    return {
        "directories": [str(d) for d in directories],
        "batch": 1,
        "prefill_seq": seq,
        "decode_past": past,
        "threads": options.threads,
        "runs": options.runs,
        "median_ms": rows,
        "tools": manifest_mod.tool_versions(),
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        f"batch 1, {result['threads']} threads, median of {result['runs']} interleaved runs",
        "",
        "| backend | prefill (seq {0}) ms | decode step (past {1}) ms | prefill speed-up | decode speed-up |".format(result["prefill_seq"], result["decode_past"]),
        "|---|---|---|---|---|",
    ]
    pre, dec = result["median_ms"]["prefill"], result["median_ms"]["decode"]
    base_pre, base_dec = pre["pytorch eager"], dec["pytorch eager"]
    for name in pre:
        lines.append(f"| {name} | {pre[name]:.2f} | {dec[name]:.2f} | {base_pre / pre[name]:.2f}x | {base_dec / dec[name]:.2f}x |")
    return "\n".join(lines)
