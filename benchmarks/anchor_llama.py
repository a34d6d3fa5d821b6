"""Write issue 8's anchor model: a random-initialised Hugging Face Llama of about 33M parameters.

hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1536, vocab 8000; fp32 safetensors of
~133 MB, saved with ``save_pretrained`` (fixed seed, so every run writes the same weights). A
byte-level BPE tokenizer trained in a second on the demo's held-out text goes beside it: the
GenAI builder refuses a model without one, and ``kiln generate`` needs one for text. Usable from
kiln's venv and from the peers' venvs (only torch + transformers + tokenizers):

    python benchmarks/anchor_llama.py /work/peers/anchor
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = {
    "vocab_size": 8000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4608,  # room for the 4096-token past sweep plus a prompt
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


TEXT = Path(__file__).resolve().parents[1] / "demo" / "checkpoint" / "heldout.txt"


def write_tokenizer(out: Path) -> None:
    """tokenizer.json + tokenizer_config.json: byte-level BPE, at most the model's vocab, with
    <s>=1 and </s>=2 to match the config's bos/eos ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train([str(TEXT)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)


def write_anchor(out: Path, seed: int = 0) -> Path:
    """Save the anchor Llama (config.json, model.safetensors, tokenizer) to ``out``."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = write_anchor(args.out, args.seed)
    params = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote {out} ({params / 2**20:.1f} MiB of safetensors)")


if __name__ == "__main__":
    main()
