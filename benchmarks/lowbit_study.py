"""Low-bit accuracy study (issue 16): a Llama-architecture model trained once with kiln's own training
code, exported in every precision, each measured by ``benchmarks/accuracy.py``.

1. Train (cached): ``python -m kiln.demo.train --arch llama`` on the Python standard library
   (text every machine has offline), into ``--cache`` (default ``~/.cache/kiln/lowbit-study``),
   a directory named after the size and steps; an existing ``training.json`` there is reused.
   At the defaults (d_model 384, 8 layers, SwiGLU 1280: 15.3 M parameters) training is the slow
   part (the budget is about 30 minutes on 2 cores: pick ``--steps`` for your machine).
2. Export: fp32, fp16, int8 (each ``--calib-method``), int4 rtn and gptq (with ``--target ort``:
   both the portable block-DQ and the MatMulNBits graphs), fp8; calibration and GPTQ data are the
   first windows of the model's ``heldout.txt``, evaluation its last (accuracy.py: no overlap).
3. Measure: perplexity change, top-1 agreement with fp32 PyTorch, greedy 64-token match
   (portable graphs and ``--target ort`` graphs), and ``kiln bench`` decode latency of the ORT
   int4 graphs beside ORT fp32; one JSON (``--out``) and a Markdown table on stdout.

    python benchmarks/lowbit_study.py --out study.json                       # the full study
    python benchmarks/lowbit_study.py --d-model 64 --n-layers 2 --d-ff 128 --steps 20 --windows 4 --prompts 2 --out smoke.json   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _run(cmd: list[str], log: Path) -> str:
    print("+", " ".join(cmd), flush=True)
    with log.open("a") as f:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env={**os.environ})
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}; see {log}")
    return done.stdout


def _variants(heldout: Path, calib_samples: int) -> dict[str, list[str]]:
    data = ["--calib-data", str(heldout)]
    out: dict[str, list[str]] = {"fp32": ["--target", "ort"], "fp16": ["--fp16"]}
    for method in ("max", "percentile", "entropy", "mse"):
        out[f"int8-{method}"] = ["--int8", *data, "--calib-method", method, "--calib-samples", str(calib_samples)]
    out["int4-rtn"] = ["--int4", "--int4-method", "rtn", "--target", "ort"]
    out["int4-gptq"] = ["--int4", "--int4-method", "gptq", *data, "--target", "ort"]
    out["fp8"] = ["--fp8", *data, "--calib-samples", str(calib_samples)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "kiln" / "lowbit-study")
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--d-ff", type=int, default=1280)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--windows", type=int, default=32, help="evaluation windows of 256 tokens")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    ckpt = args.cache / f"llama-d{args.d_model}-l{args.n_layers}-f{args.d_ff}-s{args.steps}"
    exports = ckpt.parent / f"{ckpt.name}-exports"
    log = args.cache / "study.log"
    args.cache.mkdir(parents=True, exist_ok=True)
    if not (ckpt / "training.json").is_file():
        _run([sys.executable, "-m", "kiln.demo.train", "--arch", "llama", "--out", str(ckpt), "--steps", str(args.steps),
              "--d-model", str(args.d_model), "--n-layers", str(args.n_layers), "--d-ff", str(args.d_ff)], log)
    training = json.loads((ckpt / "training.json").read_text())
    variants = _variants(ckpt / "heldout.txt", args.calib_samples)
    failed: dict[str, str] = {}  # a variant whose export fails its parity gate is a result too: recorded, not measured
    for name, flags in variants.items():
        if not (exports / name / "manifest.json").is_file():
            try:
                _run(["kiln", "export", "--model", str(ckpt), "--out", str(exports / name), "--parity-tokens", "16", "--force", "--json", *flags], log)
            except SystemExit:
                failed[name] = log.read_text().strip().splitlines()[-1]
                print(f"  {name}: {failed[name]}", flush=True)
    variants = {n: f for n, f in variants.items() if n not in failed}
    measure = [sys.executable, str(HERE / "accuracy.py"), "--model", str(ckpt), "--windows", str(args.windows), "--prompts", str(args.prompts)]
    portable = json.loads(_run([*measure, *(str(exports / n) for n in variants)], log))
    ort = json.loads(_run([*measure, "--target", "ort", *(str(exports / n) for n in variants if "--target" in variants[n])], log))
    bench = _run(["kiln", "bench", *(str(exports / n) for n in ("fp32", "int4-rtn", "int4-gptq")), "--no-torch", "--runs", "20", "--json"], log)
    result = {"checkpoint": str(ckpt), "parameters": training.get("param_count"), "heldout_perplexity": training.get("heldout_perplexity"),
              "portable": portable, "ort": ort, "bench": json.loads(bench), "failed": failed}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| variant | graphs | perplexity | vs PyTorch | top-1 agreement | greedy tokens equal (per prompt) |")
    print("|---|---|---|---|---|---|")
    for graphs, table in (("portable", portable), ("ort", ort)):
        for name, row in table["rows"].items():
            print(f"| {Path(name).name} | {graphs} | {row['perplexity']:.3f} | {row['perplexity_change_pct']:+.2f}% | {100 * row['top1_agreement']:.2f}% | "
                  f"{', '.join(map(str, row.get('greedy_match_length', [])))} |")


if __name__ == "__main__":
    main()
