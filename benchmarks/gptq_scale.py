"""GPTQ's time per decoder layer at a Llama shape scaled down from 8B (issue 24), split into what
grows with the calibration tokens (the two forwards of each layer and the Hessian sums) and what
does not (GPTQ's numbers: each Hessian's factor, K^3, and each weight's updates, K^2 N), so the
8B time can be estimated from it without running it.

A random native Llama (RMSNorm, RoPE, SwiGLU, GQA) of ``--layers`` layers at ``--hidden`` /
``--intermediate`` (8B: 4096 / 14336, 32 / 8 heads of 128), quantized by kiln's GPTQ
(``Int4Quantizer`` over ``quantize_layerwise``) on ``--samples`` random windows of ``--window``
tokens; then, apart, GPTQ's numbers alone for one layer's weights at the same shapes. Peak RSS is
the process's by the end of the run (the model included: ``model_gb``).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/gptq_scale.py --hidden 1024 --intermediate 3584 --samples 32
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.exporter.int4.gptq import gptq_factored, inverse_factor
from kiln.exporter.int4.hessians import quantize_layerwise
from kiln.exporter.int4.quantize import Int4Quantizer
from kiln.exporter.passes.bind import ModuleWeight, WeightSource
from kiln.exporter.passes.transposes import TRANSPOSE
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln.plugins.native.build import random_model
from kiln.plugins.native.config import NativeConfig, PLEConfig


class _Clock:
    """A Progress that records when each layer's step ends."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    @contextlib.contextmanager
    def stage(self, description: str, total: int = 1) -> Iterator[Any]:
        clock = self
        clock.marks.append(time.perf_counter())

        class Stage:
            def advance(self, steps: int = 1) -> None:
                clock.marks.append(time.perf_counter())

        yield Stage()

    def note(self, message: str) -> None:
        return None


def _numbers_only(hidden: int, intermediate: int, kv: int) -> dict[str, float]:
    """GPTQ's numbers for one layer's weights (graph [K, N]), one factor per shared input."""
    rng = np.random.default_rng(0)
    shapes = {
        "qkv": (hidden, [hidden, kv, kv]),
        "o": (hidden, [hidden]),
        "gate_up": (hidden, [intermediate, intermediate]),
        "down": (intermediate, [hidden]),
    }
    out = {}
    for group, (k, ns) in shapes.items():
        x = rng.standard_normal((2 * k, k)).astype(np.float32)
        h = 2.0 / (2 * k) * x.T @ x
        began = time.perf_counter()
        factor = inverse_factor(h)
        out[f"{group}: factor K={k}"] = time.perf_counter() - began
        for n in ns:
            w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
            began = time.perf_counter()
            gptq_factored(w, factor, 128, np.dtype(np.float32))
            out[f"{group}: gptq [{k}, {n}]"] = time.perf_counter() - began
    return {k: round(v, 2) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3584)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--window", type=int, default=128)
    args = parser.parse_args()
    heads = args.hidden // args.head_dim
    kv = max(1, heads // 4)
    cfg = NativeConfig(
        vocab_size=1000,
        d_model=args.hidden,
        n_layers=args.layers,
        n_heads=heads,
        n_kv_heads=kv,
        d_ff=args.intermediate,
        max_context=args.window,
        ple=PLEConfig(enabled=False),
        tie_embeddings=False,
    )
    model = random_model(cfg, 0)
    source = WeightSource(model)
    names = [
        f"model.{n}.weight"
        for n, m in model.named_modules()
        if n.startswith("layers.") and hasattr(m, "weight") and m.weight.dim() == 2
    ]
    clock = _Clock()
    windows = list(np.random.default_rng(1).integers(0, 1000, size=(args.samples, args.window)))

    def layerwise(todo: Any, done: Any, quantize: Any) -> None:
        quantize_layerwise(model, "layers.{}", args.layers, windows, todo, done, quantize, clock)

    quantizer = Int4Quantizer(Int4Method.GPTQ, 128, layerwise)
    weights = {n: ModuleWeight(source, n, ir.DataType.FLOAT, (TRANSPOSE,)) for n in names}
    for n, w in weights.items():
        quantizer.want(w, w.key, n, 128, ir.DataType.FLOAT)
    began = time.perf_counter()
    quantizer.numbers(weights[names[0]], weights[names[0]].key, names[0], 128, ir.DataType.FLOAT)
    total = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB, the run's (before the numbers-only timing below)
    layers = [round(b - a, 2) for a, b in zip(clock.marks[:-1], clock.marks[1:], strict=True)]
    numbers = _numbers_only(args.hidden, args.intermediate, kv * args.head_dim)
    result = {
        "shape": {
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "heads": heads,
            "kv_heads": kv,
            "layers": args.layers,
        },
        "calibration": {"samples": args.samples, "window": args.window, "tokens": args.samples * args.window},
        "total_s": round(total, 2),
        "per_layer_s": layers,
        "numbers_only_one_layer_s": numbers,
        "numbers_sum_s": round(sum(numbers.values()), 2),
        "model_gb": round(sum(p.numel() * 4 for p in model.parameters()) / 1e9, 3),
        "peak_rss_gb": round(peak / 1e6, 3),
        "load": os.getloadavg(),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
