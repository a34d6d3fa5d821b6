"""Why kiln refuses a Hugging Face architecture it does not export, in one line: the mechanism
kiln lacks and the nearest architecture it exports (``kiln plugins`` lists them all).

The mechanism is read from the class name (no text-generation head) and config.json's own traits
first (an encoder-decoder, ``kv_lora_rank``, a ``layer_types`` entry that is not attention,
state-space fields, per-layer or shared-KV fields, values of another head size than the keys...),
so an architecture kiln has never heard of is refused for the right reason too; then from
``FAMILIES`` (what a family's config does not show), then its sub-model configs (a vision or audio
tower); else the refusal says that no kiln test proves its generation yet.
``tests/export/test_hf_unsupported.py`` runs every architecture transformers ships through it.
Torch-free: it reads the config's dict, before transformers loads.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

__all__ = ["FAMILIES", "NOT_PROVED", "mechanism", "nearest", "refusal"]

NOT_PROVED = "no kiln test proves its generation against transformers' yet"

# by model_type, asked before any trait: a model that cannot run alone (a drafter fed by its target model)
_DRAFTERS: Mapping[str, str] = dict.fromkeys(
    ("gemma4_assistant", "gemma4_unified_assistant"),
    "Gemma 4's assistant (a drafter reading its target model's keys and values, shared_kv_states)",
)

# by model_type: the mechanism a family's config does not show by a trait
FAMILIES: Mapping[str, str] = {
    "rwkv": "RWKV time-mixing (a recurrent state, not a KV cache)",
    "xlstm": "xLSTM blocks (a recurrent state, not a KV cache)",
    "diffllama": "differential attention (two softmax maps subtracted)",
    "bitnet": "BitNet's ternary weights with quantized activations",
    "trocr": "the decoder of a vision encoder-decoder (cross-attention to image features)",
    "gpt_neo": "GPT-Neo's local attention layers (attention_types)",
    "cpmant": "CPM-Ant's segment embeddings and relative position buckets",
    "higgs_audio_v2": "audio-token generation (an audio codebook head beside the text head)",
    "moshi": "speech generation (a depth decoder over audio codebooks)",
    "doge": "dynamic mask attention (an input-dependent mask over the keys)",
    "hrm_text": "hierarchical recurrent reasoning modules (a recurrent state, not a KV cache)",
    "xglm": "XGLM's sinusoidal position table, regrown by a Python branch on the sequence length (torch.export cannot "
    "trace it)",
    "dbrx": "DBRX's experts, a Python loop over the experts a batch hits (torch.export cannot trace it)",
    "jetmoe": "JetMoE's mixture of attention heads, whose scatter-add ONNX Runtime's CPU cannot run at fp16 (its fp32 "
    "graphs pass)",
    "beam": "Beam's position-scaled queries on its layers without rotary at fp16 (its fp32 graphs pass; at fp16 the "
    "one-graph model fails kiln's parity)",
}

# what each non-attention layer kind of a layer-types list is
_LAYER_KINDS = {
    # the Gated DeltaNet (Qwen3.5, Qwen3-Next, Qwen3.5-MoE) and Mamba2 hybrids are in ARCHS, never asked here
    "linear_attention": "linear-attention or state-space (Mamba) layers",
    "mamba": "state-space (Mamba) layers",
    "conv": "short-convolution layers outside LFM2",
    "recurrent": "recurrent layers",
    "hybrid": "hybrid attention + state-space layers",
    "hybrid_sliding": "hybrid attention + state-space layers",
    "indexed_attention": "sparse attention picked by an indexer",
    "compressed_sparse_attention": "compressed sparse attention",
    "heavily_compressed_attention": "compressed sparse attention",
    "chunked_attention": "chunked attention",
    "mlp": "attention-free layers",
    "moe": "attention-free layers",
}
_ATTENTION_KINDS = ("full_attention", "sliding_attention", "attention", "global", "local")
_LAYER_LISTS = ("layer_types", "layers_block_type", "block_types", "layers_type")
_MAMBA = (
    "state-space (Mamba) layers outside Mamba, FalconMamba, Mamba2, Jamba, GraniteMoeHybrid, Bamba, Nemotron-H and "
    "Falcon-H1"
)
# a field of the config -> the mechanism it means
_FIELDS = {
    "kv_lora_rank": "multi-head latent attention outside DeepSeek-V2/V3",  # those two are in ARCHS, never asked here
    # Gemma3nForCausalLM and Gemma4ForCausalLM are in ARCHS, never asked here; their wrappers are
    "num_kv_shared_layers": "key/value caches shared across layers outside the Gemma 3n and Gemma 4 text decoders",
    "hidden_size_per_layer_input": "per-layer embeddings outside the Gemma 3n and Gemma 4 text decoders",
    "per_layer_config": "config attributes that vary by layer",
    # Llama4ForCausalLM is in ARCHS, never asked here
    "attention_chunk_size": "chunked attention outside Llama 4's text decoder",
    "cross_attention_layers": "cross-attention to image features",
    # the Mamba families in ARCHS are never asked here; the other state-space hybrids are
    "state_size": _MAMBA,
    "ssm_state_size": _MAMBA,
    "mamba_d_state": _MAMBA,
    "conv_L_cache": "short-convolution layers outside LFM2",
    "lru_width": "recurrent layers",
    "type_vocab_size": "a bidirectional encoder (BERT family) run as a decoder",
}
# sub-model configs that make a multimodal or composite model (what kiln does not export)
_TOWERS = {
    "vision_config": "vision",
    "audio_config": "audio",
    "vq_config": "image tokenizer",
    "audio_encoder_config": "audio",
}
_HEADS = re.compile(r"(ForCausalLM|ForConditionalGeneration|LMHeadModel|MTModel)$")  # the heads that generate text
_OWN_PARTS = (
    "text_config",
    "attn_config",
    "ffn_config",
    "per_layer_config",
    "quantization_config",
    "rope_scaling",
    "rope_parameters",
)


def _text(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def _layer_kinds(cfg: Mapping[str, Any]) -> str | None:
    for key in _LAYER_LISTS:
        kinds = cfg.get(key)
        if isinstance(kinds, (list, tuple)):
            other = sorted({str(k) for k in kinds} - set(_ATTENTION_KINDS))
            if other:
                what = " and ".join(dict.fromkeys(_LAYER_KINDS.get(k, f"{k!r}") for k in other))
                return f"{what} ({key}: {', '.join(other)})"
    return None


def _fields(cfg: Mapping[str, Any]) -> str | None:
    for key, what in _FIELDS.items():
        if cfg.get(key) not in (None, False, 0, {}, []):
            return f"{what} ({key})"
    return None


def _value_heads(cfg: Mapping[str, Any]) -> str | None:
    """Values of another head size than the keys (MiMo-V2-Flash): kiln's caches are one head size."""
    values, keys = cfg.get("v_head_dim"), cfg.get("head_dim")
    if isinstance(values, int) and isinstance(keys, int) and values != keys:
        return f"values of another head size than the keys (v_head_dim {values}, head_dim {keys})"
    return None


def _encoder_decoder(cfg: Mapping[str, Any], seq2seq: Collection[str]) -> str | None:
    if not cfg.get("is_encoder_decoder"):
        return None
    if "num_mel_bins" in cfg or "feature_size" in cfg:
        return "a speech encoder-decoder other than WhisperForConditionalGeneration (encoder and decoder together)"
    return f"an encoder-decoder other than {', '.join(sorted(seq2seq))}"


def _composite(cfg: Mapping[str, Any]) -> str | None:
    parts = sorted(
        k for k, v in cfg.items() if k.endswith("_config") and isinstance(v, Mapping) and k not in _OWN_PARTS
    )
    towers = sorted({_TOWERS[p] for p in parts if p in _TOWERS})
    if towers:
        return (
            f"a multimodal wrapper ({' and '.join(towers)} {'tower' if len(towers) == 1 else 'towers'}: "
            f"{', '.join(parts)})"
        )
    if parts:
        return f"a composite of sub-models ({', '.join(parts)})"
    if isinstance(cfg.get("text_config"), Mapping):
        return "a multimodal wrapper (text_config)"
    return None


def _head(arch: str, config: Mapping[str, Any]) -> str | None:
    if not config.get("architectures"):
        return "a config.json that names no architectures (the model class it was saved from)"
    if not _HEADS.search(arch):
        return (
            "a model without a text-generation head (kiln exports *ForCausalLM and *ForConditionalGeneration classes)"
        )
    return None


def mechanism(arch: str, config: Mapping[str, Any], seq2seq: Collection[str] = ()) -> str:
    """What kiln does not export that the class name or the config shows (its text decoder's
    first), else what ``FAMILIES`` names for its model_type, else ``NOT_PROVED``; ``seq2seq``:
    the encoder-decoders kiln exports."""
    text = _text(config)
    checks: tuple[Callable[[], str | None], ...] = (
        lambda: _head(arch, config),
        lambda: _DRAFTERS.get(str(config.get("model_type"))),
        lambda: _encoder_decoder(config, seq2seq),
        lambda: _fields(text) or _layer_kinds(text),
        lambda: _fields(config) or _layer_kinds(config),
        lambda: _value_heads(text),
        lambda: FAMILIES.get(str(text.get("model_type"))) or FAMILIES.get(str(config.get("model_type"))),
        lambda: _composite(config),
    )
    for check in checks:
        if found := check():
            return found
    return NOT_PROVED


def _stem(name: str) -> str:
    """An architecture's or model_type's name without its head suffix, lower case, letters and digits only."""
    name = _HEADS.sub("", name)
    return re.sub(r"[^a-z0-9]", "", name.lower()).removesuffix("text")


def _family(stem: str) -> str:
    """A stem's leading letters (``gemma3n`` -> ``gemma``)."""
    return re.sub(r"[^a-z].*$", "", stem)


def nearest(arch: str, config: Mapping[str, Any], supported: Collection[str]) -> str | None:
    """The supported architecture closest to ``arch``: of its family (the leading letters of its
    name or of its text decoder's model_type), the most similar name; else a near spelling."""
    stems = {
        _stem(s): s for s in sorted(supported, key=lambda s: s.endswith("ForCausalLM"))
    }  # a causal LM over a wrapper of its stem
    for name in (str(_text(config).get("model_type") or ""), arch):
        family = _family(_stem(name))
        kin = [s for s in stems if len(family) >= 3 and _family(s) == family]
        # the most similar without version digits, then its own name (llama: not llama4), then the latest
        # version (gemma4 -> gemma3)
        if kin:
            unversioned = re.sub(r"[0-9]", "", _stem(name))
            return stems[
                max(
                    kin,
                    key=lambda s: (
                        difflib.SequenceMatcher(None, unversioned, re.sub(r"[0-9]", "", s)).ratio(),
                        s == _stem(name),
                        s,
                    ),
                )
            ]
    close = difflib.get_close_matches(_stem(arch), list(stems), n=1, cutoff=0.85)
    return stems[close[0]] if close else None


def refusal(arch: str, config: Mapping[str, Any], supported: Collection[str], seq2seq: Collection[str] = ()) -> str:
    """The one line that refuses ``arch``: its mechanism, the nearest supported architecture."""
    why = mechanism(arch, config, seq2seq)
    alternative = nearest(arch, config, supported)
    near = f"the nearest kiln exports is {alternative}; " if alternative else ""
    return (
        f"unsupported Hugging Face architecture {arch!r}: "
        f"{why if why == NOT_PROVED else f'kiln does not export {why} yet'} ({near}`kiln plugins` lists them all)"
    )
