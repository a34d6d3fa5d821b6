"""The Hugging Face encoder-decoders kiln exports (BART, mBART, Marian, T5), what their configs
say, and their tiny test models.

An encoder-decoder is exported as four graphs (``contract.io``): ``encoder`` (input ids and mask
-> ``encoder_hidden_states``), and the decoder's prefill (which takes the encoder states and
returns every layer's cross-attention keys and values once, ``present.{i}.cross_key/value``),
decode and the unified graph (which take the cross cache back and never grow it), all with
``encoder_attention_mask``. The modules are transformers' own (``decoder.HFSeq2Seq`` flattens its
``EncoderDecoderCache``), so parity is against Hugging Face's implementation and its
``generate()``. Whisper's encoder reads log-mel features instead of token ids (``features``:
its encoder graph takes ``input_features``, ``contract.io``); its tiny model is in ``speech``.

This module stays free of torch (``kiln plugins`` lists it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from kiln.errors import CheckpointError
from kiln.plugins.base import DecoderSpec
from kiln.plugins.hf.archs import Refusal
from kiln.plugins.hf.config import refuse_quantized, refuse_sizes

__all__ = ["SEQ2SEQ", "SEQ2SEQ_TINY", "Seq2SeqArch", "read_seq2seq_spec", "refuse_seq2seq"]


@dataclasses.dataclass(frozen=True)
class Seq2SeqArch:
    label: str  # its name in docs/architectures.md (kiln plugins' table)
    layers: str  # the config field of the decoder's depth
    heads: str  # ... and of its attention heads
    context: str | None = "max_position_embeddings"  # None: relative positions, no limit of its own
    refusals: tuple[Refusal, ...] = ()
    notes: str = ""
    features: str | None = None  # a speech encoder's mel-bin count field: its encoder takes log-mel features
    # what --target ort does with it (``kiln plugins``' column; tests/export/test_seq2seq_ort.py)
    ort: str = "GQA (self-attention; cross and encoder portable)"


_UNSHARED_VOCAB = Refusal(
    "share_encoder_decoder_embeddings",
    lambda v: v is False,
    "separate source and target vocabularies (the encoder graph's ids would need their own vocabulary size in "
    "the contract)",
)

SEQ2SEQ: Mapping[str, Seq2SeqArch] = {
    "BartForConditionalGeneration": Seq2SeqArch(
        "BART",
        "decoder_layers",
        "decoder_attention_heads",
        notes="learned positions (offset 2), post-LayerNorm, tied head",
    ),
    "MBartForConditionalGeneration": Seq2SeqArch(
        "mBART", "decoder_layers", "decoder_attention_heads", notes="pre-LayerNorm, final layer norms, scaled embedding"
    ),
    "MarianMTModel": Seq2SeqArch(
        "Marian",
        "decoder_layers",
        "decoder_attention_heads",
        refusals=(_UNSHARED_VOCAB,),
        notes="sinusoidal positions, final_logits_bias, scaled embedding",
    ),
    "T5ForConditionalGeneration": Seq2SeqArch(
        "T5",
        "num_decoder_layers",
        "num_heads",
        context=None,
        ort="portable (relative position bias); norms fused",
        notes="relative position buckets (no context limit of its own: --max-context), RMS norm, rescaled tied head; "
        "v1.1/Flan-T5: gated GELU, untied head",
    ),
    "WhisperForConditionalGeneration": Seq2SeqArch(
        "Whisper",
        "decoder_layers",
        "decoder_attention_heads",
        context="max_target_positions",
        features="num_mel_bins",
        notes="speech: log-mel input_features (fixed 2 x max_source_positions frames, kiln generate --features), "
        "conv stem, learned decoder positions, tied head",
    ),
}


def refuse_seq2seq(cfg: Any, arch: str) -> None:
    """Raise ``CheckpointError`` naming the first config value kiln does not export exactly."""
    refuse_sizes(cfg, arch, (SEQ2SEQ[arch].heads, SEQ2SEQ[arch].layers, SEQ2SEQ[arch].context))
    refuse_quantized(cfg, arch)
    for refusal in SEQ2SEQ[arch].refusals:
        value = getattr(cfg, refusal.field, None)
        if refusal.refused(value):
            raise CheckpointError(f"{arch}: {refusal.field}={value!r} is not supported: {refusal.why}")
    if _start_token(cfg) is None:
        raise CheckpointError(
            f"{arch}: the config has no decoder_start_token_id (nor a bos_token_id): the decoder's first token "
            "is unknown"
        )


def _start_token(cfg: Any) -> int | None:
    for name in ("decoder_start_token_id", "bos_token_id"):
        value = getattr(cfg, name, None)
        if value is not None:
            return int(value)
    return None


def _token(cfg: Any, name: str) -> int | None:
    value = getattr(cfg, name, None)
    return int(value[0] if isinstance(value, list) else value) if value is not None else None


def read_seq2seq_spec(cfg: Any, arch: str, family: str) -> DecoderSpec:
    """The decoder's spec (its own depth and heads), with the encoder graph switched on."""
    a = SEQ2SEQ[arch]
    hidden, heads = int(cfg.d_model), int(getattr(cfg, a.heads))
    context = getattr(cfg, a.context, None) if a.context is not None else None
    return DecoderSpec(
        family=family,
        n_layers=int(
            getattr(cfg, a.layers) or cfg.num_hidden_layers
        ),  # T5: num_decoder_layers None means as deep as the encoder
        n_kv_heads=heads,
        head_dim=int(getattr(cfg, "d_kv", None) or hidden // heads),
        vocab_size=int(cfg.vocab_size),
        max_context=int(context) if context is not None else None,
        max_context_why=None
        if context is not None
        else f"{arch}'s relative position buckets have no context length of their own",
        bos_token_id=_token(cfg, "bos_token_id"),
        eos_token_id=_token(cfg, "eos_token_id"),
        pad_token_id=_token(cfg, "pad_token_id"),
        encoder_dim=hidden,
        has_encoder=True,
        decoder_start_token_id=_start_token(cfg),
        # Whisper's encoder: a stride-2 stem over 2 x max_source_positions frames of num_mel_bins
        encoder_features=(int(getattr(cfg, a.features)), 2 * int(cfg.max_source_positions)) if a.features else None,
        config={
            "architecture": arch,
            **{k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))},
        },
    )


V, H, L, NH, FF, CTX = 128, 64, 2, 4, 128, 64
_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
_BART_LIKE = dict(
    **_IDS, vocab_size=V, d_model=H, encoder_layers=L, decoder_layers=L, encoder_attention_heads=NH,
    decoder_attention_heads=NH, encoder_ffn_dim=FF, decoder_ffn_dim=FF, max_position_embeddings=CTX,
    init_std=0.3,  # transformers' 0.02 gives a tiny random model constant outputs: no test at all
)  # fmt: skip


def _cfg(config: str, **kw: Any) -> Callable[..., Any]:
    def make(t: Any, **o: Any) -> Any:
        return getattr(t, config)(**{**kw, **o})

    return make


# (architecture, (transformers, **overrides) -> config): 2 encoder and 2 decoder layers, hidden 64
SEQ2SEQ_TINY: Mapping[str, tuple[str, Callable[..., Any]]] = {
    "bart": ("BartForConditionalGeneration", _cfg("BartConfig", **_BART_LIKE, decoder_start_token_id=2)),
    "mbart": (
        "MBartForConditionalGeneration",
        _cfg("MBartConfig", **_BART_LIKE, decoder_start_token_id=2, scale_embedding=True),
    ),
    "marian": ("MarianMTModel", _cfg("MarianConfig", **_BART_LIKE, decoder_start_token_id=0, scale_embedding=True)),
    "t5": (
        "T5ForConditionalGeneration",
        _cfg(
            "T5Config",
            **_IDS,
            vocab_size=V,
            d_model=H,
            d_kv=16,
            d_ff=FF,
            num_layers=L,
            num_decoder_layers=L,
            num_heads=NH,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=20,
            decoder_start_token_id=0,
            initializer_factor=8.0,
        ),
    ),  # fmt: skip
    "t5-gated": (  # T5 v1.1 / Flan-T5: gated-GELU feed-forward, untied head (no rescale)
        "T5ForConditionalGeneration",
        _cfg(
            "T5Config",
            **_IDS,
            vocab_size=V,
            d_model=H,
            d_kv=16,
            d_ff=FF,
            num_layers=L,
            num_decoder_layers=L,
            num_heads=NH,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=20,
            decoder_start_token_id=0,
            initializer_factor=1.5,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
        ),
    ),  # fmt: skip
}
