"""Accuracy of an export's graphs on held-out text, against the PyTorch model in fp32.

For each 256-token window of the demo's held-out text (stdlib files never trained on), runs
``model.onnx`` (empty past) on ONNX Runtime and the PyTorch model, and reports per-token
perplexity of each, top-1 next-token agreement with PyTorch, and, for free-running greedy
generation from prompts cut from the text, how many tokens match PyTorch's before the first
difference. Run by hand:

    python benchmarks/accuracy.py build/demo build/demo16 [--windows 32]
    python benchmarks/accuracy.py build/demo-ort8 --target ort     # the --target ort graphs
    python benchmarks/accuracy.py --model CKPT build/x ...    # another checkpoint with heldout.txt + tokenizer.json
    python benchmarks/accuracy.py --model CKPT GENAI_DIR ...  # an ONNX Runtime GenAI builder output (genai_config.json)

A GenAI builder directory (of a Hugging Face copy of the same checkpoint:
``benchmarks/native_to_hf.py``) is measured the same way: its ``model.onnx`` fed the same token ids
(full prefill with an empty past for the windows; prefill then one token at a time, the present
fed back as the past, for greedy), whatever ``--target`` says.

Portable graphs run with ``weight_only_dq`` (``kiln.exporter.runners.ort_session``): an int4
or int8 weight DequantizeLinear is computed weight-only, as TensorRT does, not with the int8
activations ONNX Runtime's fused default would use.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from kiln.exporter.artifacts.manifest import Manifest
from kiln.exporter.artifacts.manifest import read as read_manifest
from kiln.exporter.contract.io import GraphKind, past_names
from kiln.exporter.parity import greedy
from kiln.exporter.runners import OrtRunner, TorchRunner
from kiln.exporter.runners.ort_runner import ort_session
from kiln.plugins import load_model, resolve_checkpoint
from kiln.plugins.base import DecoderSpec


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


class GenAIModel:
    """An ONNX Runtime GenAI builder's ``model.onnx`` run directly on ONNX Runtime: token ids in,
    logits out, the KV cache (``past_key_values.N.key``/``present.N.key``, BNSH) carried by the
    caller, grown each step (past and present not shared: any past length the graph accepts)."""

    def __init__(self, directory: Path) -> None:
        config = json.loads((directory / "genai_config.json").read_text())["model"]["decoder"]
        self.layers, self.kv_heads, self.head = (
            config["num_hidden_layers"],
            config["num_key_value_heads"],
            config["head_size"],
        )
        self.names = config["inputs"], config["outputs"]
        self.session = ort_session(directory / config["filename"])
        self.types = {i.name: i.type for i in self.session.get_inputs()}

    def _past(self, layer: int) -> tuple[str, str]:
        return self.names[0]["past_key_names"] % layer, self.names[0]["past_value_names"] % layer

    def run(self, ids: np.ndarray, past: list[np.ndarray] | None) -> tuple[np.ndarray, list[np.ndarray]]:
        """Logits ``[1, S, vocab]`` and the presents of token ids ``[1, S]`` after ``past``."""
        dtype = np.float16 if "float16" in self.types[self._past(0)[0]] else np.float32
        if past is None:
            past = [np.zeros((1, self.kv_heads, 0, self.head), dtype=dtype)] * (2 * self.layers)
        total = past[0].shape[2] + ids.shape[1]
        feeds: dict[str, np.ndarray] = {
            self.names[0]["input_ids"]: ids.astype(np.int64),
            self.names[0]["attention_mask"]: np.ones((1, total), dtype=np.int64),
        }
        if "position_ids" in self.names[0]:
            feeds[self.names[0]["position_ids"]] = np.arange(total - ids.shape[1], total, dtype=np.int64)[None]
        for layer in range(self.layers):
            key, value = self._past(layer)
            feeds[key], feeds[value] = past[2 * layer], past[2 * layer + 1]
        outputs = [self.names[1]["logits"]] + [
            self.names[1][f"present_{kind}_names"] % layer for layer in range(self.layers) for kind in ("key", "value")
        ]
        got = self.session.run(outputs, feeds)
        return got[0].astype(np.float32), got[1:]

    def greedy(self, prompt: list[int], steps: int) -> np.ndarray:
        logits, past = self.run(np.array([prompt], dtype=np.int64), None)
        tokens = []
        for step in range(steps):
            tokens.append(int(logits[0, -1].argmax()))
            if step + 1 < steps:
                logits, past = self.run(np.array([[tokens[-1]]], dtype=np.int64), past)
        return np.array(tokens, dtype=np.int64)


def graph_file(directory: Path, manifest: Manifest, kind: GraphKind, target: str | None) -> Path:
    """The portable graph of ``kind``, or the ``--target`` one (manifest ``targets``)."""
    entry = manifest.graph(kind) if target is None else (manifest.targets or {})[target].graphs[kind.value]
    return directory / entry.file


WIN = 256  # tokens per evaluated window


def _match_length(got: np.ndarray, want: np.ndarray) -> int:
    """Greedy tokens equal before the first difference (64: all of them)."""
    diff = np.nonzero(got != want)[0]
    return int(diff[0]) if diff.size else 64


def _scores(
    logits_per_window: Iterable[np.ndarray], windows: list[np.ndarray], ref_logits: list[np.ndarray]
) -> dict[str, float]:
    """Perplexity of the windows' next tokens and top-1 agreement with the reference logits."""
    nll, agree, count = 0.0, 0, 0
    for logits, w, ref in zip(logits_per_window, windows, ref_logits, strict=True):
        lp = _log_softmax(logits[0, :-1])
        nll -= lp[np.arange(WIN - 1), w[0, 1:]].sum()
        agree += int((logits[0].argmax(-1) == ref[0].argmax(-1)).sum())
        count += WIN - 1
    return {"perplexity": float(np.exp(nll / count)), "top1_agreement": agree / (count + len(windows))}


def _measure_genai(
    directory: Path,
    windows: list[np.ndarray],
    ref_logits: list[np.ndarray],
    prompts: list[list[int]],
    ref_tokens: list[np.ndarray],
) -> dict[str, Any]:
    genai = GenAIModel(directory)
    row: dict[str, Any] = _scores((genai.run(w, None)[0] for w in windows), windows, ref_logits)
    row["greedy_match_length"] = [
        _match_length(genai.greedy(p, 64), want) for p, want in zip(prompts, ref_tokens, strict=True)
    ]
    return row


def _measure_kiln(
    directory: Path,
    spec: DecoderSpec,
    target: str | None,
    windows: list[np.ndarray],
    ref_logits: list[np.ndarray],
    prompts: list[list[int]],
    ref_tokens: list[np.ndarray],
) -> dict[str, Any]:
    manifest = read_manifest(directory)
    kv = manifest.kv_cache.dtype
    session = ort_session(graph_file(directory, manifest, GraphKind.UNIFIED, target), weight_only_dq=True)
    empty = np.zeros((1, spec.n_kv_heads, 0, spec.head_dim), dtype=kv)
    past = {n: empty for i in range(spec.n_layers) for n in past_names(i)}

    def logits_of(w: np.ndarray) -> np.ndarray:
        feeds = {
            "input_ids": w,
            "attention_mask": np.ones_like(w),
            "position_ids": np.arange(WIN, dtype=np.int64)[None],
            **past,
        }
        return np.asarray(session.run(["logits"], feeds)[0])

    row: dict[str, Any] = _scores((logits_of(w) for w in windows), windows, ref_logits)
    graphs = {k: graph_file(directory, manifest, k, target) for k in (GraphKind.PREFILL, GraphKind.DECODE)}
    with OrtRunner(graphs) as runner:
        row["greedy_match_length"] = [
            _match_length(greedy(runner, spec, [p], 64, kv_dtype=np.dtype(kv))[0][0], want)
            for p, want in zip(prompts, ref_tokens, strict=True)
        ]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument(
        "--target",
        choices=["ort"],
        default=None,
        help="measure the export's --target ort graphs instead of the portable ones",
    )
    parser.add_argument(
        "--model",
        default="demo",
        help="the checkpoint (with heldout.txt and tokenizer.json) the exports were made from",
    )
    args = parser.parse_args()

    ckpt = resolve_checkpoint(args.model)
    loaded = load_model(args.model)
    spec = loaded.spec
    ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode((ckpt / "heldout.txt").read_text()).ids
    # from the END of heldout.txt: int8 exports calibrate on its beginning (kiln takes the first windows)
    tail = ids[len(ids) - args.windows * WIN :]
    windows = [np.array(tail[i * WIN : (i + 1) * WIN], dtype=np.int64)[None] for i in range(args.windows)]
    torch_runner = TorchRunner(loaded.module, spec.n_layers)
    prompts = [tail[700 * k : 700 * k + 32] for k in range(args.prompts)]
    ref_tokens = [greedy(torch_runner, spec, [p], 64)[0][0] for p in prompts]
    with torch.no_grad():
        ref_logits = [
            loaded.module(torch.from_numpy(w), torch.ones_like(torch.from_numpy(w)), torch.arange(WIN)[None])[0].numpy()
            for w in windows
        ]

    rows: dict[str, dict[str, Any]] = {"pytorch fp32": _scores(ref_logits, windows, ref_logits)}
    for d in args.dirs:
        if (d / "genai_config.json").is_file():
            rows[str(d)] = _measure_genai(d, windows, ref_logits, prompts, ref_tokens)
        else:
            rows[str(d)] = _measure_kiln(d, spec, args.target, windows, ref_logits, prompts, ref_tokens)
    base = rows["pytorch fp32"]["perplexity"]
    for row in rows.values():
        row["perplexity_change_pct"] = 100 * (row["perplexity"] / base - 1)
    print(
        json.dumps(
            {"windows": args.windows, "tokens_per_window": WIN, "target": args.target or "portable", "rows": rows},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
