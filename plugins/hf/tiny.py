"""Tiny random Hugging Face models, one or more per architecture of ``archs.ARCHS``, each with
its architecture's own features switched on (2 layers, hidden 64, 4 heads, 2 KV heads where the
architecture has GQA): what the tests export and compare with transformers' ``generate()``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kiln.plugins.hf.tiny_gemma3n import GEMMA3N_TINY
from kiln.plugins.hf.tiny_gemma4 import GEMMA4_TINY
from kiln.plugins.hf.tiny_lfm2 import LFM2_TINY
from kiln.plugins.hf.tiny_mamba import MAMBA_TINY
from kiln.plugins.hf.tiny_mamba_hybrids import MAMBA_HYBRID_TINY
from kiln.plugins.hf.tiny_qwen3_5 import QWEN3_5_TINY
from kiln.plugins.hf.tiny_recurrent import RECURRENT_TINY

__all__ = ["TINY", "TinyCase"]

V, H, L, NH, KV, FF, CTX = 128, 64, 2, 4, 2, 128, 64
_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # inside the tiny vocabulary (some defaults are not)
_LLAMA_LIKE = dict(
    **_IDS,
    vocab_size=V,
    hidden_size=H,
    intermediate_size=FF,
    num_hidden_layers=L,
    num_attention_heads=NH,
    num_key_value_heads=KV,
    max_position_embeddings=CTX,
)
_MHA = {k: v for k, v in _LLAMA_LIKE.items() if k != "num_key_value_heads"}
_HALF = 8  # rotary frequencies of a 16-wide head
_GRANITE: dict[str, Any] = {
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "logits_scaling": 8.0,
    "attention_multiplier": 0.015625,
}
_SLIDING_GLOBAL = ["sliding_attention", "full_attention"]
_MOE4: dict[str, Any] = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}  # 4 experts, top-2


def _rope(**kw: Any) -> dict[str, Any]:
    return {"rope_theta": 10000.0, **kw}


_LONGROPE = _rope(
    rope_type="longrope",
    short_factor=[1.0 + 0.1 * i for i in range(_HALF)],
    long_factor=[1.5 + 0.5 * i for i in range(_HALF)],
    original_max_position_embeddings=16,
)

_GEMMA3_TEXT: dict[str, Any] = dict(
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    },
    attn_logit_softcapping=50.0,
)
# issue 43, Llama 4: layer 0 chunked (8 < prompt + generation), rope, q/k norm, dense MLP; layer 1 NoPE, global,
# temperature tuned (else 15 of 24 tokens differ), experts
_LLAMA4_TEXT: dict[str, Any] = dict(
    head_dim=16,
    intermediate_size=32,
    intermediate_size_mlp=FF,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
)
_LLAMA4_TEXT |= dict(no_rope_layers=[1, 0], attention_chunk_size=8, floor_scale=2, attn_scale=4.0)
_LLAMA4_TEXT |= dict(
    rope_parameters=_rope(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
    )
)
_LLAMA4_VISION = dict.fromkeys(
    ("vision_output_dim", "projector_input_dim", "projector_output_dim"), 32
)  # its projector to the text decoder, tiny
_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)  # a tiny vision tower

TinyCase = tuple[str, Callable[..., Any]]  # (architecture, (transformers module, **overrides) -> config)


def _cfg(config: str, **kw: Any) -> Callable[..., Any]:
    """``(transformers, **overrides) -> config`` for a config of its own field names (the
    overrides by standard name, ``num_hidden_layers``, win)."""

    def make(t: Any, **o: Any) -> Any:
        cls = getattr(t, config)
        own = {cls.attribute_map.get(k, k): v for k, v in o.items()}  # GPT-2's n_layer for num_hidden_layers
        return cls(**{**_IDS, **kw, **own})

    return make


def _wrapper(
    config: str,
    text: str,
    vision: str,
    text_kw: Mapping[str, Any],
    vision_kw: Mapping[str, Any] | None = None,
    **kw: Any,
) -> Callable[..., Any]:
    """``(transformers, **overrides) -> config`` of a multimodal wrapper: a tiny vision tower (with
    ``vision_kw``) and a text decoder of ``_LLAMA_LIKE`` sizes (the overrides are the text decoder's)."""

    def make(t: Any, **o: Any) -> Any:
        vision_config, text_config = (
            getattr(t, vision)(**{**_VISION, **(vision_kw or {})}),
            getattr(t, text)(**{**_LLAMA_LIKE, **text_kw, **o}),
        )
        return getattr(t, config)(text_config=text_config, vision_config=vision_config, **kw)

    return make


def _c(arch: str, config: str, base: Mapping[str, Any] = _LLAMA_LIKE, **kw: Any) -> TinyCase:
    return arch, lambda t, **o: getattr(t, config)(**{**base, **kw, **o})


# multi-head latent attention (issue 43): 4 heads of 16 + 8 rotary key channels, values of 16, a 32-wide latent; a dense
# first layer, then experts
_MLA: dict[str, Any] = dict(
    num_key_value_heads=NH,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    head_dim=8,
    n_shared_experts=1,
)
_MLA |= dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
)
_MLA_YARN = _rope(
    rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=16
)  # mscale_all_dim: the softmax scale too

TINY: Mapping[str, TinyCase] = {
    "llama": _c("LlamaForCausalLM", "LlamaConfig"),
    "llama-bias-headdim": _c("LlamaForCausalLM", "LlamaConfig", attention_bias=True, mlp_bias=True, head_dim=32),
    "llama-tied": _c("LlamaForCausalLM", "LlamaConfig", tie_word_embeddings=True),
    "llama-rope-linear": _c("LlamaForCausalLM", "LlamaConfig", rope_parameters=_rope(rope_type="linear", factor=2.0)),
    "llama-rope-yarn": _c(
        "LlamaForCausalLM",
        "LlamaConfig",
        rope_parameters=_rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    ),
    "llama-rope-llama3": _c(
        "LlamaForCausalLM",
        "LlamaConfig",
        rope_parameters=_rope(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
    "llama-rope-longrope": _c(
        "LlamaForCausalLM", "LlamaConfig", rope_parameters=_LONGROPE
    ),  # generation crosses position 16
    "mistral": _c("MistralForCausalLM", "MistralConfig", sliding_window=None),
    "mistral-window": _c("MistralForCausalLM", "MistralConfig", sliding_window=4),
    "qwen2-tied": _c("Qwen2ForCausalLM", "Qwen2Config", tie_word_embeddings=True),
    "qwen2-window": _c(
        "Qwen2ForCausalLM", "Qwen2Config", use_sliding_window=True, sliding_window=4, max_window_layers=1
    ),
    "qwen3": _c("Qwen3ForCausalLM", "Qwen3Config", head_dim=16),
    "gemma": _c("GemmaForCausalLM", "GemmaConfig", head_dim=16),
    "gemma2-window": _c("Gemma2ForCausalLM", "Gemma2Config", head_dim=16, query_pre_attn_scalar=16, sliding_window=4),
    "gemma3-window": _c("Gemma3ForCausalLM", "Gemma3TextConfig", **_GEMMA3_TEXT, final_logit_softcapping=30.0),
    "phi": _c("PhiForCausalLM", "PhiConfig", partial_rotary_factor=0.5, qk_layernorm=True),
    "phi3-partial": _c("Phi3ForCausalLM", "Phi3Config", partial_rotary_factor=0.5),
    "phi3-longrope": _c(
        "Phi3ForCausalLM", "Phi3Config", original_max_position_embeddings=16, rope_parameters=_LONGROPE
    ),  # exported up to 16
    "granite": _c(
        "GraniteForCausalLM",
        "GraniteConfig",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        logits_scaling=8.0,
        attention_multiplier=0.015625,
    ),
    "olmo": _c("OlmoForCausalLM", "OlmoConfig", clip_qkv=0.5),
    "olmo2": _c("Olmo2ForCausalLM", "Olmo2Config"),
    "smollm3": _c("SmolLM3ForCausalLM", "SmolLM3Config", no_rope_layer_interval=2),
    "gpt-neox-parallel": _c(
        "GPTNeoXForCausalLM", "GPTNeoXConfig", base=_MHA, use_parallel_residual=True, rotary_pct=0.25
    ),
    "gpt-neox-serial": _c(
        "GPTNeoXForCausalLM", "GPTNeoXConfig", base=_MHA, use_parallel_residual=False, rotary_pct=0.5
    ),
    "stablelm": _c(
        "StableLmForCausalLM", "StableLmConfig", qk_layernorm=True, use_parallel_residual=True, use_qkv_bias=True
    ),
    "starcoder2-window": _c("Starcoder2ForCausalLM", "Starcoder2Config", sliding_window=4),
    "cohere": _c("CohereForCausalLM", "CohereConfig", use_qk_norm=True, logit_scale=0.25),
    "gpt2": ("GPT2LMHeadModel", _cfg("GPT2Config", vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=CTX)),
    "gpt2-upcast": (
        "GPT2LMHeadModel",
        _cfg(
            "GPT2Config",
            vocab_size=V,
            n_embd=H,
            n_layer=L,
            n_head=NH,
            n_positions=CTX,
            scale_attn_by_inverse_layer_idx=True,
            reorder_and_upcast_attn=True,
        ),
    ),
    "gptj": (
        "GPTJForCausalLM",
        _cfg("GPTJConfig", vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=CTX, rotary_dim=8),
    ),
    "opt": (
        "OPTForCausalLM",
        _cfg(
            "OPTConfig",
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            ffn_dim=FF,
            max_position_embeddings=CTX,
        ),
    ),
    "opt-postln-proj": (
        "OPTForCausalLM",
        _cfg(
            "OPTConfig",
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            ffn_dim=FF,
            max_position_embeddings=CTX,
            do_layer_norm_before=False,
            word_embed_proj_dim=32,
        ),
    ),
    "ernie4_5": _c("Ernie4_5ForCausalLM", "Ernie4_5Config", head_dim=16, use_bias=True),
    "glm4": _c("Glm4ForCausalLM", "Glm4Config", head_dim=16),
    "falcon-7b": (
        "FalconForCausalLM",
        _cfg(
            "FalconConfig",
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            max_position_embeddings=CTX,
            multi_query=True,
            new_decoder_architecture=False,
            parallel_attn=True,
        ),
    ),
    "falcon-40b": (
        "FalconForCausalLM",
        _cfg(
            "FalconConfig",
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            num_kv_heads=2,
            max_position_embeddings=CTX,
            new_decoder_architecture=True,
        ),
    ),
    "bloom": (
        "BloomForCausalLM",
        _cfg("BloomConfig", vocab_size=V, hidden_size=H, n_layer=L, n_head=NH, seq_length=CTX),
    ),
    "mixtral-window": _c(
        "MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2, sliding_window=4
    ),
    "qwen3-moe": _c(
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    "qwen3-moe-unnormalised": _c(
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
    ),
    "gpt-oss-window": _c(
        "GptOssForCausalLM",
        "GptOssConfig",
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        rope_parameters=_rope(
            rope_type="yarn",
            factor=4.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=16,
        ),
    ),
    "qwen2-moe-window": _c(
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
    ),
    "olmoe": _c("OlmoeForCausalLM", "OlmoeConfig", num_experts=4, num_experts_per_tok=2, clip_qkv=0.5),
    "granitemoe": _c(
        "GraniteMoeForCausalLM",
        "GraniteMoeConfig",
        **_MOE4,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        logits_scaling=8.0,
        attention_multiplier=0.015625,
    ),
    "granitemoeshared": _c(
        "GraniteMoeSharedForCausalLM",
        "GraniteMoeSharedConfig",
        **_MOE4,
        shared_intermediate_size=32,
        residual_multiplier=0.22,
    ),
    "glm4-moe": _c(
        "Glm4MoeForCausalLM",
        "Glm4MoeConfig",
        head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
    ),
    "ernie4_5-moe": _c(
        "Ernie4_5_MoeForCausalLM",
        "Ernie4_5_MoeConfig",
        moe_num_experts=4,
        moe_k=2,
        moe_intermediate_size=32,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        use_bias=True,
    ),
    "hunyuan-moe": _c("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config", head_dim=16, num_experts=4, moe_topk=2),
    "minimax-m2": _c("MiniMaxM2ForCausalLM", "MiniMaxM2Config", **_MOE4, head_dim=16, rotary_dim=8),
    "phimoe-window": _c(
        "PhimoeForCausalLM", "PhimoeConfig", **_MOE4, sliding_window=4, attention_bias=True, lm_head_bias=True
    ),
    "glm": _c("GlmForCausalLM", "GlmConfig", head_dim=16),
    "hunyuan-dense": _c("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config", head_dim=16),
    "seed-oss": _c("SeedOssForCausalLM", "SeedOssConfig", head_dim=16, attention_out_bias=True, mlp_bias=True),
    "apertus": _c(
        "ApertusForCausalLM",
        "ApertusConfig",
        rope_parameters=_rope(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
    "arcee": _c("ArceeForCausalLM", "ArceeConfig", head_dim=16),
    "gpt-bigcode": (
        "GPTBigCodeForCausalLM",
        _cfg("GPTBigCodeConfig", vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=CTX),
    ),
    "olmo3-window": _c(
        "Olmo3ForCausalLM", "Olmo3Config", sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    ),
    "cohere2-window": _c(
        "Cohere2ForCausalLM",
        "Cohere2Config",
        head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        logit_scale=0.25,
    ),
    "exaone4-window": _c(
        "Exaone4ForCausalLM", "Exaone4Config", sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    ),
    "ministral-window": _c("MinistralForCausalLM", "MinistralConfig", head_dim=16, sliding_window=4),
    "ministral3-yarn": _c(
        "Ministral3ForCausalLM",
        "Ministral3Config",
        head_dim=16,
        rope_parameters=_rope(
            rope_type="yarn",
            factor=4.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_max_position_embeddings=16,
            llama_4_scaling_beta=0.1,
        ),
    ),  # generation crosses positions 16 and 32, where llama-4 scaling steps
    # issue 41, more families
    "afmoe-window": _c(
        "AfmoeForCausalLM",
        "AfmoeConfig",
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_shared_experts=1,
        num_dense_layers=1,
        sliding_window=4,
        layer_types=_SLIDING_GLOBAL,
        route_scale=2.0,
    ),
    "apertus1p5": _c(
        "Apertus1p5TextForCausalLM",
        "Apertus1p5TextConfig",
        rope_parameters=_rope(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
    "aria-text": _c(
        "AriaTextForCausalLM",
        "AriaTextConfig",
        head_dim=16,
        moe_num_experts=4,
        moe_topk=2,
        moe_num_shared_experts=1,
        intermediate_size=32,
    ),
    "biogpt": (
        "BioGptForCausalLM",
        _cfg(
            "BioGptConfig",
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            intermediate_size=FF,
            max_position_embeddings=CTX,
        ),
    ),
    "codegen": (
        "CodeGenForCausalLM",
        _cfg("CodeGenConfig", vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=CTX, n_ctx=CTX, rotary_dim=8),
    ),
    "cohere2-moe-window": _c(
        "Cohere2MoeForCausalLM",
        "Cohere2MoeConfig",
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_shared_experts=1,
        sliding_window=4,
        layer_types=_SLIDING_GLOBAL,
        mlp_layer_types=["sparse", "sparse"],
        logit_scale=0.25,
    ),
    "cohere-compass": _c(
        "CohereCompassForCausalLM",
        "CohereCompassTextConfig",
        head_dim=16,
        layer_types=["full_attention"] * L,
        logit_scale=0.25,
        rope_parameters={"full_attention": _rope(rope_type="default", mrope_section=[2, 3, 3])},
    ),
    "cwm-window": _c(
        "CwmForCausalLM",
        "CwmConfig",
        head_dim=16,
        sliding_window=4,
        layer_types=["full_attention", "sliding_attention"],
        rope_parameters=_rope(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
    "dots1": _c(
        "Dots1ForCausalLM",
        "Dots1Config",
        head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
        layer_types=["full_attention"] * L,
    ),
    "ergo-window": _c(
        "ErgoForCausalLM",
        "ErgoConfig",
        head_dim=16,
        first_dense_intermediate_size=FF,
        num_dense_blocks=1,
        moe_intermediate_size=32,
        shared_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        global_attention_scale=2.0,
        layer_types=["full_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse"],
    ),
    "exaone-moe-window": _c(
        "ExaoneMoeForCausalLM",
        "ExaoneMoeConfig",
        head_dim=16,
        sliding_window=4,
        layer_types=_SLIDING_GLOBAL,
        mlp_layer_types=["dense", "sparse"],
        first_k_dense_replace=1,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_shared_experts=1,
    ),
    "flex-olmo": _c("FlexOlmoForCausalLM", "FlexOlmoConfig", num_experts=4, num_experts_per_tok=2),
    "flint-window": _c(
        "FlintForCausalLM",
        "FlintConfig",
        head_dim=16,
        sliding_window=4,
        layer_types=["full_attention", "sliding_attention"],
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
    ),
    "gpt-neox-japanese": (
        "GPTNeoXJapaneseForCausalLM",
        _cfg(
            "GPTNeoXJapaneseConfig",
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            max_position_embeddings=CTX,
        ),
    ),
    "granite-swa-window": _c(
        "GraniteSWAForCausalLM",
        "GraniteSWAConfig",
        **_GRANITE,
        sliding_window=4,
        layer_types=_SLIDING_GLOBAL,
        layer_rope_theta=[10000.0, 1e6],
    ),
    "granitemoe-swa-window": _c(
        "GraniteMoeSWAForCausalLM",
        "GraniteMoeSWAConfig",
        **_MOE4,
        **_GRANITE,
        sliding_window=4,
        layer_types=_SLIDING_GLOBAL,
        layer_rope_theta=[10000.0, 1e6],
    ),
    "helium": _c("HeliumForCausalLM", "HeliumConfig", head_dim=16),
    "hy-v3": _c(
        "HYV3ForCausalLM",
        "HYV3Config",
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_shared_experts=1,
        moe_intermediate_size=32,
        mlp_layer_types=["dense", "sparse"],
    ),
    "hyperclovax": _c("HyperCLOVAXForCausalLM", "HyperCLOVAXConfig", **_GRANITE, head_dim=16),
    "jais2": _c("Jais2ForCausalLM", "Jais2Config", head_dim=16),
    "kolibri1-window": _c(
        "Kolibri1ForCausalLM",
        "Kolibri1Config",
        head_dim=16,
        sliding_window=4,
        layer_types=["full_attention", "sliding_attention"],
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "laguna-window": _c(
        "LagunaForCausalLM",
        "LagunaConfig",
        head_dim=16,
        sliding_window=4,
        layer_types=["full_attention", "sliding_attention"],
        num_attention_heads_per_layer=[NH, NH],
        mlp_layer_types=["dense", "sparse"],
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    "mellum-window": _c(
        "MellumForCausalLM",
        "MellumConfig",
        head_dim=16,
        sliding_window=4,
        layer_types=_SLIDING_GLOBAL,
        mlp_layer_types=["sparse", "sparse"],
        moe_intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "minicpm5-moe": _c(
        "MiniCPM5MoeForCausalLM",
        "MiniCPM5MoeConfig",
        head_dim=16,
        moe_intermediate_size=32,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_routed_experts=4,
        routed_scaling_factor=2.5,
        mlp_layer_types=["dense", "sparse"],
    ),
    "minimax-m3-vl": _c(
        "MiniMaxM3VLForCausalLM",
        "MiniMaxM3VLTextConfig",
        **_MOE4,
        head_dim=16,
        dense_intermediate_size=FF,
        shared_intermediate_size=32,
        rotary_dim=8,
        mlp_layer_types=["sparse", "sparse"],
        layer_types=["full_attention"] * L,
    ),
    "modernbert-decoder-window": _c(
        "ModernBertDecoderForCausalLM",
        "ModernBertDecoderConfig",
        base=_MHA,
        local_attention=8,
        layer_types=["full_attention", "sliding_attention"],
    ),  # a window of local_attention / 2 = 4
    "nanochat": _c("NanoChatForCausalLM", "NanoChatConfig"),
    "nemotron": _c("NemotronForCausalLM", "NemotronConfig", head_dim=16),
    "persimmon": _c("PersimmonForCausalLM", "PersimmonConfig", base=_MHA),
    "solar-open": _c(
        "SolarOpenForCausalLM",
        "SolarOpenConfig",
        head_dim=16,
        moe_intermediate_size=32,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_routed_experts=4,
    ),
    "vaultgemma-window": _c(
        "VaultGemmaForCausalLM",
        "VaultGemmaConfig",
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,
        layer_types=_SLIDING_GLOBAL,
    ),
    # issue 43: V3 with q low-rank, interleaved rope, yarn, group-limited sigmoid routing; V2-Lite's layout, complex
    # rotary, greedy softmax routing
    "deepseek-v3": _c(
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        **_MLA,
        q_lora_rank=32,
        n_group=2,
        topk_group=1,
        rope_interleave=True,
        rope_parameters=_MLA_YARN,
    ),
    "deepseek-v2": _c("DeepseekV2ForCausalLM", "DeepseekV2Config", **_MLA, q_lora_rank=None, topk_method="greedy"),
    # multimodal wrappers, exported as their text decoder (image tokens outside the tiny vocabulary)
    "gemma3-multimodal-window": (
        "Gemma3ForConditionalGeneration",
        _wrapper(
            "Gemma3Config",
            "Gemma3TextConfig",
            "SiglipVisionConfig",
            _GEMMA3_TEXT,
            mm_tokens_per_image=4,
            image_token_index=V,
            boi_token_index=V + 1,
            eoi_token_index=V + 2,
        ),
    ),
    "mistral3-multimodal-window": (
        "Mistral3ForConditionalGeneration",
        _wrapper(
            "Mistral3Config",
            "MistralConfig",
            "PixtralVisionConfig",
            {"head_dim": 16, "sliding_window": 4},
            image_token_index=V,
            spatial_merge_size=2,
        ),
    ),
    "mpt": (
        "MptForCausalLM",
        _cfg("MptConfig", vocab_size=V, d_model=H, n_layers=L, n_heads=NH, expansion_ratio=2, max_seq_len=CTX),
    ),
    "llama4-chunked": _c("Llama4ForCausalLM", "Llama4TextConfig", **_LLAMA4_TEXT),
    "llama4-multimodal-chunked": (
        "Llama4ForConditionalGeneration",
        _wrapper(
            "Llama4Config",
            "Llama4TextConfig",
            "Llama4VisionConfig",
            _LLAMA4_TEXT,
            _LLAMA4_VISION,
            image_token_index=V,
            boi_token_index=V + 1,
            eoi_token_index=V + 2,
        ),
    ),  # fmt: skip
    **GEMMA3N_TINY,  # issue 43: per-layer inputs, AltUp, Laurel, shared KV (plugins/hf/tiny_gemma3n.py)
    **GEMMA4_TINY,  # issue 43: per-layer head dims, values = keys, shared KV (plugins/hf/tiny_gemma4.py)
    **RECURRENT_TINY,  # issue 43: a recurrent state instead of a KV cache (plugins/hf/tiny_recurrent.py)
    **LFM2_TINY,  # issue 43: short-convolution layers, a conv window alone (plugins/hf/tiny_lfm2.py)
    **QWEN3_5_TINY,  # issue 43: Gated DeltaNet hybrids (plugins/hf/tiny_qwen3_5.py)
    **MAMBA_HYBRID_TINY,  # issue 43: Nemotron-H, Falcon-H1 (plugins/hf/tiny_mamba_hybrids.py)
    **MAMBA_TINY,  # issue 43: Mamba v1 state-space layers (plugins/hf/tiny_mamba.py)
}
