"""Write a native kiln Llama checkpoint (``demo/train.py --arch llama``) as a Hugging Face
``LlamaForCausalLM`` directory, so that tools that read only Hugging Face checkpoints (the ONNX
Runtime GenAI builder) can be run on the same trained weights as kiln.

The native decoder with pre-RMSNorm, SwiGLU, rotary positions, no PLE and no cross-attention is
exactly Hugging Face's Llama: RMSNorm ``x * rsqrt(mean(x^2) + eps) * w``; rotary in the "rotate
half" convention with ``inv_freq = theta^(-2i/head_dim)``; grouped-query attention where query
head ``h`` reads key/value head ``h // (n_heads / n_kv_heads)`` (``repeat_interleave`` there,
``repeat_kv`` here), scores scaled by ``1/sqrt(head_dim)``; ``fc2(silu(gate(x)) * fc1(x))`` is
``down(silu(gate(x)) * up(x))``; a tied head. Only names change. Any other native config
(LayerNorm, GELU, post-norm, learned positions, PLE, cross-attention) has no Llama equivalent and
is refused. ``--check`` proves the conversion: transformers' logits against kiln's native model
on held-out tokens.

    python benchmarks/native_to_hf.py CKPT OUT [--check]
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kiln.plugins.native.checkpoint import find_weights, read_state_dict
from kiln.plugins.native.config import MLPKind, NativeConfig, NormKind, NormPosition, PositionKind

__all__ = ["hf_config", "hf_state_dict", "native_to_hf", "max_logit_difference"]

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.q_proj": "self_attn.q_proj",
    "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj",
    "attn.o_proj": "self_attn.o_proj",
    "mlp.gate": "mlp.gate_proj",
    "mlp.fc1": "mlp.up_proj",
    "mlp.fc2": "mlp.down_proj",
}


def _refusals(cfg: NativeConfig) -> list[str]:
    out = []
    if cfg.norm is not NormKind.RMSNORM:
        out.append(f"norm {cfg.norm.value} (Llama: rmsnorm)")
    if cfg.norm_position is not NormPosition.PRE:
        out.append(f"norm_position {cfg.norm_position.value} (Llama: pre)")
    if cfg.mlp is not MLPKind.SWIGLU:
        out.append(f"mlp {cfg.mlp.value} (Llama: swiglu)")
    if cfg.position is not PositionKind.ROPE:
        out.append(f"position {cfg.position.value} (Llama: rope)")
    if cfg.ple.enabled:
        out.append("PLE enabled (Llama has none)")
    if cfg.cross_attention:
        out.append("cross-attention (Llama has none)")
    return out


def hf_config(cfg: NativeConfig) -> dict[str, Any]:
    """The ``LlamaConfig`` keyword arguments of a native config; ``ValueError`` when the native
    model is not a Llama."""
    refused = _refusals(cfg)
    if refused:
        raise ValueError("not expressible as a Hugging Face Llama: " + "; ".join(refused))
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_context,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
    }


def hf_state_dict(state: Mapping[str, Tensor], cfg: NativeConfig) -> dict[str, Tensor]:
    """Native tensor names -> Hugging Face Llama names (every native tensor used exactly once)."""
    out: dict[str, Tensor] = {}
    for key in state:
        if key == "embed.weight":
            out["model.embed_tokens.weight"] = state[key]
        elif key == "final_norm.weight":
            out["model.norm.weight"] = state[key]
        elif key == "lm_head.weight":
            out["lm_head.weight"] = state[key]
        elif key.startswith("layers."):
            _, index, rest = key.split(".", 2)
            for native, hf in _LAYER_NAMES.items():
                if rest == native or rest.startswith(native + "."):
                    out[f"model.layers.{index}.{hf}{rest[len(native) :]}"] = state[key]
                    break
            else:
                raise ValueError(f"native tensor {key} has no Hugging Face Llama counterpart")
        else:
            raise ValueError(f"native tensor {key} has no Hugging Face Llama counterpart")
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)  # transformers ties it to the embedding
    elif "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def native_to_hf(ckpt: Path, out: Path) -> Path:
    """Write ``out``: config.json, model.safetensors (``save_pretrained``), generation_config.json,
    and the checkpoint's own tokenizer.json with a tokenizer_config.json (bos/eos/pad named)."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = NativeConfig.load(ckpt / "config.json")
    state = read_state_dict(find_weights(ckpt))
    model = LlamaForCausalLM(LlamaConfig(**hf_config(cfg))).eval()
    missing, unexpected = model.load_state_dict(hf_state_dict({k: state[k] for k in state}, cfg), strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{ckpt}: weights do not fill a Llama: missing {missing}, unexpected {unexpected}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if (ckpt / "tokenizer.json").is_file():
        shutil.copyfile(ckpt / "tokenizer.json", out / "tokenizer.json")
        fast = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
        names = {
            i: fast.convert_ids_to_tokens(i)
            for i in (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
            if i is not None
        }
        if cfg.bos_token_id is not None:
            fast.bos_token = names[cfg.bos_token_id]
        if cfg.eos_token_id is not None:
            fast.eos_token = names[cfg.eos_token_id]
        if cfg.pad_token_id is not None:
            fast.pad_token = names[cfg.pad_token_id]
        fast.save_pretrained(out)
    return out


def max_logit_difference(ckpt: Path, hf_dir: Path, ids: Tensor) -> float:
    """Largest |logit| difference between kiln's native model and transformers' Llama read back
    from ``hf_dir``, on token ids ``[B, S]`` (fp32, eager attention)."""
    from transformers import LlamaForCausalLM

    from kiln.plugins import load_model

    native = load_model(ckpt).module.eval()
    hf = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
    positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        want = native(ids, torch.ones_like(ids), positions)[0]
        got = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    return float((want - got).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--check", action="store_true", help="compare transformers' logits with kiln's native model on held-out tokens"
    )
    args = parser.parse_args()
    native_to_hf(args.ckpt, args.out)
    print(f"wrote {args.out}")
    if args.check:
        from tokenizers import Tokenizer

        text = (args.ckpt / "heldout.txt").read_text()[:20000]
        ids = Tokenizer.from_file(str(args.ckpt / "tokenizer.json")).encode(text).ids[:512]
        batch = torch.tensor(ids, dtype=torch.int64).view(2, 256)
        print(
            f"max |logit difference| native vs transformers over {batch.numel()} tokens: "
            f"{max_logit_difference(args.ckpt, args.out, batch):.3g}"
        )


if __name__ == "__main__":
    main()
