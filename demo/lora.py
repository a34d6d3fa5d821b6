"""A tiny Hugging Face Llama and a LoRA adapter of it made by PEFT, to try ``kiln export --adapter``
without a download (needs the ``hf`` extra: ``pip install -e ".[hf]"``):

    python -m kiln.demo.lora build/lora

writes ``build/lora/base`` (a random 2-layer Llama, saved by transformers) and
``build/lora/adapter`` (rank 8 on every attention and MLP projection, saved by PEFT's
``save_pretrained``). PEFT starts lora_B at zero, which changes nothing; here both halves are
random, as training would leave them, so the merged model generates other tokens than the base.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from kiln.plugins.hub_cache import HF_EXTRA

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """``root/base`` and ``root/adapter``; returns both."""
    from peft import LoraConfig, get_peft_model

    from kiln.plugins.hf import tiny_model

    model: Any = tiny_model("llama", seed).module.model  # transformers' LlamaForCausalLM (untyped)
    model.save_pretrained(root / "base", safe_serialization=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_" in name:
                param.copy_(
                    torch.randn(param.shape, generator=generator) * 0.1
                )  # scaled B @ A: std ~0.06, the base weights 0.02
    lora.save_pretrained(str(root / "adapter"))
    return root / "base", root / "adapter"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kiln.demo.lora DIR   (writes DIR/base and DIR/adapter)", file=sys.stderr)
        return 2
    missing = [name for name in ("transformers", "peft") if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"error: python -m kiln.demo.lora needs {' and '.join(missing)} (the hf extra): {HF_EXTRA}", file=sys.stderr
        )
        return 1
    base, adapter = write(Path(argv[0]))
    print(f"wrote {base} (a tiny random Llama) and {adapter} (a LoRA adapter of it)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
