"""Issue 26's measurements: what swappable LoRA slots cost, and how long an adapter switch takes.

1. The 33M anchor Llama (``anchor_llama.py``) and a rank-16 adapter on q/k/v/o and the MLP
   (random lora_A/lora_B, written in PEFT's layout) exported three ways: plain, merged
   (``--adapter``) and with slots (``--lora-slots 16``, the adapter converted by ``kiln
   adapter``, its parity against PEFT included). One ``kiln bench`` run times them interleaved:
   the plain export, the merged one, the slots at rank 0 and the slots with the adapter bound.
   Targets: slots + adapter <= 1.15x the merged decode step; slots at rank 0 <= 1.05x the plain.
2. With ``--switch-shape`` (default ``llama3.2-1b``: hidden 2048, 16 layers, 32/8 heads, MLP
   8192, vocab 128256, tied): a random bf16 checkpoint of that shape exported ``--fp16
   --lora-slots 16`` and a rank-16 adapter on every projection converted with ``--no-check``
   (PEFT's parity on a 1B model is the slow part, and is not what is timed). The switch is what
   ``kiln generate --adapter`` does before its first step: read and check the adapter file
   (``read_adapter_file``), make its OrtValues, bind them to the prefill and decode IOBindings.

    python benchmarks/lora_swap.py --work /work/lora-bench --out lora.json

Every kiln command runs as a user runs it (a child process, default options except where named);
``--parity-tokens 16`` on the 33M exports and 8 on the 1B one (export time is not measured here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchor_llama import write_anchor  # noqa: E402
from export_scale import shape_config, write_checkpoint  # noqa: E402

MODULES = {"self_attn": ["q_proj", "k_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"]}


def write_adapter(directory: Path, config: dict[str, Any], rank: int, seed: int = 0) -> Path:
    """A PEFT LoRA adapter directory of a Llama ``config`` (rank ``rank``, alpha 2 * rank), on
    every attention and MLP projection, lora_A/lora_B ~ N(0, 0.02) as training would leave them."""
    directory.mkdir(parents=True, exist_ok=True)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
    sizes = {
        "q_proj": (hidden, hidden),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (hidden, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # (in, out)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for block, names in MODULES.items():
            for name in names:
                inp, out = sizes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=generator) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.02
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    targets = [n for names in MODULES.values() for n in names]
    (directory / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": targets,
                "base_model_name_or_path": "",
                "bias": "none",
            },
            indent=2,
        )
    )
    return directory


def kiln(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "kiln.cli", *args], check=True)


def cost(work: Path, runs: int) -> dict[str, Any]:
    """Part 1: one interleaved kiln bench of the plain, merged and slotted exports."""
    ckpt = write_anchor(work / "anchor")
    config = json.loads((ckpt / "config.json").read_text())
    adapter = write_adapter(work / "adapter16", config, 16)
    outs = {name: work / name for name in ("plain", "merged", "slots")}
    flags = {"plain": [], "merged": ["--adapter", str(adapter)], "slots": ["--lora-slots", "16"]}
    for name, out in outs.items():
        if not (out / "manifest.json").is_file():
            kiln("export", "--model", str(ckpt), "--out", str(out), "--parity-tokens", "16", *flags[name])
    file = work / "adapter16.onnx_adapter"
    if not file.is_file():
        kiln("adapter", str(adapter), "--export", str(outs["slots"]), "--out", str(file))
    result_file = work / "bench.json"
    kiln(
        "bench",
        *(str(outs[n]) for n in ("plain", "merged", "slots")),
        "--adapter",
        str(file),
        "--runs",
        str(runs),
        "--no-torch",
        "--out",
        str(result_file),
    )
    result: dict[str, Any] = json.loads(result_file.read_text())
    return result


def ratios(bench: dict[str, Any]) -> dict[str, float]:
    rows = bench["median_ms"]
    labels = [d["label"] for d in bench["directories"]]
    plain, merged, rank0, active = labels
    return {
        f"{kind} slots+adapter / merged": rows[kind][active] / rows[kind][merged] for kind in ("prefill", "decode")
    } | {f"{kind} slots rank 0 / plain": rows[kind][rank0] / rows[kind][plain] for kind in ("prefill", "decode")}


def switch(work: Path, shape: str, repeats: int) -> dict[str, Any]:
    """Part 2: an adapter switch on an export of ``shape`` (load + check + bind), timed in-process."""
    import onnxruntime as ort

    from kiln.exporter.artifacts.manifest import read
    from kiln.exporter.contract.io import GraphKind
    from kiln.exporter.lora.adapter_file import read_adapter_file
    from kiln.exporter.runners import ort_session

    config = shape_config(shape)
    ckpt = write_checkpoint(work / shape, config)
    out = work / f"{shape}-slots"
    if not (out / "manifest.json").is_file():
        kiln("export", "--model", str(ckpt), "--out", str(out), "--fp16", "--lora-slots", "16", "--parity-tokens", "8")
    adapter = write_adapter(work / f"{shape}-adapter16", config, 16)
    file = work / f"{shape}-adapter16.onnx_adapter"
    if not file.is_file():
        kiln("adapter", str(adapter), "--export", str(out), "--out", str(file), "--no-check")
    manifest = read(out)
    sessions = [
        ort_session(out / manifest.graph(k).file, spinning=False) for k in (GraphKind.PREFILL, GraphKind.DECODE)
    ]
    bindings = [s.io_binding() for s in sessions]
    loads, binds = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        values = {
            n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in read_adapter_file(file, manifest.lora, "bench").items()
        }
        loaded = time.perf_counter()
        for binding in bindings:
            for name, value in values.items():
                binding.bind_ortvalue_input(name, value)
        binds.append(time.perf_counter() - loaded)
        loads.append(loaded - start)
    return {
        "shape": shape,
        "adapter_bytes": file.stat().st_size,
        "slots": len(manifest.lora.slots) if manifest.lora else 0,
        "repeats": repeats,
        "load_ms_median": statistics.median(loads) * 1e3,
        "bind_ms_median": statistics.median(binds) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--switch-shape", default="llama3.2-1b", help="the shape of the switch timing ('none' to skip)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    bench = cost(args.work, args.runs)
    result: dict[str, Any] = {"bench": bench, "ratios": ratios(bench)}
    if args.switch_shape != "none":
        result["switch"] = switch(args.work, args.switch_shape, args.repeats)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {"ratios": result["ratios"], "switch": result.get("switch"), "load_average": bench["load_average"]},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
