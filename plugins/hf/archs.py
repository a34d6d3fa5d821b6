"""The Hugging Face architectures kiln exports, and what each one's config may say.

Every architecture is read by the same standard config fields (``config.read_spec``); an entry
here holds only what differs: its context-length field where it has another name (or none: ALiBi),
its KV-head rule where the cache holds other heads than ``num_key_value_heads`` says, and the
config values it refuses (``Refusal``: a field that changes the forward pass in a way kiln does
not prove). An architecture is listed only when a test proves generation parity against
transformers' own ``generate()`` for it (``tests/export/test_hf_archs.py``; a test fails if an
entry has no tiny model there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ARCHS", "Arch", "Refusal"]


@dataclasses.dataclass(frozen=True)
class Refusal:
    """``field`` of the config, refused when ``refused(value)`` holds, with ``why``."""

    field: str
    refused: Callable[[Any], bool]
    why: str


def _truthy(value: Any) -> bool:
    return bool(value)


@dataclasses.dataclass(frozen=True)
class Arch:
    label: str  # its name in docs/architectures.md (kiln plugins' table)
    context: str | None = "max_position_embeddings"  # None: no limit of its own (ALiBi extrapolates)
    kv_heads: Callable[[Any], int] | None = None  # the cache's heads where the standard rule is wrong
    refusals: tuple[Refusal, ...] = ()
    notes: str = ""  # what the tests prove beyond the plain architecture (docs/architectures.md)
    # --target ort: "GQA" when every layer's attention becomes GroupQueryAttention (tested), else
    # what the rewrite does not recognise (those layers keep the portable attention, still exact);
    # "MoE" when every mixture-of-experts block becomes ONNX Runtime's MoE op (tested)
    ort: str = "GQA"
    # its config has a sliding_window (transformers' config class defines one, None or a width):
    # kiln plugins asks --target onnx about a window only for these (tests/unit/test_support.py)
    window: bool = False


def _falcon_kv_heads(cfg: Any) -> int:
    """The heads Falcon caches, as ``FalconAttention`` counts them (transformers 5.25): the 40B
    layout (``new_decoder_architecture``) and a multi-head model cache ``num_kv_heads`` (repeated
    to every query head at attention time), the 7B layout (``multi_query``) one head. Releases
    before 5.25 broadcast the 40B layout's keys/values to every query head before caching."""
    if cfg.new_decoder_architecture or not cfg.multi_query:
        return int(cfg.num_kv_heads or cfg.num_attention_heads)
    return 1


_BIDIRECTIONAL = Refusal("use_bidirectional_attention", _truthy, "non-causal attention is not a decoder")
_LLAMA_PARTIAL = Refusal(
    "partial_rotary_factor",
    lambda v: v is not None and float(v) != 1.0,
    "this architecture's rotary ignores it (transformers rotates the whole head), so the checkpoint would not run as trained",
)

ARCHS: Mapping[str, Arch] = {
    "LlamaForCausalLM": Arch("Llama", refusals=(_LLAMA_PARTIAL,), notes="rope linear, yarn, llama3, longrope; tied and untied; bias; head_dim != hidden/heads"),
    "MistralForCausalLM": Arch("Mistral", notes="sliding window", window=True),
    "Qwen2ForCausalLM": Arch("Qwen2", notes="sliding window on layers >= max_window_layers; tied", window=True),
    "Qwen3ForCausalLM": Arch("Qwen3", notes="q/k norm", window=True),
    "GemmaForCausalLM": Arch("Gemma", refusals=(_BIDIRECTIONAL,)),
    "Gemma2ForCausalLM": Arch("Gemma 2", refusals=(_BIDIRECTIONAL,), notes="alternating sliding/global layers, attention and final logit soft-capping", window=True),
    "Gemma3ForCausalLM": Arch("Gemma 3 (text)", refusals=(_BIDIRECTIONAL,), notes="sliding/global layers with their own rope, q/k norm, soft-capping", window=True),
    "PhiForCausalLM": Arch("Phi", notes="partial rotary, q/k LayerNorm, parallel attention + MLP"),
    "Phi3ForCausalLM": Arch("Phi-3", notes="partial rotary; longrope up to original_max_position_embeddings (refused past it)", window=True),
    "GraniteForCausalLM": Arch("Granite", notes="embedding, residual, attention and logit multipliers"),
    "OlmoForCausalLM": Arch("OLMo", notes="clip_qkv, non-parametric LayerNorm"),
    "Olmo2ForCausalLM": Arch("OLMo 2", notes="q/k norm over all heads, post-norms"),
    "SmolLM3ForCausalLM": Arch("SmolLM3", notes="NoPE layers", window=True),
    "GPTNeoXForCausalLM": Arch("GPT-NeoX", notes="partial rotary, parallel and serial residual"),
    "StableLmForCausalLM": Arch("StableLM", notes="per-head q/k LayerNorm, parallel residual, qkv bias"),
    "Starcoder2ForCausalLM": Arch("Starcoder2", notes="sliding window", window=True),
    "CohereForCausalLM": Arch("Cohere", notes="interleaved rope, per-head q/k LayerNorm, logit scale"),
    "GPT2LMHeadModel": Arch(
        "GPT-2",
        refusals=(Refusal("add_cross_attention", _truthy, "GPT-2 with cross-attention needs encoder states kiln's Hugging Face decoders do not take"),),
        notes="inverse-layer-index scaling, upcast attention",
        ort="GQA; portable attention with reorder_and_upcast_attn",
    ),
    "GPTJForCausalLM": Arch("GPT-J", notes="interleaved partial rotary"),
    "OPTForCausalLM": Arch("OPT", notes="post-LayerNorm, word_embed_proj_dim"),
    "Ernie4_5ForCausalLM": Arch("Ernie 4.5", notes="interleaved rope, bias"),
    "Glm4ForCausalLM": Arch("GLM-4", notes="interleaved partial rotary, post-norms"),
    "FalconForCausalLM": Arch(
        "Falcon",
        kv_heads=_falcon_kv_heads,
        refusals=(Refusal("alibi", _truthy, "Falcon's ALiBi computes its biases in bfloat16, which ONNX Runtime's CPU cannot run for parity"),),
        notes="7B (multi-query) and 40B (new decoder architecture) layouts",
        ort="GQA",
    ),
    "BloomForCausalLM": Arch(
        "Bloom", context=None, notes="ALiBi: no context limit of its own, --max-context is required", ort="portable attention (ALiBi)"
    ),
    "MixtralForCausalLM": Arch("Mixtral", notes="mixture of experts (top-k routing, renormalised), sliding window", ort="GQA; MoE (decode)", window=True),
    "Qwen3MoeForCausalLM": Arch(
        "Qwen3-MoE",
        notes="mixture of experts (norm_topk_prob on and off), dense layers (mlp_only_layers), q/k norm",
        ort="GQA; MoE (decode)",
        window=True,
    ),
    "GptOssForCausalLM": Arch(
        "gpt-oss",
        notes="mixture of experts (clamped SwiGLU, biases), attention sinks, alternating sliding layers, yarn",
        ort="portable attention (attention sinks); per-expert MatMuls (expert biases, clamped SwiGLU)",
        window=True,
    ),
}
