"""GPTQ's calibration size against its accuracy and time (issue 24): the study's trained Llama
(``benchmarks/lowbit_study.py``) quantized by kiln's own GPTQ (``Int4Quantizer`` over
``int4.hessians.quantize_layerwise``, the code an export runs) at several sample counts and
window lengths, each quantized model measured in PyTorch as ``benchmarks/accuracy.py`` measures
an export: perplexity and top-1 agreement with the fp32 model on the last 32 windows of 256
tokens of ``heldout.txt`` (calibration reads its first windows). An export's int4 graphs compute
this quantized model to fp32's tolerance (parity against its own int4 weights gates every
export), so these are the export's figures without the export's fixed costs.

Rows: RTN; GPTQ layer by layer at each ``--samples`` x ``--window``; with ``--float64`` the same
with the Hessians summed in float64 (the accumulation's own error); with ``--float32-numbers``
GPTQ's factor and updates in float32 (``gptq.NUMERICS``); with ``--whole`` GPTQ as
before issue 24 (every Hessian from one pass over the float model, float64). Time: the GPTQ run
alone (calibration forwards, Hessians, GPTQ numbers), wall seconds, and the load average.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/gptq_samples.py --model CKPT --samples 16 32 64 128 256 --window 128 \\
        --float64 --whole --out gptq-samples.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import torch
from tokenizers import Tokenizer

from kiln.calibration import load_calibration_data
from kiln.exporter.int4 import gptq as gptq_module
from kiln.exporter.int4 import hessians as hessians_module
from kiln.exporter.int4.numbers import dequantize, layer_block, unpack_int4
from kiln.exporter.int4.quantize import Int4Quantizer
from kiln.exporter.passes.bind import ModuleWeight, WeightSource
from kiln.exporter.passes.transposes import TRANSPOSE
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln.exporter.progress import NullProgress
from kiln.plugins import load_model, resolve_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy import WIN, _scores  # noqa: E402  (benchmarks/ is no package)


@contextlib.contextmanager
def _precisions(accumulate: torch.dtype, numerics: type[np.floating[Any]]) -> Iterator[None]:
    """The Hessian sums in ``accumulate``, GPTQ's factor and updates in ``numerics``."""
    saved = hessians_module.ACCUMULATE, gptq_module.NUMERICS
    hessians_module.ACCUMULATE, gptq_module.NUMERICS = accumulate, numerics
    try:
        yield
    finally:
        hessians_module.ACCUMULATE, gptq_module.NUMERICS = saved


def _linears(module: torch.nn.Module) -> list[str]:
    """The graph names of every Linear weight but the LM head (kiln's int4 default policy)."""
    return [
        f"model.{n}.weight"
        for n, m in module.named_modules()
        if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")
    ]


Numbers = dict[str, tuple[np.ndarray, np.ndarray]]  # weight -> (packed q, scale)


def _quantized(
    module: torch.nn.Module,
    method: Int4Method,
    block: int,
    windows: list[np.ndarray],
    prefix: str | None,
    n_layers: int,
) -> tuple[torch.nn.Module, float, Numbers]:
    """A copy of ``module`` computing with kiln's int4 numbers of its Linear weights, the seconds
    the quantizer took, and the numbers."""
    source = WeightSource(module)

    def layerwise(todo: Any, done: Any, quantize: Any) -> None:
        hessians_module.quantize_layerwise(module, prefix, n_layers, windows, todo, done, quantize, NullProgress())

    quantizer = Int4Quantizer(method, block, layerwise if method is Int4Method.GPTQ else None)
    weights = {name: ModuleWeight(source, name, ir.DataType.FLOAT, (TRANSPOSE,)) for name in _linears(module)}
    blocks = {name: layer_block(w.shape.numpy()[0], block) or 0 for name, w in weights.items()}
    for name, weight in weights.items():
        quantizer.want(weight, weight.key, name, blocks[name], ir.DataType.FLOAT)
    began = time.perf_counter()
    numbers = {
        name: quantizer.numbers(weight, weight.key, name, blocks[name], ir.DataType.FLOAT)
        for name, weight in weights.items()
    }
    seconds = time.perf_counter() - began
    out = copy.deepcopy(module)
    for name, (packed, scale) in numbers.items():
        k, n = weights[name].shape.numpy()
        out.get_parameter(name.removeprefix("model.")).data = torch.from_numpy(
            np.ascontiguousarray(dequantize(unpack_int4(packed, (k, n)), scale).T)
        )
    return out, seconds, numbers


def _codes_differing(a: Numbers, b: Numbers) -> float:
    """The fraction of int4 codes that differ between two runs' numbers (packed: two a byte)."""
    differ = sum(
        int(((x[0] ^ y[0]) & 0x0F != 0).sum() + ((x[0] ^ y[0]) >> 4 != 0).sum()) for x, y in ((a[n], b[n]) for n in a)
    )
    return differ / sum(2 * a[n][0].size for n in a)


def _logits(module: torch.nn.Module, windows: list[np.ndarray]) -> list[np.ndarray]:
    with torch.no_grad():
        return [
            module(torch.from_numpy(w), torch.ones_like(torch.from_numpy(w)), torch.arange(WIN)[None])[0].numpy()
            for w in windows
        ]


def _row(
    label: str,
    module: torch.nn.Module,
    seconds: float,
    windows: list[np.ndarray],
    ref: list[np.ndarray],
    base: float,
    **extra: Any,
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "label": label,
        **extra,
        **_scores(_logits(module, windows), windows, ref),
        "gptq_seconds": round(seconds, 2),
        "load": os.getloadavg()[0],
    }
    row["perplexity_change_pct"] = 100 * (row["perplexity"] / base - 1)
    differ = f"{100 * extra['codes_differing']:.3f}%" if "codes_differing" in extra else ""
    print(
        f"| {label} | {row['perplexity']:.3f} | {row['perplexity_change_pct']:+.2f}% | "
        f"{100 * row['top1_agreement']:.2f}% | {seconds:.1f} s | {differ} | {row['load']:.1f} |",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", required=True, help="the study's checkpoint (heldout.txt and tokenizer.json beside it)"
    )
    parser.add_argument("--samples", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--window", type=int, nargs="+", default=[128])
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--windows", type=int, default=32, help="evaluation windows of 256 tokens")
    parser.add_argument("--float64", action="store_true", help="also each setting with the Hessians summed in float64")
    parser.add_argument(
        "--float32-numbers",
        action="store_true",
        help="also each setting with GPTQ's factor and updates in float32 (gptq.NUMERICS)",
    )
    parser.add_argument(
        "--whole",
        action="store_true",
        help="also GPTQ as before issue 24: all Hessians from one pass over the float model (float64)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    ckpt = resolve_checkpoint(args.model)
    loaded = load_model(args.model)
    module, spec = loaded.module, loaded.spec
    prefix = loaded.layers.prefix if loaded.layers is not None else None
    ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode((ckpt / "heldout.txt").read_text()).ids
    tail = ids[len(ids) - args.windows * WIN :]  # accuracy.py's windows
    windows = [np.array(tail[i * WIN : (i + 1) * WIN], dtype=np.int64)[None] for i in range(args.windows)]
    ref = _logits(module, windows)
    base = float(_scores(ref, windows, ref)["perplexity"])
    print(
        f"fp32 perplexity {base:.3f}\n\n| variant | perplexity | vs fp32 | top-1 agreement | GPTQ seconds | int4 "
        "codes differing from float32's | load |\n|---|---|---|---|---|---|---|",
        flush=True,
    )
    rows = [
        _row(
            "rtn", _quantized(module, Int4Method.RTN, args.block, [], prefix, spec.n_layers)[0], 0.0, windows, ref, base
        )
    ]  # no data
    for window in args.window:
        for samples in args.samples:
            data = load_calibration_data(
                str(ckpt / "heldout.txt"),
                tokenizer=loaded.tokenizer,
                vocab_size=spec.vocab_size,
                samples=samples,
                window=window,
            )
            calib = list(data.windows)
            settings = {"samples": len(calib), "window": window}
            variants = [("layer by layer, float32", torch.float32, np.float64, prefix)]
            variants += [("layer by layer, float64", torch.float64, np.float64, prefix)] if args.float64 else []
            variants += (
                [("layer by layer, float32, numbers float32", torch.float32, np.float32, prefix)]
                if args.float32_numbers
                else []
            )
            variants += (
                [("whole model at once, float64 (before issue 24)", torch.float64, np.float64, None)]
                if args.whole
                else []
            )
            first: Numbers | None = None
            for label, accumulate, numerics, plan in variants:
                with _precisions(accumulate, numerics):
                    quantized, seconds, numbers = _quantized(
                        module, Int4Method.GPTQ, args.block, calib, plan, spec.n_layers
                    )
                first = first or numbers
                differ = _codes_differing(first, numbers)  # against the float32 layer-by-layer run
                extra = {
                    "accumulate": str(accumulate),
                    "numerics": numerics.__name__,
                    "layerwise": plan is not None,
                    "codes_differing": differ,
                }
                rows.append(
                    _row(
                        f"gptq {len(calib)} x {window}, {label}",
                        quantized,
                        seconds,
                        windows,
                        ref,
                        base,
                        **settings,
                        **extra,
                    )
                )
    args.out.write_text(
        json.dumps(
            {
                "checkpoint": str(ckpt),
                "fp32_perplexity": base,
                "eval_windows": args.windows,
                "block": args.block,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
