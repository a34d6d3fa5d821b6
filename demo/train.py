"""Train the bundled demo checkpoint: a small PLE decoder on the Python standard library.

The corpus is text every machine with Python has offline: the standard library's own ``.py``
files (``sysconfig.get_paths()["stdlib"]``; site-packages and test directories are skipped,
files are taken in sorted path order up to a byte cap). The split is by file: every
``HELDOUT_EVERY``-th file is held out and never trained on. A prefix of the held-out text is
written to ``heldout.txt`` for calibration and accuracy reports.

Steps, all deterministic for a given seed, Python build and library versions:

1. a byte-level BPE tokenizer (``tokenizers``; vocab 1024; ``<|endoftext|>`` = 0 is bos and
   eos, ``<|pad|>`` = 1) trained on the train split, saved as ``tokenizer.json``;
2. a :class:`~kiln.plugins.native.model.PLEDecoder` trained on random windows of the train
   token stream (files joined by ``<|endoftext|>``) with AdamW and a cosine schedule, on the CPU;
   the PLE tables get a larger learning rate and no weight decay so that they move clearly
   away from their identity initialisation;
3. held-out perplexity on the first ``EVAL_WINDOWS`` windows of ``heldout.txt``;
4. ``config.json``, ``model.safetensors`` (fp32; the tied LM head is stored once, as
   ``embed.weight``) and ``training.json`` (the facts of the run).

Usage::

    python -m kiln.demo.train --out demo/checkpoint [--steps N] [--seed S]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import safetensors
import tokenizers
import torch
import torch.nn.functional as F
from safetensors.torch import save_model
from tokenizers import Tokenizer
from torch import Tensor, nn

from kiln.demo.corpus import (
    CORPUS_CAP_BYTES,
    HELDOUT_EVERY,
    MAX_FILE_BYTES,
    SEQ_LEN,
    SKIP_DIRS,
    VOCAB_SIZE,
    Corpus,
    Data,
    prepare_data,
)
from kiln.plugins.native.config import (
    MLPKind,
    NativeConfig,
    NormKind,
    NormPosition,
    PLEConfig,
    PLEPlacement,
    PositionKind,
)
from kiln.plugins.native.model import DecoderLayer, PLEDecoder

__all__ = ["demo_config", "llama_config", "train", "main"]

EVAL_WINDOWS = 64
EVAL_BATCH = 16
NUM_THREADS = 2


def demo_config() -> NativeConfig:
    """The demo model: about 1.1 M parameters, 4.4 MB of fp32 weights."""
    return NativeConfig(
        vocab_size=VOCAB_SIZE,
        d_model=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        d_ff=320,
        mlp=MLPKind.SWIGLU,
        norm=NormKind.RMSNORM,
        norm_position=NormPosition.PRE,
        position=PositionKind.ROPE,
        ple=PLEConfig(
            enabled=True,
            max_positions=SEQ_LEN,
            placement=PLEPlacement.RESIDUAL,
            bounded=False,
            projection=False,
        ),
        tie_embeddings=True,
        bias=False,
        max_context=SEQ_LEN,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    )


def llama_config(d_model: int = 384, n_layers: int = 8, d_ff: int = 1280) -> NativeConfig:
    """A Llama-architecture model for the low-bit accuracy study (``benchmarks/lowbit_study.py``):
    pre-RMSNorm, SwiGLU, RoPE, GQA (head_dim 64, a third of the heads for keys/values), no PLE,
    no bias, tied head; at the defaults 15.3 M parameters."""
    heads = max(1, d_model // 64)
    return dataclasses.replace(
        demo_config(),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=max(1, heads // 3),
        d_ff=d_ff,
        ple=PLEConfig(enabled=False, max_positions=SEQ_LEN),
    )


def init_weights(model: PLEDecoder) -> None:
    """GPT-2 style: N(0, 0.02) for embeddings and projections, residual outputs scaled by
    1/sqrt(2 * n_layers); norms stay at one and the PLE tables at zero (the identity)."""
    residual_std = 0.02 / math.sqrt(2 * model.cfg.n_layers)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not model.lm_head:
            std = residual_std if name.endswith(("o_proj", "fc2")) else 0.02
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    nn.init.normal_(model.embed.weight, std=0.02)


def param_groups(model: PLEDecoder, lr: float, ple_lr_mult: float, weight_decay: float) -> list[dict[str, Any]]:
    """Matrices decay; norms don't; PLE tables get ``ple_lr_mult`` times the LR and no decay."""
    decay, no_decay, ple = [], [], []
    for name, p in model.named_parameters():  # a tied parameter is listed once
        if ".ple.ple." in name:
            ple.append(p)
        elif p.ndim >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "lr_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "lr_mult": 1.0},
        {"params": ple, "weight_decay": 0.0, "lr_mult": ple_lr_mult},
    ]


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def lm_loss(model: PLEDecoder, windows: Tensor) -> Tensor:
    """Mean next-token cross-entropy over ``windows`` ``[B, S + 1]``."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    batch, seq = inputs.shape
    mask = torch.ones(batch, seq, dtype=torch.int64)
    positions = torch.arange(seq, dtype=torch.int64).expand(batch, seq)
    logits, _ = model(inputs, mask, positions)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def heldout_perplexity(model: PLEDecoder, ids: Tensor, windows: int = EVAL_WINDOWS) -> tuple[float, int]:
    """Per-token perplexity over the first ``windows`` non-overlapping windows of ``ids``."""
    n = min(windows, (len(ids) - 1) // SEQ_LEN)
    if n == 0:
        raise SystemExit("held-out text is too short for one evaluation window")
    chunks = torch.stack([ids[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1] for i in range(n)])
    model.eval()
    total = 0.0
    for start in range(0, n, EVAL_BATCH):
        batch = chunks[start : start + EVAL_BATCH]
        total += float(lm_loss(model, batch)) * batch.shape[0]
    model.train()
    return math.exp(total / n), n * SEQ_LEN


def ple_stats(model: PLEDecoder) -> list[dict[str, float]]:
    """Per layer, max |a| and max |b| of the PLE table (scale and shift halves)."""
    out = []
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        if layer.ple is None:  # --arch llama: no PLE
            continue
        table = layer.ple.ple.table.weight.detach()
        a, b = table[:, : model.cfg.d_model], table[:, model.cfg.d_model :]
        out.append(
            {
                "max_abs_a": float(a.abs().max()),
                "max_abs_b": float(b.abs().max()),
                "rms_a": float(a.pow(2).mean().sqrt()),
                "rms_b": float(b.pow(2).mean().sqrt()),
            }
        )
    return out


@torch.no_grad()
def greedy(model: PLEDecoder, tok: Tokenizer, prompt: str, new_tokens: int) -> str:
    """Greedy continuation of ``prompt`` (with the KV cache), decoded to text."""
    model.eval()
    ids = tok.encode(prompt, add_special_tokens=False).ids
    x = torch.tensor([ids], dtype=torch.int64)
    past = None
    out = list(ids)
    for _ in range(new_tokens):
        if len(out) >= model.cfg.max_context:
            break
        total = len(out)
        seq = x.shape[1]
        mask = torch.ones(1, total, dtype=torch.int64)
        positions = torch.arange(total - seq, total, dtype=torch.int64)[None, :]
        logits, past = model(x, mask, positions, past, last_logits_only=True)
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        x = torch.tensor([[nxt]], dtype=torch.int64)
    model.train()
    return tok.decode(out)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kiln.demo.train", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "checkpoint", help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=1800, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16, help=f"windows of {SEQ_LEN} tokens per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--ple-lr-mult", type=float, default=3.0, help="PLE-table learning-rate multiplier")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument(
        "--arch",
        choices=["demo", "llama"],
        default="demo",
        help="demo: the bundled PLE decoder; llama: the accuracy study's Llama (llama_config)",
    )
    parser.add_argument("--d-model", type=int, default=384, help="--arch llama: width")
    parser.add_argument("--n-layers", type=int, default=8, help="--arch llama: depth")
    parser.add_argument("--d-ff", type=int, default=1280, help="--arch llama: SwiGLU width")
    return parser.parse_args(argv)


def train(model: PLEDecoder, train_ids: torch.Tensor, args: argparse.Namespace) -> tuple[list[float], float]:
    """AdamW over random windows of ``train_ids``; returns the loss of every step and the seconds taken."""
    groups = param_groups(model, args.lr, args.ple_lr_mult, args.weight_decay)
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(SEQ_LEN + 1)
    started = time.perf_counter()
    losses: list[float] = []
    model.train()
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr * group["lr_mult"]
        starts = torch.randint(0, len(train_ids) - SEQ_LEN - 1, (args.batch_size,), generator=gen)
        loss = lm_loss(model, train_ids[starts[:, None] + offsets])
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if (step + 1) % args.log_every == 0 or step == 0:
            elapsed = time.perf_counter() - started
            recent = sum(losses[-args.log_every :]) / len(losses[-args.log_every :])
            print(
                f"step {step + 1}/{args.steps} loss {recent:.4f} lr {lr:.2e} {elapsed / (step + 1):.3f} s/step "
                f"elapsed {elapsed:.0f} s",
                flush=True,
            )
    return losses, time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(NUM_THREADS)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data = prepare_data(out)
    cfg = demo_config() if args.arch == "demo" else llama_config(args.d_model, args.n_layers, args.d_ff)
    model = PLEDecoder(cfg)
    init_weights(model)
    print(
        f"model: {sum(p.numel() for p in model.parameters()):,} parameters; {args.steps} steps of "
        f"{args.batch_size}x{SEQ_LEN} tokens",
        flush=True,
    )
    losses, train_seconds = train(model, data.train_ids, args)
    ppl, eval_tokens = heldout_perplexity(model, data.eval_ids)
    stats = ple_stats(model)
    sample = greedy(model, data.tokenizer, "def ", 40)
    print(f"held-out perplexity {ppl:.3f} over {eval_tokens} tokens", flush=True)
    if stats:
        print(
            f"PLE max|a| {max(s['max_abs_a'] for s in stats):.4f} max|b| {max(s['max_abs_b'] for s in stats):.4f}",
            flush=True,
        )
    print(f"sample: {sample!r}", flush=True)
    cfg.save(out / "config.json")
    save_model(model, str(out / "model.safetensors"))
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600
    run = {
        "losses": losses,
        "train_seconds": train_seconds,
        "wall_seconds": time.perf_counter() - started,
        "ppl": ppl,
        "eval_tokens": eval_tokens,
    }
    facts = training_facts(args, model, data, run, stats, sample)
    (out / "training.json").write_text(json.dumps(facts, indent=2) + "\n")
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    print(f"wrote {out}: {sizes} total {sum(sizes.values()):,} B", flush=True)


def training_facts(
    args: argparse.Namespace,
    model: PLEDecoder,
    data: Data,
    run: dict[str, Any],
    stats: list[dict[str, Any]],
    sample: str,
) -> dict[str, Any]:
    """Every fact of the run, for training.json."""
    losses, corpus, tail = run["losses"], data.corpus, run["losses"][-50:]
    return {
        "command": "python -m kiln.demo.train "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "seed": args.seed,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": SEQ_LEN,
        "tokens_seen": args.steps * args.batch_size * SEQ_LEN,
        "optimizer": {
            "kind": "AdamW",
            "lr": args.lr,
            "betas": [0.9, 0.95],
            "weight_decay": args.weight_decay,
            "ple_lr_mult": args.ple_lr_mult,
            "ple_weight_decay": 0.0,
            "warmup": args.warmup,
            "schedule": "linear warm-up, cosine to 10%",
            "grad_clip": 1.0,
        },
        "train_loss_last50": sum(tail) / len(tail),
        "train_loss_first": losses[0],
        "train_seconds": round(run["train_seconds"], 1),
        "wall_seconds": round(run["wall_seconds"], 1),
        "param_count": sum(p.numel() for p in model.parameters()),
        "heldout_perplexity": run["ppl"],
        "heldout_eval": {
            "source": "heldout.txt",
            "windows": run["eval_tokens"] // SEQ_LEN,
            "window_tokens": SEQ_LEN,
            "tokens": run["eval_tokens"],
            "note": "first non-overlapping windows, no bos, positions 0..255",
        },
        "ple": {
            "max_abs_a": max(s["max_abs_a"] for s in stats),
            "max_abs_b": max(s["max_abs_b"] for s in stats),
            "layers": stats,
        }
        if stats
        else None,
        "corpus": {
            "source": "Python standard library .py files (sysconfig stdlib path), sorted, "
            f"skipping {sorted(SKIP_DIRS)} dirs, test_*.py and files > {MAX_FILE_BYTES} B",
            "python": platform.python_version(),
            "cap_bytes": CORPUS_CAP_BYTES,
            "heldout_every": HELDOUT_EVERY,
            "train_files": len(corpus.train),
            "train_bytes": Corpus.size(corpus.train),
            "train_tokens": len(data.train_ids),
            "heldout_files": len(corpus.heldout),
            "heldout_bytes": Corpus.size(corpus.heldout),
            "heldout_txt_bytes": len(data.heldout.encode("utf-8")),
            "heldout_txt_tokens": len(data.eval_ids),
            "heldout_txt_first_files": [name for name, _ in corpus.heldout[:5]],
        },
        "sample": {"prompt": "def ", "greedy_new_tokens": 40, "text": sample},
        "versions": {
            "torch": torch.__version__,
            "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__,
            "python": platform.python_version(),
        },
        "num_threads": NUM_THREADS,
    }


if __name__ == "__main__":
    main()
