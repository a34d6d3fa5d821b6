"""The I/O contract of kiln's graphs (docs/commands.md, kiln export): every name and dim name comes from here.

Names follow the Hugging Face / ONNX Runtime GenAI convention; KV layout is BNSH
``[batch, n_kv_heads, seq, head_dim]``. Dims: ``batch``, ``seq``, ``past_seq``, ``total_seq``
(= past_seq + seq), and ``encoder_seq`` for cross-attention decoders.

What each layer carries is the spec's cache layout (``DecoderSpec.cache_layout``,
``plugins.cache_layout``): per layer a tuple of cache tensors ``[batch, heads, length, width]``,
each ``past_key_values.{i}.{name}`` in and ``present.{i}.{name}`` out with its own heads and
width. Every family but one caches ``key`` and ``value`` of ``n_kv_heads`` x ``head_dim`` (the
default layout, from those two numbers); multi-head latent attention (DeepSeek-V2/V3, layout kind
``latent``) caches under the same two names one head of the compressed latent
(``kv_lora_rank`` wide, as ``key``) and one of the rotated key (``qk_rope_head_dim``, as
``value``), and the manifest lists them (``kv_cache.kind`` and ``.tensors``). A state-space model
(Mamba2, layout kind ``state``) carries per layer a recurrent state of fixed sizes, ``conv`` ``[batch,
1, conv_kernel, conv_dim]`` and ``ssm`` ``[batch, heads, head_dim, state_size]`` (span ``state``: every
dim a number but batch); decode and the unified graph read it and return its replacement, prefill
starts from zeros and returns it, and a caller's empty past is its zeros (``contract.steps.empty_past``).
A hybrid (GraniteMoeHybrid, Bamba, Nemotron-H, Falcon-H1; layout kind ``hybrid``) carries per layer its
own: ``key``/``value`` (growing) on an attention layer, ``conv``/``ssm`` (fixed) on a Mamba2 layer, all
four on a layer with both (Falcon-H1), none on a layer with neither (Nemotron-H's MLP blocks), ``conv``
alone (fixed, no SSM state) on a short-convolution layer (LFM2).
Gemma 3n's last layers (layout kind ``shared_kv``) carry no cache tensor: each reads, inside the step,
an earlier layer's keys and values, so no graph takes or returns one for them (``kv_cache.reads``).
Gemma 4 (layout kind ``per_layer``, or ``shared_kv`` with such layers) caches ``key``/``value`` of each
layer's own heads and width (a sliding layer's and a global layer's differ), listed per tensor.

Cross-attention decoders (``spec.encoder_dim`` set): prefill also takes ``encoder_hidden_states``
``[batch, encoder_seq, encoder_dim]`` and returns every layer's cross-attention keys and values
once, as ``present.{i}.cross_key/.cross_value`` ``[batch, n_kv_heads, encoder_seq, head_dim]``;
decode and the unified graph take them back as ``past_key_values.{i}.cross_key/.cross_value``
and never return them (they do not grow). This is the split ONNX Runtime GenAI's encoder-decoder
models use (an init graph computes the cross cache; the decoder graph only reads it).

Encoder-decoders whose family exports the encoder too (``spec.has_encoder``: Hugging Face BART,
T5...) add a fourth graph, ``encoder``: ``input_ids`` and ``attention_mask`` ``[batch,
encoder_seq]`` -> ``encoder_hidden_states`` ``[batch, encoder_seq, encoder_dim]``, what prefill
then takes; and every decoder graph takes ``encoder_attention_mask`` ``[batch, encoder_seq]``
(int64, 1 = a real encoder token) after ``position_ids``, so a padded batch of encoder inputs
masks its padding in the cross-attention of every step. Pad the encoder's inputs on the right
(an encoder with absolute positions, BART's, numbers each row from 0); the decoder's
``position_ids`` are accepted but not read (its positions are its cache's length, as in
transformers), so a decoder input is never left-padded: every row starts from the start token.
(The native family's cross-attention reads states from the caller's own encoder, unmasked: it
has neither.)

A speech encoder-decoder (Whisper, ``spec.encoder_features = (n_mels, frames)``) has an encoder
graph on log-mel features instead: ``input_features`` ``[batch, n_mels, frames]`` (float, the
graphs' float dtype) -> ``encoder_hidden_states`` ``[batch, frames / 2, encoder_dim]``. The frame
count is fixed by the checkpoint (``2 * max_source_positions``: 3000 frames, 30 s of audio, for
every released Whisper), so both dims are numbers; shorter audio is padded by the feature
extractor, as transformers' does. Its encoder reads no mask, so its decoder graphs take no
``encoder_attention_mask``.
"""

from __future__ import annotations

import dataclasses
import enum

from kiln.plugins.base import DecoderSpec
from kiln.plugins.cache_layout import CacheTensor, Span

__all__ = [
    "CacheUpdate",
    "GraphKind",
    "TensorSpec",
    "GraphIO",
    "graph_io",
    "past_names",
    "present_names",
    "cross_past_names",
    "cross_present_names",
    "is_cross",
    "carried_cache",
    "kv_pairs",
    "ENCODER_STATES",
    "ENCODER_MASK",
    "ENCODER_FEATURES",
    "graph_kinds",
    "DECODER_KINDS",
    "ENC_SEQ",
    "ple_table_names",
    "BATCH",
    "SEQ",
    "PAST_SEQ",
    "TOTAL_SEQ",
]

BATCH, SEQ, PAST_SEQ, TOTAL_SEQ, ENC_SEQ = "batch", "seq", "past_seq", "total_seq", "encoder_seq"
ENCODER_STATES = "encoder_hidden_states"
ENCODER_MASK = "encoder_attention_mask"
ENCODER_FEATURES = "input_features"  # a speech encoder's log-mel input (spec.encoder_features)
Dim = str | int


class GraphKind(str, enum.Enum):
    PREFILL = "prefill"  # no past inputs; presents hold the prompt's keys and values
    DECODE = "decode"  # one new token; past grows by one
    UNIFIED = "model"  # seq >= 1, past_seq >= 0: the single graph ONNX Runtime GenAI wants
    ENCODER = "encoder"  # encoder-decoders (spec.has_encoder): the encoder's output, once per input


DECODER_KINDS = (GraphKind.PREFILL, GraphKind.DECODE, GraphKind.UNIFIED)


class CacheUpdate(str, enum.Enum):
    """How a graph set's decode step carries the KV cache, which its run loop must follow (the
    manifest records it per target: ``targets.<name>.kv_cache``; the portable graphs grow it)."""

    GROWN = "grown"  # present = past + the new token's keys/values: a new, longer buffer each step (Concat)
    SHARED = "shared"  # past and present bound to one buffer of fixed capacity, written in place (GroupQueryAttention)
    # the buffer is the graphs' own static input and output, written at write_indices (``contract.static_cache``)
    STATIC = "static"


def graph_kinds(spec: DecoderSpec) -> tuple[GraphKind, ...]:
    """The graphs an export of ``spec`` has: the decoder's three, and the encoder's when it has one."""
    return (*DECODER_KINDS, GraphKind.ENCODER) if spec.has_encoder else DECODER_KINDS


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: int64, float32, float16
    dims: tuple[Dim, ...]

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.dims)}


@dataclasses.dataclass(frozen=True)
class GraphIO:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"


def present_names(layer: int) -> tuple[str, str]:
    return f"present.{layer}.key", f"present.{layer}.value"


def cross_past_names(layer: int) -> tuple[str, str]:
    return f"past_key_values.{layer}.cross_key", f"past_key_values.{layer}.cross_value"


def cross_present_names(layer: int) -> tuple[str, str]:
    return f"present.{layer}.cross_key", f"present.{layer}.cross_value"


def is_cross(name: str) -> bool:
    """Whether a cache input or output name is a cross-attention one (``*.cross_key/value``)."""
    return ".cross_" in name


def carried_cache(spec: DecoderSpec) -> list[tuple[str, str]]:
    """``(past input, present output)`` pairs a caller carries from one step to the next, in
    input order: per layer its cache tensors (``spec.cache_layout``): the self-attention key and
    value, then (cross-attention decoders) the cross-attention key and value that only prefill
    returns; multi-head latent attention's latent and rope key under the same two names."""
    return [(f"past_key_values.{i}.{t.suffix}", f"present.{i}.{t.suffix}") for i, t in spec.cache_layout.tensors()]


def kv_pairs(n_layers: int, *, cross: bool = False) -> list[tuple[str, str]]:
    """``carried_cache`` for callers that know only the layer count (an export's manifest)."""
    pairs: list[tuple[str, str]] = []
    for i in range(n_layers):
        pairs += zip(past_names(i), present_names(i), strict=True)
        if cross:
            pairs += zip(cross_past_names(i), cross_present_names(i), strict=True)
    return pairs


def ple_table_names(index: int) -> tuple[str, str]:
    """Graph inputs of the folded PLE tables of the ``index``-th PLE sub-layer (``--ple-tables input``)."""
    return f"ple.{index}.scale", f"ple.{index}.shift"


def graph_io(
    spec: DecoderSpec,
    kind: GraphKind,
    *,
    last_logits_only: bool = False,
    kv_dtype: str = "float32",
    logits_dtype: str = "float32",
    ple_tables: tuple[tuple[int, int], ...] = (),
) -> GraphIO:
    """The inputs and outputs of one graph, in order.

    ``ple_tables`` lists the ``(rows, d_model)`` shape of each PLE sub-layer's tables when they
    are graph inputs (``--ple-tables input``); empty when they are constants.
    """
    if kind is GraphKind.ENCODER:
        return _encoder_io(spec, kv_dtype)
    seq: Dim = 1 if kind is GraphKind.DECODE else SEQ
    mask_len = SEQ if kind is GraphKind.PREFILL else TOTAL_SEQ
    kv_len = SEQ if kind is GraphKind.PREFILL else TOTAL_SEQ
    logits_len: Dim = 1 if (last_logits_only and kind is GraphKind.PREFILL) else seq

    inputs = [
        TensorSpec("input_ids", "int64", (BATCH, seq)),
        TensorSpec("attention_mask", "int64", (BATCH, mask_len)),
        TensorSpec("position_ids", "int64", (BATCH, seq)),
    ]
    if spec.has_encoder and spec.encoder_features is None:  # (a speech encoder's frames have no padding)
        inputs.append(TensorSpec(ENCODER_MASK, "int64", (BATCH, ENC_SEQ)))
    if spec.encoder_dim is not None and kind is GraphKind.PREFILL:
        inputs.append(TensorSpec(ENCODER_STATES, kv_dtype, (BATCH, ENC_SEQ, spec.encoder_dim)))
    layout = list(spec.cache_layout.tensors())
    if kind is not GraphKind.PREFILL:
        for i, t in layout:
            length = _length(t, PAST_SEQ)
            inputs.append(TensorSpec(f"past_key_values.{i}.{t.suffix}", kv_dtype, (BATCH, t.heads, length, t.width)))
    for i, shape in enumerate(ple_tables):
        for name in ple_table_names(i):
            inputs.append(TensorSpec(name, kv_dtype, shape))
    outputs = [TensorSpec("logits", logits_dtype, (BATCH, logits_len, spec.vocab_size))]
    for i, t in layout:
        if t.span is not Span.ENCODER or kind is GraphKind.PREFILL:  # the cross cache: prefill returns it once
            length = _length(t, kv_len)
            outputs.append(TensorSpec(f"present.{i}.{t.suffix}", kv_dtype, (BATCH, t.heads, length, t.width)))
    return GraphIO(tuple(inputs), tuple(outputs))


def _length(tensor: CacheTensor, grown: Dim) -> Dim:
    """A cache tensor's length dim: the encoder's, a recurrent state's fixed length, else ``grown``."""
    if tensor.span is Span.ENCODER:
        return ENC_SEQ
    return tensor.length if tensor.span is Span.STATE else grown


def _encoder_io(spec: DecoderSpec, dtype: str) -> GraphIO:
    assert spec.encoder_dim is not None and spec.has_encoder, "only an encoder-decoder has an encoder graph"
    if spec.encoder_features is not None:  # log-mel frames, a fixed count, halved by the stride-2 stem
        mels, frames = spec.encoder_features
        states = TensorSpec(ENCODER_STATES, dtype, (BATCH, frames // 2, spec.encoder_dim))
        return GraphIO((TensorSpec(ENCODER_FEATURES, dtype, (BATCH, mels, frames)),), (states,))
    ids = (TensorSpec("input_ids", "int64", (BATCH, ENC_SEQ)), TensorSpec("attention_mask", "int64", (BATCH, ENC_SEQ)))
    return GraphIO(ids, (TensorSpec(ENCODER_STATES, dtype, (BATCH, ENC_SEQ, spec.encoder_dim)),))
