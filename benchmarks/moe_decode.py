"""Decode-step (and prefill) latency of a mixture-of-experts model's graphs: the portable graph
(transformers' expert kernel as one Slice+MatMul per expert), the ``--target ort`` graph with
ONNX Runtime's ``MoE`` op, and the same ``--target ort`` rewrite without the MoE pass (GQA, norms
and packing only), so the MoE op's own share is measured apart from the rest of the rewrite.

    python benchmarks/moe_decode.py --out /tmp/moe-bench            # a random 62M Mixtral shape
    python benchmarks/moe_decode.py --out /tmp/moe-bench --reuse    # measure an earlier export again

The checkpoint is a randomly initialised ``MixtralForCausalLM`` (transformers, seed 0) saved as
safetensors, exported by kiln with ``--target ort`` (its parity gate included); ONNX Runtime's
CPU provider, ``--threads`` intra-op threads, no spinning, batch 1, the graphs interleaved
(``runtime.bench.interleaved``), medians. Results as JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np


def _checkpoint(args: argparse.Namespace, directory: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=args.max_context,
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32
    ).eval()  # public: MixtralForCausalLM for a MixtralConfig
    model.save_pretrained(directory, safe_serialization=True)


def _without_moe(onnx_dir: Path, target: Path, ckpt: Path, max_context: int) -> Path:
    """The ``--target ort`` prefill and decode graphs rewritten again with the MoE pass switched
    off, in their own directory (copies of the portable graphs and their weights); returns it."""
    import kiln.exporter.targets.ort.graphs as ort_target
    from kiln.exporter.contract.io import GraphKind
    from kiln.exporter.targets.ort.moe import MoeRewrite
    from kiln.plugins import load_model

    target.mkdir(parents=True, exist_ok=True)
    for name in ("prefill.onnx", "decode.onnx"):
        shutil.copy(onnx_dir / name, target / name)
    shutil.copy(
        onnx_dir / "weights.bin", target / "weights.bin"
    )  # ONNX Runtime 1.32 refuses external data through a symlink or a hard link
    spec = load_model(ckpt).spec

    def no_moe(model: Any) -> MoeRewrite:
        return MoeRewrite(layers=(), not_fused=("switched off by benchmarks/moe_decode.py",))

    saved = ort_target.fuse_moe
    ort_target.fuse_moe = no_moe  # type: ignore[assignment]  # the benchmark's own variant
    try:
        graphs = {kind: target / f"{kind.value}.onnx" for kind in (GraphKind.PREFILL, GraphKind.DECODE)}
        ort_target.write_ort_target(target, graphs, spec, max_context=max_context, int8=False)
    finally:
        ort_target.fuse_moe = saved  # type: ignore[assignment]
    return target


def _feeds(session: Any, batch: int, seq: int, past: int, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    for value in session.get_inputs():
        if value.name == "input_ids":
            feeds[value.name] = rng.integers(3, vocab, size=(batch, seq), dtype=np.int64)
        elif value.name == "attention_mask":
            feeds[value.name] = np.ones((batch, past + seq), dtype=np.int64)
        elif value.name == "position_ids":
            feeds[value.name] = np.arange(past, past + seq, dtype=np.int64)[None].repeat(batch, 0)
        elif value.name.startswith("past_key_values."):
            _, kv, _, hd = value.shape
            feeds[value.name] = rng.standard_normal((batch, kv, past, hd)).astype(np.float32)
    return feeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reuse", action="store_true", help="measure the export already in --out")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024, help="per expert")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--past", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--runs", type=int, default=200, help="decode steps per graph (prefills: a fifth)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from kiln.exporter.options import ExportOptions
    from kiln.exporter.pipeline import export
    from kiln.exporter.runners.ort_runner import ort_session
    from kiln.runtime.timing import interleaved

    ckpt, out = args.out / "ckpt", args.out / "export"
    export_s = None
    if not args.reuse:
        shutil.rmtree(args.out, ignore_errors=True)
        _checkpoint(args, ckpt)
        start = time.perf_counter()
        result = export(ckpt, out, ExportOptions.from_flags(max_batch=1, parity_tokens=8, target="ort"))
        export_s = time.perf_counter() - start
        if not result.parity.passed:
            raise SystemExit(f"parity failed: {result.parity.failures()}")
    onnx_dir = out / "onnx"
    no_moe = _without_moe(onnx_dir, args.out / "ort-without-moe", ckpt, args.max_context)
    names = {
        "portable (Slice+MatMul per expert)": (onnx_dir, ""),
        "--target ort, MoE op": (onnx_dir, ".ort"),
        "--target ort without the MoE pass": (no_moe, ".ort"),
    }
    decode = {name: d / f"decode{suffix}.onnx" for name, (d, suffix) in names.items()}
    prefill = {name: d / f"prefill{suffix}.onnx" for name, (d, suffix) in names.items()}
    report: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "export_s": export_s,
        "load_average": os.getloadavg(),
    }
    for label, graphs, seq, past in (("decode_ms", decode, 1, args.past), ("prefill_ms", prefill, args.prompt, 0)):
        sessions = {name: ort_session(path, threads=args.threads, spinning=False) for name, path in graphs.items()}
        calls = {}
        for name, session in sessions.items():
            feeds = _feeds(session, 1, seq, past, args.vocab)
            calls[name] = lambda s=session, f=feeds: s.run(["logits"], f)
        outputs = {
            name: session.run(["logits"], _feeds(session, 1, seq, past, args.vocab))[0]
            for name, session in sessions.items()
        }
        first = next(iter(outputs.values()))
        report[label.replace("_ms", "_max_abs_vs_portable")] = {
            name: float(np.abs(o - first).max()) for name, o in outputs.items()
        }
        report[label] = interleaved(calls, args.runs if seq == 1 else max(args.runs // 5, 10), pause=0.0, warmup=3)
    import onnx

    report["decode_nodes"] = {
        name: len(onnx.load(path, load_external_data=False).graph.node) for name, path in decode.items()
    }
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
