"""Export wall time and peak memory (RSS) for a large model, kiln beside a peer exporter.

Builds a randomly initialised checkpoint of about 340M parameters (fp32 safetensors, ~1.4 GB):
the native family, or (``--family hf``) a Hugging Face LlamaForCausalLM of the same shape, which
other exporters can read too. Runs ``kiln export`` on it in a child process and reports that
child's peak RSS divided by the checkpoint's size; every ``--peer 'CMD {ckpt} {out}'`` is run and
measured the same way (e.g. Optimum from its own virtual environment). Run it by hand (it takes
minutes and GBs; it is not a test):

    python benchmarks/export_memory.py --work /tmp/kiln-bench [--layers 24 --d-model 1024]
    python benchmarks/export_memory.py --family hf --work /tmp/kiln-bench-hf \
        --peer '/work/peers-venv/bin/optimum-cli export onnx --model {ckpt} --task text-generation-with-past {out}'
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_model

from kiln.plugins.native.build import random_model
from kiln.plugins.native.config import NativeConfig, PLEConfig
from kiln.plugins.native.model import PLEDecoder


def _shape(d_model: int) -> tuple[int, int, int]:
    """Heads (head_dim 64), KV heads (GQA 2:1) and MLP width of both families' benchmark model."""
    return d_model // 64, d_model // 128, int(d_model * 2.75)


def make_checkpoint(directory: Path, layers: int, d_model: int, vocab: int) -> tuple[Path, int]:
    heads, kv_heads, d_ff = _shape(d_model)
    cfg = NativeConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        d_ff=d_ff,
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


def make_hf_checkpoint(directory: Path, layers: int, d_model: int, vocab: int) -> tuple[Path, int]:
    """A random Hugging Face Llama of the native benchmark model's shape."""
    import transformers

    if not (directory / "model.safetensors").is_file():
        heads, kv_heads, d_ff = _shape(d_model)
        cfg = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=d_model,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            intermediate_size=d_ff,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).eval()
        model.save_pretrained(directory, safe_serialization=True)
        del model
    from safetensors import safe_open

    params = 0
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            params += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return directory, params


def measure(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS in bytes of one child process (its own rusage, via wait4)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        assert proc.stderr is not None
        sys.exit(f"{cmd[0]} failed ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_maxrss * 1024  # Linux: KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/kiln-bench"))
    parser.add_argument("--family", choices=["native", "hf"], default="native")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--parity-tokens", type=int, default=8)
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="CMD",
        help="another exporter's command line with {ckpt} and {out}",
    )
    args = parser.parse_args()

    make = make_hf_checkpoint if args.family == "hf" else make_checkpoint
    ckpt, params = make(args.work / "ckpt", args.layers, args.d_model, args.vocab)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    rows = {}
    out = args.work / "out"
    kiln = [
        sys.executable,
        "-m",
        "kiln.cli",
        "export",
        "--model",
        str(ckpt),
        "--out",
        str(out),
        "--force",
        "--json",
        "--max-batch",
        "2",
        "--parity-tokens",
        str(args.parity_tokens),
    ]
    peers = [
        (f"peer {i + 1}", shlex.split(p.format(ckpt=ckpt, out=args.work / f"peer{i + 1}")))
        for i, p in enumerate(args.peer)
    ]
    for name, cmd in [("kiln", kiln), *peers]:
        wall, peak = measure(cmd)
        rows[name] = {
            "command": " ".join(cmd),
            "export_wall_s": round(wall, 1),
            "peak_rss_bytes": peak,
            "peak_rss_over_checkpoint": round(peak / size, 2),
        }
    print(
        json.dumps(
            {
                "family": args.family,
                "parameters": params,
                "checkpoint_bytes": size,
                "exports": rows,
                "torch": torch.__version__,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
