"""Decode-step latency of a Mamba2 hybrid (Granite 4.0-H's layer pattern) against the same-size model
whose every layer is attention, as the past grows (issue 43).

    python benchmarks/hybrid_decode.py --out /tmp/hybrid-bench          # export both, then time them
    python benchmarks/hybrid_decode.py --out /tmp/hybrid-bench --reuse  # time earlier exports again

Two random ``GraniteMoeHybridForCausalLM`` checkpoints (transformers, seed 0, fp32, dense MLP, NoPE
attention as the published Granite 4.0-H checkpoints): ``hybrid`` with attention on every fourth
layer and Mamba2 on the others, ``attention`` with attention on every layer, the other sizes equal.
Each is exported by ``kiln export --target ort`` at kiln's defaults (its parity gate included; batch
1), then ``kiln bench`` times both exports' portable and ``--target ort`` graphs and PyTorch eager,
at each ``--sweep`` past length (ONNX Runtime CPU, ``--threads`` threads, medians, interleaved).
A Mamba2 layer's state is the same size at every past length, so the hybrid's decode step grows
only by its attention layers' share. No peer runs beside it: onnxruntime-genai 0.18's builder maps
``GraniteMoeHybridForCausalLM`` to attention layers only (its Granite builder module has no Mamba2
path), so it cannot build the hybrid. Results as JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def _checkpoint(args: argparse.Namespace, directory: Path, every: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    kinds = ["full_attention" if i % every == every - 1 else "linear_attention" for i in range(args.layers)]
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        shared_intermediate_size=args.intermediate,
        num_local_experts=0,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        layer_types=kinds,
        position_embedding_type="nope",
        mamba_n_heads=args.mamba_heads,
        mamba_d_head=args.hidden * 2 // args.mamba_heads,
        mamba_d_state=args.state,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        max_position_embeddings=args.max_context,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory, safe_serialization=True)


def _kiln(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"kiln {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def _export(args: argparse.Namespace, name: str, every: int) -> Path:
    ckpt, out = args.out / f"{name}-ckpt", args.out / name
    if not args.reuse:
        shutil.rmtree(ckpt, ignore_errors=True)
        _checkpoint(args, ckpt, every)
        _kiln("export", "--model", str(ckpt), "--out", str(out), "--target", "ort", "--max-batch", "1", "--force")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reuse", action="store_true", help="time the exports already in --out")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--mamba-heads", type=int, default=24)
    parser.add_argument("--state", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--sweep", default="128,1024,3072")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "load_average": os.getloadavg()}
    for name, every in (("hybrid", 4), ("attention", 1)):
        out = _export(args, name, every)
        bench = args.out / f"{name}-bench.json"
        _kiln(
            "bench", str(out), "--sweep", args.sweep, "--sweep-runs", str(args.runs), "--runs", str(args.runs),
            "--threads", str(args.threads), "--no-roofline", "--out", str(bench), "--force",
        )  # fmt: skip
        result = json.loads(bench.read_text())
        report[name] = {"median_ms": result["median_ms"], "sweep": result.get("sweep")}
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
