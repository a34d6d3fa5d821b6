"""The Hugging Face architectures kiln exports, and what each one's config may say.

Every architecture is read by the same standard config fields (``config.read_spec``); an entry
here holds only what differs: its context-length field where it has another name (or none: ALiBi),
its KV-head rule where the cache holds other heads than ``num_key_value_heads`` says, its cache
layout where the cache is not keys and values per head (``Arch.cache``: multi-head latent
attention), the config values it refuses (``Refusal``: a field that changes the forward pass in a
way kiln does not prove), and for a multimodal wrapper the text decoder it is exported as
(``TextDecoder``).
An architecture is listed only when a test proves generation parity against
transformers' own ``generate()`` for it (``tests/export/test_hf_archs.py``; a test fails if an
entry has no tiny model there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from kiln.errors import CheckpointError
from kiln.plugins.base import StaticStateProof
from kiln.plugins.cache_layout import CacheLayout

__all__ = ["ALIASES", "ARCHS", "Arch", "Refusal", "TextDecoder"]


@dataclasses.dataclass(frozen=True)
class Refusal:
    """``field`` of the config, refused when ``refused(value)`` holds, with ``why``."""

    field: str
    refused: Callable[[Any], bool]
    why: str


def _truthy(value: Any) -> bool:
    return bool(value)


@dataclasses.dataclass(frozen=True)
class TextDecoder:
    """A multimodal wrapper exported as its text decoder: the module at ``prefix`` (its language
    model) with the wrapper's ``head``, built as the causal LM class transformers maps
    ``config.text_config`` to, which must be one of ``texts`` (entries of ``ARCHS``, whose own
    refusals apply to ``text_config``); the wrapper's other modules (its vision tower) are left out
    and the export says so (``multimodal``)."""

    texts: tuple[str, ...]  # the text decoder classes a test proves inside this wrapper
    prefix: str = "model.language_model"
    head: str = "lm_head"


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
    # a multimodal wrapper: its text decoder is exported (its refusals are then read from text_config)
    text: TextDecoder | None = None
    # what each layer caches when it is not keys and values per KV head (``plugins.cache_layout``)
    cache: Callable[[Any], CacheLayout | None] | None = None  # None from it: keys and values per KV head
    # its config has an attention_chunk_size: its chunked_attention layers (a query sees the keys of
    # its own chunk only) are proved; --target onnx refuses them (exporter/targets/onnx/windows.py)
    chunked: bool = False
    # the config field of its heads where it is not num_attention_heads (a state-space model's mixer heads)
    heads: str = "num_attention_heads"
    # the layer_types it proves beyond full and sliding attention (a state-space model's "linear_attention")
    layer_types: tuple[str, ...] = ()
    # --fp16: what stays fp32 beyond the default policy (``DecoderSpec.keep_fp32``)
    keep_fp32: tuple[str, ...] = ()
    # the rope types it proves beyond config.STATIC_ROPE (Gemma 4's "proportional": fixed frequencies, zero past a part)
    ropes: tuple[str, ...] = ()
    # the attributes its config may vary by layer (transformers' per_layer_config), read per layer (its ``cache``)
    per_layer: tuple[str, ...] = ()
    # its recurrent state in the --target onnx graphs: the precisions a test proves it at
    # (tests/export/test_onnx_target_state.py), or why its trace cannot be (``DecoderSpec.static_state``)
    static_state: StaticStateProof | None = None
    # --target onnx applies its sliding window as its config gives it: a windowed tiny model (a window shorter than
    # its parity run) proves it in tests/export/test_onnx_target.py (a wrapper's: test_hf_multimodal.py), which
    # fails where this and those cases differ (``DecoderSpec.sliding_window_proved``)
    sliding_window_proved: bool = False

    def __post_init__(self) -> None:
        if self.sliding_window_proved and not self.window:
            raise ValueError(f"{self.label}: its sliding window is proved, yet its config has none (window=False)")


def _falcon_kv_heads(cfg: Any) -> int:
    """The heads Falcon caches, as ``FalconAttention`` counts them (transformers 5.25): the 40B
    layout (``new_decoder_architecture``) and a multi-head model cache ``num_kv_heads`` (repeated
    to every query head at attention time), the 7B layout (``multi_query``) one head. Releases
    before 5.25 broadcast the 40B layout's keys/values to every query head before caching."""
    if cfg.new_decoder_architecture or not cfg.multi_query:
        return int(cfg.num_kv_heads or cfg.num_attention_heads)
    return 1


def _mamba2_state(cfg: Any) -> CacheLayout:
    """Mamba2's recurrent state per layer (plugins/hf/recurrent_state.py): the conv window over
    x, B and C (``intermediate_size + 2 * n_groups * state_size`` wide, ``conv_kernel`` long) and the
    SSM state (``num_heads`` x ``head_dim`` x ``state_size``)."""
    conv_dim = int(cfg.expand * cfg.hidden_size) + 2 * int(cfg.n_groups) * int(cfg.state_size)
    ssm = (int(cfg.num_heads), int(cfg.head_dim), int(cfg.state_size))
    return CacheLayout.state(int(cfg.num_hidden_layers), (int(cfg.conv_kernel), conv_dim), ssm)


def _mamba1_state(cfg: Any) -> CacheLayout:
    """Mamba v1's recurrent state per layer (Mamba, FalconMamba; plugins/hf/mamba1_scan.py): the conv
    window over x (``intermediate_size`` wide, ``conv_kernel`` long) and the SSM state, one head of
    ``intermediate_size`` x ``state_size`` (transformers' ``[batch, intermediate, state]``)."""
    inner = int(cfg.intermediate_size)
    return CacheLayout.state(int(cfg.num_hidden_layers), (int(cfg.conv_kernel), inner), (1, inner, int(cfg.state_size)))


def _jamba_cache(cfg: Any) -> CacheLayout:
    """Jamba's cache: keys and values per KV head on its ``full_attention`` layers, the Mamba v1 state
    (as ``_mamba1_state``, from its ``mamba_*`` sizes) on its ``linear_attention`` ones."""
    inner = int(cfg.mamba_expand * cfg.hidden_size)
    width = int(cfg.hidden_size) // int(cfg.num_attention_heads)
    return CacheLayout.hybrid(
        ["state" if kind == "linear_attention" else "kv" for kind in cfg.layer_types],
        (int(cfg.num_key_value_heads), width),
        (int(cfg.mamba_d_conv), inner),
        (1, inner, int(cfg.mamba_d_state)),
    )


def _mamba_hybrid_cache(cfg: Any) -> CacheLayout:
    """A Mamba2 hybrid's cache (GraniteMoeHybrid, Bamba): keys and values per KV head on its
    ``full_attention`` layers, the Mamba2 state (as ``_mamba2_state``, from its ``mamba_*`` sizes) on
    its ``linear_attention`` ones."""
    conv_dim = int(cfg.mamba_expand * cfg.hidden_size) + 2 * int(cfg.mamba_n_groups) * int(cfg.mamba_d_state)
    width = int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // int(cfg.num_attention_heads))
    return CacheLayout.hybrid(
        ["state" if kind == "linear_attention" else "kv" for kind in cfg.layer_types],
        (int(cfg.num_key_value_heads), width),
        (int(cfg.mamba_d_conv), conv_dim),
        (int(cfg.mamba_n_heads), int(cfg.mamba_d_head), int(cfg.mamba_d_state)),
    )


def _nemotron_h_cache(cfg: Any) -> CacheLayout:
    """Nemotron-H's cache: each block one mixer, so ``key``/``value`` on its attention blocks, the Mamba2
    state (``mamba_num_heads`` x ``mamba_head_dim``, ``ssm_state_size``) on its Mamba2 blocks, nothing on its
    MLP and mixture-of-experts blocks."""
    conv_dim = int(cfg.mamba_num_heads) * int(cfg.mamba_head_dim) + 2 * int(cfg.n_groups) * int(cfg.ssm_state_size)
    kinds = {"full_attention": "kv", "linear_attention": "state"}
    return CacheLayout.hybrid(
        [kinds.get(kind, "none") for kind in cfg.layers_block_type],
        (int(cfg.num_key_value_heads), int(cfg.head_dim)),
        (int(cfg.conv_kernel), conv_dim),
        (int(cfg.mamba_num_heads), int(cfg.mamba_head_dim), int(cfg.ssm_state_size)),
    )


def _falcon_h1_cache(cfg: Any) -> CacheLayout:
    """Falcon-H1's cache: every layer runs attention and a Mamba2 mixer side by side, so each carries
    ``key``/``value`` and the Mamba2 state (its width ``mamba_d_ssm``, or ``mamba_expand`` x hidden)."""
    inner = int(cfg.mamba_d_ssm or cfg.mamba_expand * cfg.hidden_size)
    conv_dim = inner + 2 * int(cfg.mamba_n_groups) * int(cfg.mamba_d_state)
    return CacheLayout.hybrid(
        ["kv+state"] * int(cfg.num_hidden_layers),
        (int(cfg.num_key_value_heads), int(cfg.hidden_size) // int(cfg.num_attention_heads)),
        (int(cfg.mamba_d_conv), conv_dim),
        (int(cfg.mamba_n_heads), int(cfg.mamba_d_head), int(cfg.mamba_d_state)),
    )


# --fp16: a Gated DeltaNet mixer's own nodes (the delta rule, its decays and conv; not its projections) stay fp32:
# in fp16 the tiny Qwen3.5's prompt state drifts to cosine 0.99984 of PyTorch's (parity's floor: 0.9999)
_DELTANET_FP32 = ("*.linear_attn",)


def _deltanet_hybrid_cache(cfg: Any) -> CacheLayout:
    """A Gated DeltaNet hybrid's cache (Qwen3.5, Qwen3-Next; plugins/hf/gated_deltanet.py): keys and values per
    KV head on its ``full_attention`` layers; on its ``linear_attention`` ones the conv window over q, k and v
    (``2 * key heads * key dim + value heads * value dim`` wide, ``linear_conv_kernel_dim`` long) and the
    recurrent state ``[value heads, key dim, value dim]`` (transformers' ``LinearAttentionLayer``)."""
    key_dim, value_heads = int(cfg.linear_num_key_heads) * int(cfg.linear_key_head_dim), int(cfg.linear_num_value_heads)
    return CacheLayout.hybrid(
        ["state" if kind == "linear_attention" else "kv" for kind in cfg.layer_types],
        (int(cfg.num_key_value_heads), int(cfg.head_dim)),
        (int(cfg.linear_conv_kernel_dim), 2 * key_dim + value_heads * int(cfg.linear_value_head_dim)),
        (value_heads, int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim)),
    )


def _short_conv_cache(cfg: Any) -> CacheLayout:
    """LFM2's cache (Lfm2, Lfm2Moe; plugins/hf/recurrent_state.py): keys and values per KV head on its
    ``full_attention`` layers, the conv window alone (``conv_L_cache`` long, ``hidden_size`` wide; no SSM
    state) on its ``conv`` layers."""
    width = int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // int(cfg.num_attention_heads))
    return CacheLayout.hybrid(
        ["conv" if kind == "conv" else "kv" for kind in cfg.layer_types],
        (int(cfg.num_key_value_heads), width),
        (int(cfg.conv_L_cache), int(cfg.hidden_size)),
    )


def _latent_cache(cfg: Any) -> CacheLayout:
    """Multi-head latent attention's cache (DeepSeek-V2/V3, transformers 5.25): per layer the
    compressed latent (``kv_lora_rank``) in the key slot and the rotated key (``qk_rope_head_dim``)
    in the value slot, one head each."""
    return CacheLayout.latent(int(cfg.num_hidden_layers), int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim))


def _shared_kv_cache(cfg: Any) -> CacheLayout | None:
    """Gemma 3n's cache (transformers 5.25, ``kv_sharing_modes``): keys and values per KV head, none for
    the last ``num_kv_shared_layers`` layers, each of which reads the last earlier layer of its kind."""
    n, shared = int(cfg.num_hidden_layers), int(getattr(cfg, "num_kv_shared_layers", 0) or 0)
    if not shared:
        return None
    kinds, first = list(cfg.layer_types), n - shared
    reads = {i: max(j for j in range(first) if kinds[j] == kinds[i]) for i in range(first, n)}
    return CacheLayout.shared_kv(n, int(cfg.num_key_value_heads), int(cfg.head_dim), reads)


def _gemma4_cache(cfg: Any) -> CacheLayout:
    """Gemma 4's cache (transformers 5.25): keys and values of each layer's own KV heads and head dim
    (``per_layer_config``: a global layer's ``global_head_dim`` and ``num_global_key_value_heads``), none
    for the last ``num_kv_shared_layers`` layers, each of which reads the last earlier layer of its kind."""
    n, shared = int(cfg.num_hidden_layers), int(getattr(cfg, "num_kv_shared_layers", 0) or 0)
    kinds, first = list(cfg.layer_types), n - shared
    if any(kind not in kinds[:first] for kind in kinds[first:]):
        raise CheckpointError(
            f"Gemma4ForCausalLM: num_kv_shared_layers={shared} of {n} layers leaves a shared layer no earlier layer of "
            "its kind to read (a Gemma 4 assistant's text config: its target model passes the keys and values in); "
            "kiln exports a decoder that computes its own"
        )
    reads = {i: max(j for j in range(first) if kinds[j] == kinds[i]) for i in range(first, n)}
    layers = [cfg.per_layer_config[i] for i in range(n)] if getattr(cfg, "is_heterogeneous", False) else [cfg] * n
    return CacheLayout.per_layer([(int(c.num_key_value_heads), int(c.head_dim)) for c in layers], reads)


# multi-head latent attention: --target ort leaves it portable (GroupQueryAttention caches per-head keys and values, not
# the latent)
_MLA = "portable attention (multi-head latent attention)"

_BIDIRECTIONAL = Refusal("use_bidirectional_attention", _truthy, "non-causal attention is not a decoder")
_LLAMA_PARTIAL = Refusal(
    "partial_rotary_factor",
    lambda v: v is not None and float(v) != 1.0,
    "this architecture's rotary ignores it (transformers rotates the whole head), so the checkpoint would not "
    "run as trained",
)

# --target ort: the mixture-of-experts routings its MoE op does not match (their blocks keep the per-expert MatMuls)
_TOPK_FIRST = "per-expert MatMuls (softmax over the top-k logits)"
_SIGMOID = "per-expert MatMuls (sigmoid routing with a correction bias)"

# --target onnx: a recurrent state a test proves at fp32 and fp16 (tests/export/test_onnx_target_state.py: parity,
# and kiln generate's greedy tokens equal to transformers'); no low-bit weights on that target yet
_STATIC_STATE = StaticStateProof(precisions=("fp32", "fp16"))
# --target onnx: a trace whose op TensorRT's ONNX parser is not documented to take (onnx-tensorrt docs/operators.md)
_INT32_CUMSUM = (
    "its mixture-of-experts routing sums int32 expert counts with CumSum, and onnx-tensorrt documents CumSum for "
    "FP32, FP16 and BF16 only"
)

ARCHS: Mapping[str, Arch] = {
    "LlamaForCausalLM": Arch(
        "Llama",
        refusals=(_LLAMA_PARTIAL,),
        notes="rope linear, yarn, llama3, longrope; tied and untied; bias; head_dim != hidden/heads",
    ),
    "MistralForCausalLM": Arch("Mistral", notes="sliding window", window=True, sliding_window_proved=True),
    "Qwen2ForCausalLM": Arch(
        "Qwen2", notes="sliding window on layers >= max_window_layers; tied", window=True, sliding_window_proved=True
    ),
    "Qwen3ForCausalLM": Arch("Qwen3", notes="q/k norm", window=True),
    "GemmaForCausalLM": Arch("Gemma", refusals=(_BIDIRECTIONAL,)),
    "Gemma2ForCausalLM": Arch(
        "Gemma 2",
        refusals=(_BIDIRECTIONAL,),
        notes="alternating sliding/global layers, attention and final logit soft-capping",
        window=True,
        sliding_window_proved=True,
    ),
    "Gemma3ForCausalLM": Arch(
        "Gemma 3 (text)",
        refusals=(_BIDIRECTIONAL,),
        notes="sliding/global layers with their own rope, q/k norm, soft-capping",
        window=True,
        sliding_window_proved=True,
    ),
    "PhiForCausalLM": Arch("Phi", notes="partial rotary, q/k LayerNorm, parallel attention + MLP"),
    "Phi3ForCausalLM": Arch(
        "Phi-3", notes="partial rotary; longrope up to original_max_position_embeddings (refused past it)", window=True
    ),
    "GraniteForCausalLM": Arch("Granite", notes="embedding, residual, attention and logit multipliers"),
    "OlmoForCausalLM": Arch("OLMo", notes="clip_qkv, non-parametric LayerNorm"),
    "Olmo2ForCausalLM": Arch("OLMo 2", notes="q/k norm over all heads, post-norms"),
    "SmolLM3ForCausalLM": Arch("SmolLM3", notes="NoPE layers", window=True),
    "GPTNeoXForCausalLM": Arch("GPT-NeoX", notes="partial rotary, parallel and serial residual"),
    "StableLmForCausalLM": Arch("StableLM", notes="per-head q/k LayerNorm, parallel residual, qkv bias"),
    "Starcoder2ForCausalLM": Arch("Starcoder2", notes="sliding window", window=True, sliding_window_proved=True),
    "CohereForCausalLM": Arch("Cohere", notes="interleaved rope, per-head q/k LayerNorm, logit scale"),
    "GPT2LMHeadModel": Arch(
        "GPT-2",
        refusals=(
            Refusal(
                "add_cross_attention",
                _truthy,
                "GPT-2 with cross-attention needs encoder states kiln's Hugging Face decoders do not take",
            ),
        ),
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
        refusals=(
            Refusal(
                "alibi",
                _truthy,
                "Falcon's ALiBi computes its biases in bfloat16, which ONNX Runtime's CPU cannot run for parity",
            ),
        ),
        notes="7B (multi-query) and 40B (new decoder architecture) layouts",
        ort="GQA",
    ),
    "BloomForCausalLM": Arch(
        "Bloom",
        context=None,
        notes="ALiBi: no context limit of its own, --max-context is required",
        ort="portable attention (ALiBi)",
    ),
    "MixtralForCausalLM": Arch(
        "Mixtral",
        notes="mixture of experts (top-k routing, renormalised), sliding window",
        ort="GQA; MoE (decode)",
        window=True,
        sliding_window_proved=True,
    ),
    "Qwen3MoeForCausalLM": Arch(
        "Qwen3-MoE",
        notes="mixture of experts (norm_topk_prob on and off), dense layers (mlp_only_layers), q/k norm",
        ort="GQA; MoE (decode)",
        window=True,
    ),
    "GptOssForCausalLM": Arch(
        "gpt-oss",
        notes="mixture of experts (clamped SwiGLU, biases), attention sinks, alternating sliding layers, yarn",
        ort="GQA (attention sinks as head_sink); per-expert MatMuls (expert biases, clamped SwiGLU)",
        window=True,
    ),
    "Qwen2MoeForCausalLM": Arch(
        "Qwen2-MoE",
        notes="mixture of experts (top-k, not renormalised) with a sigmoid-gated shared expert, qkv bias, sliding "
        "window",
        ort="GQA; MoE (decode)",
        window=True,
    ),
    "OlmoeForCausalLM": Arch(
        "OLMoE", notes="mixture of experts, clip_qkv, q/k norm over all heads", ort="GQA; MoE (decode)"
    ),
    "GraniteMoeForCausalLM": Arch(
        "GraniteMoE",
        notes="mixture of experts (softmax over the top-k logits), embedding, residual, attention and logit "
        "multipliers",
        ort=f"GQA; {_TOPK_FIRST}",
    ),
    "GraniteMoeSharedForCausalLM": Arch(
        "GraniteMoeShared", notes="GraniteMoE with a shared MLP", ort=f"GQA; {_TOPK_FIRST}"
    ),
    "Glm4MoeForCausalLM": Arch(
        "GLM-4-MoE",
        notes="mixture of experts (sigmoid scores, correction bias, group-limited top-k, routed scaling) with a shared "
        "expert, dense first layer, q/k norm, partial rotary",
        ort=f"GQA; {_SIGMOID}",
    ),
    "Ernie4_5_MoeForCausalLM": Arch(
        "Ernie 4.5-MoE",
        notes="mixture of experts (a correction bias on the choice, renormalised) with shared experts, dense first "
        "layer, interleaved rope, bias, tied",
        ort="GQA; per-expert MatMuls (a bias on the expert choice)",
    ),
    "HunYuanMoEV1ForCausalLM": Arch(
        "HunYuan-MoE",
        notes="mixture of experts (renormalised) with a shared MLP, per-head q/k norm after the rotary",
        ort="GQA; MoE (decode)",
    ),
    "MiniMaxM2ForCausalLM": Arch(
        "MiniMax-M2",
        notes="mixture of experts (sigmoid scores, correction bias), q/k norm over all heads, partial rotary",
        ort=f"GQA; {_SIGMOID}",
    ),
    "PhimoeForCausalLM": Arch(
        "PhiMoE",
        refusals=(
            Refusal(
                "rope_type",
                lambda v: v not in (None, "default"),
                "PhiMoE's rotary picks its scale (short_mscale or long_mscale) by a Python branch on the longest "
                "position, which torch.export cannot trace",
            ),
        ),
        notes="mixture of experts (sparsemixer routing), LayerNorm, attention and head biases, sliding window; default "
        "rope only; also named PhiMoEForCausalLM",
        ort="GQA; per-expert MatMuls (sparsemixer routing)",
        window=True,
    ),
    "GlmForCausalLM": Arch("GLM", notes="interleaved partial rotary, qkv bias"),
    "HunYuanDenseV1ForCausalLM": Arch("HunYuan", notes="per-head q/k norm after the rotary"),
    "SeedOssForCausalLM": Arch("Seed-OSS", notes="qkv and output projection biases, MLP bias"),
    "ApertusForCausalLM": Arch("Apertus", notes="xIELU activation, llama3 rope, per-head q/k norm"),
    "ArceeForCausalLM": Arch("Arcee", notes="relu^2 MLP (no gate)"),
    "GPTBigCodeForCausalLM": Arch(
        "GPTBigCode",
        refusals=(
            Refusal(
                "add_cross_attention",
                _truthy,
                "GPTBigCode with cross-attention needs encoder states kiln's Hugging Face decoders do not take",
            ),
        ),
        notes="multi-query attention (one KV head), learned positions",
    ),
    "Olmo3ForCausalLM": Arch("OLMo 3", notes="sliding/global layers, q/k norm over all heads, post-norms", window=True),
    "Cohere2ForCausalLM": Arch(
        "Cohere2",
        notes="sliding layers with interleaved rope, global layers without rotary, parallel attention + MLP, logit "
        "scale",
        window=True,
    ),
    "Exaone4ForCausalLM": Arch(
        "Exaone 4",
        notes="sliding layers with rope, global layers without rotary, per-head q/k norm, post-norms",
        window=True,
    ),
    "MinistralForCausalLM": Arch("Ministral", notes="sliding window", window=True),
    "Ministral3ForCausalLM": Arch(
        "Ministral 3",
        notes="yarn with llama-4 attention scaling (steps at original_max_position_embeddings)",
        window=True,
    ),
    "MptForCausalLM": Arch(
        "MPT",
        context="max_seq_len",
        notes="ALiBi up to max_seq_len; also named MPTForCausalLM",
        ort="portable attention (ALiBi)",
    ),
    # issue 41, more families: each proved as the 21 above (test_hf_archs), and most with --target ort --ort-int8
    # (test_hf_archs.ORT_INT8)
    "AfmoeForCausalLM": Arch(
        "AFMoE",
        notes=(
            "mixture of experts (sigmoid scores, expert bias, route scale) with shared experts, dense first "
            "layer, sliding layers with rope,"
            " global layers without rotary, sigmoid-gated attention output, q/k norm"
        ),
        ort=f"GQA; {_SIGMOID}",
        window=True,
    ),
    "Apertus1p5TextForCausalLM": Arch(
        "Apertus 1.5",
        refusals=(
            Refusal(
                "output_vocab_size",
                lambda v: v is not None,
                "a pruned head (logits over fewer ids than vocab_size) that kiln's graphs and tokenizer do not size",
            ),
        ),
        notes="xIELU activation, llama3 rope, per-head q/k norm; unpruned head only",
    ),
    "AriaTextForCausalLM": Arch(
        "Aria (text)",
        notes="mixture of experts (softmax over the top-k logits) with shared experts",
        ort=f"GQA; {_TOPK_FIRST}",
    ),
    "BioGptForCausalLM": Arch("BioGPT", notes="learned positions, scaled embeddings, LayerNorm, GELU"),
    "CodeGenForCausalLM": Arch("CodeGen", notes="interleaved partial rotary, fused qkv, parallel attention + MLP"),
    "Cohere2MoeForCausalLM": Arch(
        "Cohere2-MoE",
        notes="Cohere2 with a mixture of experts (softmax over the top-k logits) and a shared expert",
        ort=f"GQA; {_TOPK_FIRST}",
        window=True,
    ),
    "CohereCompassForCausalLM": Arch(
        "Cohere Compass", notes="multimodal rope sections on text positions, logit scale, tied", window=True
    ),
    "CwmForCausalLM": Arch("CWM", notes="llama3 rope, global and sliding layers", window=True),
    "Dots1ForCausalLM": Arch(
        "dots.llm1",
        notes="mixture of experts (sigmoid scores, correction bias) with a shared expert, dense first layer, q/k norm",
        ort=f"GQA; {_SIGMOID}",
        window=True,
    ),
    "ErgoForCausalLM": Arch(
        "Ergo",
        notes="mixture of experts (relu^2 experts, sigmoid scores) with a shared expert, dense first layer, "
        "global/sliding layers, q/k scale, gated residuals",
        ort="GQA; per-expert MatMuls (relu^2 experts without a gate)",
        window=True,
    ),
    "ExaoneMoeForCausalLM": Arch(
        "EXAONE-MoE",
        notes="Exaone 4 with a mixture of experts (sigmoid scores, correction bias) and a shared expert, dense first "
        "layer",
        ort=f"GQA; {_SIGMOID}",
        window=True,
    ),
    "FlexOlmoForCausalLM": Arch(
        "FlexOlmo",
        notes="mixture of experts (not renormalised), q/k norm over all heads, post-norms",
        ort="GQA; MoE (decode)",
    ),
    "FlintForCausalLM": Arch(
        "Flint",
        notes="mixture of experts (sigmoid top-k, renormalised) with a shared expert, a dense first layer, attention "
        "sinks, sliding layers with rope, global layers without rotary",
        ort="GQA (attention sinks as head_sink); per-expert MatMuls (sigmoid routing)",
        window=True,
    ),
    "GPTNeoXJapaneseForCausalLM": Arch(
        "GPT-NeoX (ja)",
        notes="rotary, a bias added after the residual, tied",
        ort="portable attention (its own causal mask)",
    ),
    "GraniteSWAForCausalLM": Arch(
        "Granite-SWA",
        notes="Granite with sliding layers, attention sinks, per-layer rope theta",
        ort="GQA (attention sinks as head_sink)",
        window=True,
    ),
    "GraniteMoeSWAForCausalLM": Arch(
        "GraniteMoe-SWA",
        notes="GraniteMoE with sliding layers, attention sinks, per-layer rope theta",
        ort=f"GQA (attention sinks as head_sink); {_TOPK_FIRST}",
        window=True,
    ),
    "HeliumForCausalLM": Arch("Helium", notes="head_dim != hidden/heads"),
    "HYV3ForCausalLM": Arch(
        "HY-V3",
        notes="mixture of experts (sigmoid scores, correction bias) with a shared expert, dense first layer, per-head "
        "q/k norm",
        ort=f"GQA; {_SIGMOID}",
    ),
    "HyperCLOVAXForCausalLM": Arch(
        "HyperCLOVA X", notes="Granite's multipliers (embedding, residual, attention, logits) with post-norms"
    ),
    "Jais2ForCausalLM": Arch("Jais 2", notes="relu^2 MLP (no gate), LayerNorm, attention and MLP biases"),
    "Kolibri1ForCausalLM": Arch(
        "Kolibri 1",
        notes="mixture of experts (correction bias on the choice, sigmoid of the chosen logits) with a shared expert, "
        "sliding layers with rope, global layers without rotary, post-norms",
        ort=f"GQA; {_SIGMOID}",
        window=True,
    ),
    "LagunaForCausalLM": Arch(
        "Laguna",
        notes="mixture of experts (sigmoid scores, correction bias) with a shared expert, dense first layer, per-head "
        "output gate, per-layer-type partial rotary, sliding layers",
        ort=f"GQA; {_SIGMOID}",
        window=True,
    ),
    "MellumForCausalLM": Arch(
        "Mellum",
        notes="mixture of experts (renormalised), q/k norm, per-layer-type rope, sliding layers",
        ort="GQA; MoE (decode)",
        window=True,
    ),
    "MiniCPM5MoeForCausalLM": Arch(
        "MiniCPM5-MoE",
        notes="mixture of experts (sigmoid scores, correction bias, routed scaling) with a shared expert, dense first "
        "layer",
        ort=f"GQA; {_SIGMOID}",
    ),
    "MiniMaxM3VLForCausalLM": Arch(
        "MiniMax-M3",
        notes="full-attention layers (the indexer's sparse layers are refused), mixture of experts (clamped SwiGLU), "
        "per-head q/k norm, partial rotary",
        ort="GQA; per-expert MatMuls (clamped SwiGLU)",
    ),
    "ModernBertDecoderForCausalLM": Arch(
        "ModernBERT",
        notes="global and sliding layers (window local_attention / 2) with their own rope, LayerNorm without bias, "
        "GELU GLU, a prediction head",
        window=True,
    ),
    "NanoChatForCausalLM": Arch(
        "NanoChat", notes="weightless RMSNorm, q/k norm after the rotary, relu^2 MLP, final logit soft-capping"
    ),
    "NemotronForCausalLM": Arch("Nemotron", notes="LayerNorm (1 + weight), partial rotary, relu^2 MLP (no gate)"),
    "PersimmonForCausalLM": Arch("Persimmon", notes="partial rotary, per-head q/k LayerNorm, relu^2 MLP, fused qkv"),
    "SolarOpenForCausalLM": Arch(
        "Solar Open",
        notes="mixture of experts (sigmoid scores, correction bias) with a shared expert on every layer",
        ort=f"GQA; {_SIGMOID}",
    ),
    "VaultGemmaForCausalLM": Arch(
        "VaultGemma",
        notes="alternating sliding/global layers, attention and final logit soft-capping, no post-norms",
        window=True,
    ),
    # issue 43: multi-head latent attention, its own cache layout (``_latent_cache``)
    "DeepseekV2ForCausalLM": Arch(
        "DeepSeek-V2",
        notes="multi-head latent attention (latent + rope key cache), complex rotary, mixture of experts (softmax "
        "top-k, routed scaling) with shared experts, dense first layer",
        ort=f"{_MLA}; per-expert MatMuls (routed scaling)",
        cache=_latent_cache,
    ),
    "DeepseekV3ForCausalLM": Arch(
        "DeepSeek-V3",
        notes=(
            "multi-head latent attention (latent + rope key cache), q low-rank, interleaved rope, yarn, mixture "
            "of experts"
            " (sigmoid, group-limited top-k, routed scaling) with a shared expert, dense first layer"
        ),
        ort=f"{_MLA}; {_SIGMOID}",
        cache=_latent_cache,
    ),
    "Gemma3ForConditionalGeneration": Arch(
        "Gemma 3 VLM",
        refusals=(
            Refusal(
                "final_logit_softcapping",
                lambda v: v is not None,
                "Gemma3ForConditionalGeneration's head does not soft-cap the logits, Gemma3ForCausalLM's does, "
                "so its text decoder would not compute as the checkpoint does",
            ),
        ),
        notes="text decoder only (Gemma 3 text, from text_config); the vision tower is not exported",
        window=True,
        sliding_window_proved=True,
        text=TextDecoder(texts=("Gemma3ForCausalLM",)),
    ),
    "Mistral3ForConditionalGeneration": Arch(
        "Mistral 3 VLM",
        notes="text decoder only (Mistral, from text_config); the vision tower is not exported",
        window=True,
        sliding_window_proved=True,  # test_hf_multimodal.py exports its 4-token window --target onnx
        text=TextDecoder(texts=("MistralForCausalLM",)),
    ),
    # issue 43
    "Llama4ForCausalLM": Arch(
        "Llama 4 (text)",
        notes=(
            "chunked attention (rope layers), NoPE global layers with temperature tuning, L2 q/k norm,"
            " experts (top-1 sigmoid routing) with a shared expert between dense layers, complex rotary"
        ),
        ort="GQA (the chunk mask as its bias); dense experts (every expert runs every token)",
        chunked=True,
    ),
    "Llama4ForConditionalGeneration": Arch(
        "Llama 4 VLM",
        notes="text decoder only (Llama 4 text, from text_config); the vision tower is not exported",
        ort="GQA (the chunk mask as its bias); dense experts (every expert runs every token)",
        chunked=True,
        text=TextDecoder(texts=("Llama4ForCausalLM",), prefix="language_model.model", head="language_model.lm_head"),
    ),
    # issue 43: a recurrent state instead of a KV cache (plugins/hf/tiny_recurrent.py, mamba2_scan.py)
    "Mamba2ForCausalLM": Arch(
        "Mamba2",
        context=None,
        kv_heads=lambda cfg: int(cfg.num_heads),
        notes="state-space layers (conv window + SSM state per layer, fixed size): a chunked scan, the recurrence "
        "at decode",
        ort="portable (no attention: state-space layers)",
        cache=_mamba2_state,
        heads="num_heads",
        layer_types=("linear_attention",),
        static_state=_STATIC_STATE,
    ),
    # issue 43: Mamba v1's state (plugins/hf/tiny_mamba.py, mamba1_scan.py); no heads of its own: the
    # spec's one KV head of width 1 (heads = hidden_size) is unused, the cache layout gives the shapes
    "MambaForCausalLM": Arch(
        "Mamba",
        context=None,
        kv_heads=lambda cfg: 1,
        notes="state-space layers (Mamba v1: conv window + SSM state per channel, fixed size): a log-depth scan, the "
        "recurrence at decode",
        ort="portable (no attention: state-space layers)",
        cache=_mamba1_state,
        heads="hidden_size",
        layer_types=("linear_attention",),
    ),
    "FalconMambaForCausalLM": Arch(
        "FalconMamba",
        context=None,
        kv_heads=lambda cfg: 1,
        notes="Mamba v1 layers with RMS norms on dt, B and C (conv window + SSM state per channel, fixed size)",
        ort="portable (no attention: state-space layers)",
        cache=_mamba1_state,
        heads="hidden_size",
        layer_types=("linear_attention",),
    ),
    # issue 43: attention and Mamba v1 layers mixed (a hybrid cache; plugins/hf/tiny_mamba.py, mamba1_scan.py)
    "JambaForCausalLM": Arch(
        "Jamba",
        notes="Mamba v1 layers (conv window + SSM state per channel, fixed size; RMS norms on dt, B and C) between "
        "attention layers without rotary, mixture of experts on every other layer",
        ort="GQA; MoE (decode)",
        cache=_jamba_cache,
        layer_types=("linear_attention",),
    ),
    # issue 43: attention and Mamba2 layers mixed (a hybrid cache; plugins/hf/tiny_recurrent.py)
    "GraniteMoeHybridForCausalLM": Arch(
        "GraniteMoeHybrid",
        notes="Mamba2 layers (conv window + SSM state, fixed size) between attention layers (rope or NoPE), mixture "
        "of experts (softmax over the top-k logits) or dense, shared MLP, Granite's multipliers",
        ort=f"GQA; {_TOPK_FIRST}",
        cache=_mamba_hybrid_cache,
        layer_types=("linear_attention",),
        static_state=StaticStateProof(unparsed=_INT32_CUMSUM),
    ),
    "BambaForCausalLM": Arch(
        "Bamba",
        notes="Mamba2 layers (conv window + SSM state, fixed size) between attention layers (attn_layer_indices), "
        "partial rotary",
        cache=_mamba_hybrid_cache,
        layer_types=("linear_attention",),
        static_state=_STATIC_STATE,
    ),
    # issue 43: the two other Mamba2 hybrid layouts (plugins/hf/tiny_mamba_hybrids.py)
    "NemotronHForCausalLM": Arch(
        "Nemotron-H",
        notes="blocks of one mixer each: Mamba2 (grouped RMS-norm gate), attention without rotary, relu^2 MLP or "
        "mixture of experts (sigmoid scores, correction bias, shared expert); MLP and expert blocks carry no cache",
        ort="GQA; per-expert MatMuls (relu^2 experts without a gate)",
        cache=_nemotron_h_cache,
        layer_types=("linear_attention", "mlp", "moe"),
        window=True,  # NemotronHConfig has a sliding_window field (None in the published configs)
    ),
    "FalconH1ForCausalLM": Arch(
        "Falcon-H1",
        notes="attention (rotary) and a Mamba2 mixer side by side in every layer (each carries key, value, conv "
        "window and SSM state), muP multipliers (embedding, attention, SSM and its projection, MLP, LM head)",
        cache=_falcon_h1_cache,
        layer_types=("hybrid",),
    ),
    # issue 43: Gated DeltaNet and gated attention layers (hybrid cache; plugins/hf/tiny_qwen3_5.py, gated_deltanet.py)
    "Qwen3_5ForCausalLM": Arch(
        "Qwen3.5 (text)",
        notes="Gated DeltaNet layers (conv window + recurrent state, fixed size; fp32 at --fp16) between attention "
        "layers with an output gate, partial rotary, q/k norm",
        cache=_deltanet_hybrid_cache,
        layer_types=("linear_attention",),
        keep_fp32=_DELTANET_FP32,
    ),
    "Qwen3NextForCausalLM": Arch(
        "Qwen3-Next",
        notes="Gated DeltaNet layers (conv window + recurrent state, fixed size; fp32 at --fp16) between attention "
        "layers with an output gate, partial rotary, q/k norm, mixture of experts with a gated shared expert",
        ort="GQA; MoE (decode)",
        cache=_deltanet_hybrid_cache,
        layer_types=("linear_attention",),
        keep_fp32=_DELTANET_FP32,
    ),
    "Qwen3_5MoeForCausalLM": Arch(
        "Qwen3.5-MoE (text)",
        notes="Gated DeltaNet layers (conv window + recurrent state, fixed size; fp32 at --fp16) between attention "
        "layers with an output gate, partial rotary, q/k norm, mixture of experts with a gated shared expert",
        ort="GQA; MoE (decode)",
        cache=_deltanet_hybrid_cache,
        layer_types=("linear_attention",),
        keep_fp32=_DELTANET_FP32,
    ),
    # issue 43: short-convolution and attention layers (a hybrid cache; plugins/hf/tiny_lfm2.py, short_conv.py)
    "Lfm2ForCausalLM": Arch(
        "LFM2",
        notes="short-convolution layers (gated depthwise conv; a conv window per layer, fixed size, no SSM state) "
        "between attention layers (rotary, q/k norm), SwiGLU with an auto-adjusted width",
        cache=_short_conv_cache,
        layer_types=("conv",),
        static_state=_STATIC_STATE,
    ),
    "Lfm2MoeForCausalLM": Arch(
        "LFM2-MoE",
        notes="LFM2's short-convolution and attention layers, the first num_dense_layers with a dense MLP, the "
        "others a mixture of experts (sigmoid scores, an expert bias on the choice, normalised top-k)",
        ort=f"GQA; {_SIGMOID}",
        cache=_short_conv_cache,
        layer_types=("conv",),
    ),
    # issue 43: per-layer inputs, AltUp, Laurel, the activation-sparsity threshold (plugins/hf/tiny_gemma3n.py)
    "Gemma3nForCausalLM": Arch(
        "Gemma 3n (text)",
        cache=_shared_kv_cache,
        notes="per-layer inputs, AltUp, Laurel, activation-sparsity threshold, last layers reading an earlier "
        "layer's cache (shared_kv), sliding/global layers, q/k/v norm, soft-capping",
        ort="GQA (not on the layers that read another's cache)",
        window=True,
    ),
    # issue 43: per-layer head dims and KV heads, values = keys, proportional rope, per-layer inputs, shared KV
    # (plugins/hf/tiny_gemma4.py)
    "Gemma4ForCausalLM": Arch(
        "Gemma 4 (text)",
        cache=_gemma4_cache,
        refusals=(
            Refusal(
                "enable_moe_block",
                _truthy,
                "Gemma 4's mixture-of-experts block beside the MLP (26B-A4B) has no tiny case proving its router "
                "and experts yet",
            ),
            Refusal("use_bidirectional_attention", lambda v: v == "all", "non-causal attention is not a decoder"),
        ),
        notes="per-layer head dims and KV heads, values = keys on global layers, proportional rope, per-layer "
        "inputs, shared KV with a double-wide MLP, sliding/global layers, soft-capping",
        ort="GQA (not on layers of another head dim or KV heads than the first's, nor reading another's cache)",
        window=True,
        ropes=("proportional",),
        per_layer=("head_dim", "num_key_value_heads"),
    ),
}

# the class names published checkpoints' config.json give (``architectures``, for their own remote
# code) where transformers' port of the same model has another: read as that class (the same
# weights and math; transformers itself picks its class by ``model_type``)
ALIASES: Mapping[str, str] = {"PhiMoEForCausalLM": "PhimoeForCausalLM", "MPTForCausalLM": "MptForCausalLM"}
