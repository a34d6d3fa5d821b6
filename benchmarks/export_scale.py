"""Export at real sizes: kiln beside the ONNX Runtime GenAI builder and Optimum, same run, same checkpoints.

Writes random-initialised Hugging Face checkpoints of real shapes (bf16, sharded safetensors
with an index, a tokenizer beside them: what a user downloads), then runs, one after another in
child processes, on each checkpoint and precision:

- ``kiln export --json`` (its per-stage wall seconds come from the JSON),
- the GenAI builder (``python -m onnxruntime_genai.models.builder -e cpu``, peers' venv),
- Optimum (``optimum-cli export onnx --task text-generation-with-past``, or
  ``text2text-generation-with-past`` for an encoder-decoder; fp32 only: Optimum's fp16 export
  needs ``--device cuda``),

and reports each child's wall time and peak RSS (its own rusage, as ``/usr/bin/time -v``
does). The page cache is warmed with the checkpoint before every run, so no tool pays the
first read from disk. It takes tens of minutes and GBs; run it by hand, not as a test:

    python benchmarks/export_scale.py --work /work/scale --out docs/benchmarks/export_scale.json \\
        --shape qwen2-0.5b --precision fp32 --precision fp16
    python benchmarks/export_scale.py --work /work/scale --shape qwen2-0.5b@6 --shape qwen2-0.5b@12 \\
        --shape qwen2-0.5b@24 --shape qwen2-0.5b@48 --precision fp32 --tools kiln

    python benchmarks/export_scale.py --work /work/scale --shape bart-base --tools kiln,optimum   # an encoder-decoder
    python benchmarks/export_scale.py --work /work/scale --shape llama-tiny --tools kiln,genai \\
        --precision fp32 --precision int4 --trace-cache cold    # then --trace-cache warm

A shape ``NAME@N`` is NAME with N layers (the depth sweep; of an encoder-decoder, the decoder's).
The peers' venvs: benchmarks/peers/README.md.
The GenAI builder has no BART: encoder-decoder shapes run kiln and Optimum only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchor_llama import write_tokenizer  # noqa: E402  (the benchmarks' one tokenizer recipe)

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SHAPES: dict[str, dict[str, Any]] = {
    # the shapes of the released models (hidden, layers, heads / KV heads, MLP width, vocab)
    "qwen2-0.5b": {
        **QWEN2,
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
    },
    "qwen2-1.5b": {
        **QWEN2,
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
    },
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "llama3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # a 2-layer Llama for the fixed costs (trace, sessions, parity) of a small export
    "llama-tiny": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 688,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "llama2-7b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "bart-base": {
        "architectures": ["BartForConditionalGeneration"],
        "model_type": "bart",
        "is_encoder_decoder": True,
        "d_model": 768,
        "encoder_layers": 6,
        "decoder_layers": 6,
        "encoder_attention_heads": 12,
        "decoder_attention_heads": 12,
        "encoder_ffn_dim": 3072,
        "decoder_ffn_dim": 3072,
        "vocab_size": 50265,
        "max_position_embeddings": 1024,
        "bos_token_id": 0,
        "pad_token_id": 1,
        "eos_token_id": 2,
        "decoder_start_token_id": 2,
    },
}
SHARD_BYTES = 500 * 2**20
CALIB_TEXT = (
    Path(__file__).resolve().parents[1] / "demo" / "checkpoint" / "heldout.txt"
)  # GPTQ's calibration text (the demo's held-out Python)
PEERS_VENV, GENAI_VENV = Path("/work/peers-venv"), Path("/work/peers-genai-venv")


def shape_config(shape: str) -> dict[str, Any]:
    name, _, layers = shape.partition("@")
    if name not in SHAPES:
        sys.exit(f"unknown shape {name!r}; known: {', '.join(SHAPES)} (NAME@LAYERS for another depth)")
    config = dict(SHAPES[name])
    if layers:
        config["decoder_layers" if config.get("is_encoder_decoder") else "num_hidden_layers"] = int(layers)
    return config


def write_checkpoint(directory: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """A random bf16 checkpoint of ``config``, written tensor by tensor into shards of at most
    SHARD_BYTES (memory stays at about one shard, whatever the model's size)."""
    if (directory / "model.safetensors.index.json").is_file():
        return directory
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    hf_config = transformers.AutoConfig.for_model(
        config["model_type"], **{k: v for k, v in config.items() if k != "model_type"}, dtype="bfloat16"
    )
    auto = transformers.AutoModelForSeq2SeqLM if config.get("is_encoder_decoder") else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(hf_config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied weights appear once
    shards = list(_shards(shapes))
    generator = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _random(name, shapes[name], generator) for name in names}
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        total += sum(t.nbytes for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    hf_config.save_pretrained(directory)
    write_tokenizer(directory, min(config["vocab_size"], 8000))
    return directory


def _shards(shapes: dict[str, tuple[int, ...]]) -> Iterator[list[str]]:
    shard: list[str] = []
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * math.prod(shape)
        if shard and size + nbytes > SHARD_BYTES:
            yield shard
            shard, size = [], 0
        shard.append(name)
        size += nbytes
    if shard:
        yield shard


def _random(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Hugging Face's own init: norms at one, biases at zero, the rest N(0, 0.02)."""
    if name.endswith("norm.weight") or (
        len(shape) == 1 and "norm" in name and name.endswith(".weight")
    ):  # BART's layernorm_embedding
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)


def _trace_cache_env(work: Path, trace_cache: str) -> dict[str, str]:
    """kiln's trace cache for a run, ``work/kiln-cache``: ``cold`` emptied first (the first export
    of an architecture; it fills the cache), ``warm`` as earlier runs left it (a re-export: run it
    after a cold run, with no change to kiln's code between), ``off`` none."""
    root = work / "kiln-cache"
    if trace_cache == "cold":
        subprocess.run(["rm", "-rf", str(root)], check=True)
    return {**os.environ, "KILN_CACHE": "off" if trace_cache == "off" else str(root)}


def measure(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Wall seconds and peak RSS of one child process (its own rusage, via wait4); its stdout
    in ``log``, its stderr beside it (``.err``)."""
    start = time.perf_counter()
    with log.open("wb") as out, log.with_suffix(".err").open("wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    row: dict[str, Any] = {
        "command": " ".join(cmd),
        "wall_s": round(wall, 1),
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "exit": code,
    }
    if code != 0:
        row["error"] = log.with_suffix(".err").read_text(errors="replace")[-1500:]
    return row


def warm(directory: Path) -> None:
    """Read the checkpoint once so every tool finds it in the page cache."""
    for file in directory.glob("*.safetensors"):
        with file.open("rb") as f:
            while f.read(64 * 2**20):
                pass


KILN_FLAGS = {  # kiln's flags per precision row (int4: for ONNX Runtime, as the GenAI builder's int4 is)
    "fp32": [],
    "fp16": ["--fp16"],
    "int4": ["--int4", "--target", "ort", "--calib-data", str(CALIB_TEXT)],  # GPTQ, the default method
    "int4-rtn": ["--int4", "--int4-method", "rtn", "--target", "ort"],
}


def commands(
    tool: str,
    ckpt: Path,
    out: Path,
    precision: str,
    parity_tokens: int | None,
    seq2seq: bool = False,
    agreement: str | None = None,
) -> list[str] | None:
    if tool == "kiln":
        tokens = (
            ["--parity-tokens", str(parity_tokens)] if parity_tokens is not None else []
        )  # None: kiln's default, as users run it
        gate = (
            ["--parity-agreement", agreement] if agreement is not None else []
        )  # record: a random model's int4 logits are near-ties
        return [
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
            *tokens,
            *gate,
            *KILN_FLAGS[precision],
        ]
    if (
        tool == "genai" and not seq2seq and precision != "int4-rtn"
    ):  # the builder's int4 is round to nearest: one row, "int4"
        return [
            str(GENAI_VENV / "bin/python"),
            "-m",
            "onnxruntime_genai.models.builder",
            "-i",
            str(ckpt),
            "-o",
            str(out),
            "-p",
            precision,
            "-e",
            "cpu",
            "-c",
            str(out) + ".cache",
        ]
    if tool == "optimum" and precision == "fp32":
        task = "text2text-generation-with-past" if seq2seq else "text-generation-with-past"
        return [str(PEERS_VENV / "bin/optimum-cli"), "export", "onnx", "--model", str(ckpt), "--task", task, str(out)]
    return None  # Optimum's fp16 export needs --device cuda


def run_one(
    tool: str,
    ckpt: Path,
    work: Path,
    shape: str,
    precision: str,
    parity_tokens: int | None,
    trace_cache: str,
    agreement: str | None = None,
) -> dict[str, Any] | None:
    out = work / "out" / f"{shape}-{precision}-{tool}"
    cmd = commands(
        tool,
        ckpt,
        out,
        precision,
        parity_tokens,
        seq2seq=SHAPES[shape.partition("@")[0]].get("is_encoder_decoder", False),
        agreement=agreement,
    )
    if cmd is None:
        return None
    subprocess.run(["rm", "-rf", str(out), str(out) + ".cache"], check=True)
    warm(ckpt)
    load = os.getloadavg()[0]
    env = _trace_cache_env(work, trace_cache) if tool == "kiln" else None
    row = measure(cmd, work / "logs" / f"{shape}-{precision}-{tool}.log", env)
    row["load_average_before"] = round(load, 2)  # on a shared machine: how loaded it was
    if tool == "kiln":
        row["trace_cache"] = trace_cache
    if tool == "kiln" and row["exit"] == 0:
        stages = json.loads((work / "logs" / f"{shape}-{precision}-{tool}.log").read_text())["stages"]
        row["stages_s"] = stages
        row["wall_excluding_parity_s"] = round(
            row["wall_s"] - sum(v for k, v in stages.items() if k.startswith("parity")), 1
        )
        row["graph_building_s"] = round(
            sum(v for k, v in stages.items() if k == "trace" or k.endswith("graph passes")), 1
        )
    if row["exit"] == 0:
        row["output_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    subprocess.run(["rm", "-rf", str(out), str(out) + ".cache"], check=True)  # the next run's disk and page cache
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/work/scale"))
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        help=f"{', '.join(SHAPES)}, or NAME@LAYERS (repeatable; default qwen2-0.5b)",
    )
    parser.add_argument(
        "--precision",
        action="append",
        choices=list(KILN_FLAGS),
        default=[],
        help="repeatable; default fp32 (int4: kiln --int4 --target ort, GPTQ; int4-rtn: kiln's round to nearest; the "
        "builder's int4 once)",
    )
    parser.add_argument("--tools", default="kiln,genai,optimum", help="comma-separated: kiln, genai, optimum")
    parser.add_argument(
        "--parity-tokens",
        type=int,
        default=None,
        help="kiln's --parity-tokens (default: kiln's own default, as users run it)",
    )
    parser.add_argument(
        "--parity-agreement",
        choices=["gate", "record"],
        default=None,
        help="kiln's --parity-agreement (default: kiln's own, gate)",
    )
    parser.add_argument(
        "--trace-cache",
        choices=["cold", "warm", "off"],
        default="cold",
        help="kiln's trace cache: empty before each run, kept across runs, or off",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the results here (JSON)")
    args = parser.parse_args()
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    results = []
    for shape in args.shape or ["qwen2-0.5b"]:
        config = shape_config(shape)
        ckpt = write_checkpoint(args.work / "ckpt" / shape, config)
        size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        for precision in args.precision or ["fp32"]:
            for tool in args.tools.split(","):
                row = run_one(
                    tool, ckpt, args.work, shape, precision, args.parity_tokens, args.trace_cache, args.parity_agreement
                )
                if row is None:
                    continue
                row.update(
                    shape=shape,
                    layers=config.get("num_hidden_layers", config.get("decoder_layers")),
                    precision=precision,
                    tool=tool,
                    checkpoint_bytes=size,
                    peak_rss_over_checkpoint=round(row["peak_rss_bytes"] / size, 2),
                )
                results.append(row)
                print(
                    json.dumps({k: row[k] for k in ("shape", "precision", "tool", "wall_s", "peak_rss_bytes", "exit")}),
                    flush=True,
                )
    report = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average": os.getloadavg()},
        "torch": torch.__version__,
        "results": results,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
