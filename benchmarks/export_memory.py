"""Export wall time and peak memory (RSS) for a large native model.

Builds a randomly initialised native checkpoint of about 340M parameters (fp32 safetensors,
~1.35 GB), then runs ``kiln export`` on it in a child process and reports the child's peak RSS
divided by the checkpoint's size. Run it by hand (it takes minutes and GBs; it is not a test):

    python benchmarks/export_memory.py --work /tmp/kiln-bench [--layers 24 --d-model 1024]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_model

from kiln.plugins.native import random_model
from kiln.plugins.native.config import NativeConfig, PLEConfig
from kiln.plugins.native.model import PLEDecoder


def make_checkpoint(directory: Path, layers: int, d_model: int, vocab: int) -> tuple[Path, int]:
    cfg = NativeConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_layers=layers,
        n_heads=d_model // 64,
        n_kv_heads=d_model // 128,
        d_ff=int(d_model * 2.75),
        max_context=512,
        ple=PLEConfig(max_positions=512),
    )
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "model.safetensors").is_file():
        model = random_model(cfg, 0)
        cfg.save(directory / "config.json")
        save_model(model, str(directory / "model.safetensors"))
        del model
    with torch.device("meta"):
        params = sum(p.numel() for p in PLEDecoder(cfg).parameters())
    return directory, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/kiln-bench"))
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--parity-tokens", type=int, default=8)
    args = parser.parse_args()

    ckpt, params = make_checkpoint(args.work / "ckpt", args.layers, args.d_model, args.vocab)
    size = (ckpt / "model.safetensors").stat().st_size
    out = args.work / "out"
    cmd = [sys.executable, "-m", "kiln.cli", "export", "--model", str(ckpt), "--out", str(out), "--force", "--json",
           "--max-batch", "2", "--parity-tokens", str(args.parity_tokens)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"export failed: {proc.stderr.strip()}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
    print(json.dumps({
        "parameters": params,
        "checkpoint_bytes": size,
        "export_wall_s": round(wall, 1),
        "peak_rss_bytes": peak,
        "peak_rss_over_checkpoint": round(peak / size, 2),
        "torch": torch.__version__,
    }, indent=2))


if __name__ == "__main__":
    main()
