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
   Also ``--target ort --ort-int8`` (kiln's weight-only int8 MatMulNBits, for the decode ratio).
3. The peer: the checkpoint written as a Hugging Face Llama (``native_to_hf.py``, checked: its
   logits equal the native model's) and built by the ONNX Runtime GenAI builder (``--genai-venv``)
   at int4 RTN, the same block size (``--int4-block``): as the builder ships it (this model ties
   its head, so the builder shares one int4 matrix for embedding and head) and with the LM head
   kept float as kiln keeps it (``shared_embeddings=false nodes_to_exclude=/lm_head/MatMul``);
   and at fp32 (a check of the measuring: it must agree with PyTorch).
4. Measure: perplexity change, top-1 agreement with fp32 PyTorch, greedy 64-token match
   (portable graphs, ``--target ort`` graphs and the builder's ``model.onnx``), and ``kiln bench``
   decode latency of the ORT graphs and the builder's beside ORT fp32, interleaved in one run;
   one JSON (``--out``) and a Markdown table on stdout.

    python benchmarks/lowbit_study.py --out study.json                       # the full study
    python benchmarks/lowbit_study.py --d-model 64 --n-layers 2 --d-ff 128 --steps 20 --windows 4 --prompts 2 \\
        --out smoke.json   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
KILN = [sys.executable, "-m", "kiln.cli"]  # the kiln this interpreter imports (not whichever is on PATH)


def _run(cmd: list[str], log: Path) -> str:
    print("+", " ".join(cmd), flush=True)
    with log.open("a") as f:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env={**os.environ})
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}; see {log}")
    return done.stdout


def _variants(heldout: Path, calib_samples: int, block: int) -> dict[str, list[str]]:
    data = ["--calib-data", str(heldout)]
    out: dict[str, list[str]] = {"fp32": ["--target", "ort"], "fp16": ["--fp16"]}
    for method in ("max", "percentile", "entropy", "mse"):
        out[f"int8-{method}"] = ["--int8", *data, "--calib-method", method, "--calib-samples", str(calib_samples)]
    out["ort-int8"] = ["--target", "ort", "--ort-int8"]
    b = "" if block == 128 else f"-b{block}"  # directory suffix for a non-default block
    out[f"int4-rtn{b}"] = ["--int4", "--int4-method", "rtn", "--int4-block", str(block), "--target", "ort"]
    out[f"int4-gptq{b}"] = ["--int4", "--int4-method", "gptq", "--int4-block", str(block), *data, "--target", "ort"]
    # the LM head int4 too, as the GenAI builder ships a tied model: the like-for-like row for its default
    out[f"int4-gptq{b}-all"] = [
        "--int4",
        "--int4-method",
        "gptq",
        "--int4-block",
        str(block),
        "--int4-all-matmuls",
        *data,
        "--target",
        "ort",
    ]
    out["fp8"] = ["--fp8", *data, "--calib-samples", str(calib_samples)]
    # fp8 with the first layer's most sensitive MatMuls fp16 (benchmarks/fp8_sensitivity.py on this model)
    qkv = [a for m in ("q_proj", "k_proj", "v_proj") for a in ("--fp8-float", f"/layers.0.attn.{m}/")]
    out["fp8-l0qkv-fp16"] = [*out["fp8"], *qkv]
    out["fp8-l0-fp16"] = [
        *out["fp8"],
        *qkv,
        *(a for m in ("attn.o_proj", "mlp.gate", "mlp.fc1", "mlp.fc2") for a in ("--fp8-float", f"/layers.0.{m}/")),
    ]
    return out


def _genai(ckpt: Path, exports: Path, venv: Path, block: int, log: Path) -> dict[str, Path]:
    """The GenAI builder's graphs of the same checkpoint (cached): int4 RTN at ``block`` as it
    ships for a tied model (embedding and head one int4 matrix), int4 RTN with the head float (kiln's
    policy), and fp32."""
    from native_to_hf import native_to_hf

    hf = exports / "hf"
    if not (hf / "model.safetensors").is_file():
        native_to_hf(ckpt, hf)
    rtn = ["-p", "int4", "--extra_options", f"block_size={block}", "algo_config=rtn"]
    builds = {
        f"genai-int4-rtn-b{block}": rtn,
        f"genai-int4-rtn-b{block}-head-float": [*rtn, "shared_embeddings=false", "nodes_to_exclude=/lm_head/MatMul"],
        "genai-fp32": ["-p", "fp32"],
    }
    out = {}
    for name, flags in builds.items():
        if not (exports / name / "genai_config.json").is_file():
            _run(
                [
                    str(venv / "bin" / "python"),
                    "-m",
                    "onnxruntime_genai.models.builder",
                    "-i",
                    str(hf),
                    "-o",
                    str(exports / name),
                    "-e",
                    "cpu",
                    "-c",
                    str(exports / "genai-cache"),
                    *flags,
                ],
                log,
            )
        out[name] = exports / name
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
    parser.add_argument(
        "--int4-block", type=int, default=128, help="int4 block size of kiln's and the GenAI builder's int4"
    )
    parser.add_argument(
        "--genai-venv",
        type=Path,
        default=Path("/work/peers-genai-venv"),
        help="a venv with onnxruntime-genai (benchmarks/peers/make_venvs.sh); absent: no peer rows",
    )
    parser.add_argument("--bench-runs", type=int, default=50, help="kiln bench --runs (interleaved; median)")
    parser.add_argument(
        "--retry-failed", action="store_true", help="export again the variants an earlier run's parity gate refused"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    ckpt = args.cache / f"llama-d{args.d_model}-l{args.n_layers}-f{args.d_ff}-s{args.steps}"
    exports = ckpt.parent / f"{ckpt.name}-exports"
    log = args.cache / "study.log"
    args.cache.mkdir(parents=True, exist_ok=True)
    if not (ckpt / "training.json").is_file():
        _run(
            [
                sys.executable,
                "-m",
                "kiln.demo.train",
                "--arch",
                "llama",
                "--out",
                str(ckpt),
                "--steps",
                str(args.steps),
                "--d-model",
                str(args.d_model),
                "--n-layers",
                str(args.n_layers),
                "--d-ff",
                str(args.d_ff),
            ],
            log,
        )
    training = json.loads((ckpt / "training.json").read_text())
    variants = _variants(ckpt / "heldout.txt", args.calib_samples, args.int4_block)
    failed = _export_variants(ckpt, exports, variants, log, args.retry_failed)
    variants = {n: f for n, f in variants.items() if n not in failed}
    peers = (
        _genai(ckpt, exports, args.genai_venv, args.int4_block, log)
        if (args.genai_venv / "bin" / "python").is_file()
        else {}
    )
    measure = [
        sys.executable,
        str(HERE / "accuracy.py"),
        "--model",
        str(ckpt),
        "--windows",
        str(args.windows),
        "--prompts",
        str(args.prompts),
    ]
    portable = json.loads(
        _run([*measure, *(str(exports / n) for n in variants if n != "ort-int8")], log)
    )  # ort-int8's portable graphs are fp32's
    ort = json.loads(
        _run(
            [
                *measure,
                "--target",
                "ort",
                *(str(exports / n) for n in variants if "--target" in variants[n]),
                *map(str, peers.values()),
            ],
            log,
        )
    )
    timed = [str(exports / n) for n in variants if n == "fp32" or n.startswith(("ort-int8", "int4"))]
    compare = [a for p in peers.values() for a in ("--compare", str(p))]
    bench = _run([*KILN, "bench", *timed, *compare, "--no-torch", "--runs", str(args.bench_runs), "--json"], log)
    result = {
        "checkpoint": str(ckpt),
        "parameters": training.get("param_count"),
        "heldout_perplexity": training.get("heldout_perplexity"),
        "int4_block": args.int4_block,
        "genai": {k: str(v) for k, v in peers.items()},
        "portable": portable,
        "ort": ort,
        "bench": json.loads(bench),
        "failed": failed,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    _print_tables(result, args.int4_block)


def _export_variants(
    ckpt: Path, exports: Path, variants: dict[str, list[str]], log: Path, retry_failed: bool
) -> dict[str, str]:
    """Export every variant not exported yet; returns those whose export failed its parity gate
    (a result too: recorded, not measured), with the failing line."""
    failed: dict[str, str] = {}
    for name, flags in variants.items():
        refused = exports / f"{name}.failed"  # the failing line of an earlier run: not retried unless --retry-failed
        if refused.is_file() and not retry_failed:
            failed[name] = refused.read_text().strip()
            print(f"  {name}: failed in an earlier run: {failed[name]}", flush=True)
        elif not (exports / name / "manifest.json").is_file():
            try:
                _run(
                    [
                        *KILN,
                        "export",
                        "--model",
                        str(ckpt),
                        "--out",
                        str(exports / name),
                        "--parity-tokens",
                        "16",
                        "--force",
                        "--json",
                        *flags,
                    ],
                    log,
                )
            except SystemExit:
                failed[name] = log.read_text().strip().splitlines()[-1]
                refused.parent.mkdir(parents=True, exist_ok=True)
                refused.write_text(failed[name] + "\n")
                print(f"  {name}: {failed[name]}", flush=True)
    return failed


def _print_tables(result: dict[str, Any], int4_block: int) -> None:
    print("| variant | graphs | perplexity | vs PyTorch | top-1 agreement | greedy tokens equal (per prompt) |")
    print("|---|---|---|---|---|---|")
    for graphs in ("portable", "ort"):
        for name, row in result[graphs]["rows"].items():
            print(
                f"| {Path(name).name} | {graphs} | {row['perplexity']:.3f} | "
                f"{row['perplexity_change_pct']:+.2f}% | {100 * row['top1_agreement']:.2f}% | "
                f"{', '.join(map(str, row.get('greedy_match_length', [])))} |"
            )
    decode = result["bench"]["median_ms"]["decode"]
    print(
        f"\ndecode step, batch 1, past {result['bench']['decode_past']}, median of {result['bench']['runs']} "
        "interleaved runs:"
    )
    for label, ms in decode.items():
        print(f"  {label}: {ms:.3f} ms")
    for line in ratios(decode, int4_block):
        print(line)


def ratios(decode: dict[str, float], block: int) -> list[str]:
    """Issue 16's decode ratios from ``kiln bench``'s decode medians (labels as it writes them)."""

    def ms(label: str) -> float | None:
        return decode.get(label)

    int4, int8 = ms("kiln ort int4 (int4-gptq)"), ms("kiln ort int8 (ort-int8)")
    lines = []
    if int4 is not None and int8 is not None:
        lines.append(f"kiln ORT int4 / kiln ORT int8: {int4 / int8:.2f}x (target <= 0.80x)")
    for mine, label in (("int4-gptq", "kiln ORT int4"), ("int4-gptq-all", "kiln ORT int4, head int4")):
        for peer in (f"genai-int4-rtn-b{block}", f"genai-int4-rtn-b{block}-head-float"):
            a, b = ms(f"kiln ort int4 ({mine})"), ms(f"genai ({peer})")
            if a is not None and b is not None:
                lines.append(f"{label} / {peer}: {a / b:.2f}x (target <= 1.00x)")
    return lines


if __name__ == "__main__":
    main()
