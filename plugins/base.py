"""What a model family gives the exporter.

A family knows how to recognise and load one kind of checkpoint and hands back a
``LoadedModel``: a ``torch.nn.Module`` that follows the decoder contract plus a ``DecoderSpec``
with the numbers the exporter needs. The exporter never looks inside a family.

The decoder contract (every family's module implements it)::

    module(input_ids [B, S] int64, attention_mask [B, past + S] int64, position_ids [B, S] int64,
           past_key_values: list[(key, value)] | None, last_logits_only: bool = False,
           encoder_hidden_states: [B, E, encoder_dim] float | None = None)
        -> (logits [B, S or 1, vocab] float, presents: list[(key, value)])

with keys and values ``[B, n_kv_heads, past + S, head_dim]`` (BNSH), or per layer the tensors
of ``DecoderSpec.cache_layout`` in its order (multi-head latent attention: the latent and the
rope key, ``plugins.cache_layout``). A cross-attention decoder
(``DecoderSpec.encoder_dim`` set) takes ``encoder_hidden_states`` when it has no past and returns
per layer ``(key, value, cross_key, cross_value)``, the cross-attention keys and values
``[B, n_kv_heads, E, head_dim]`` computed from the encoder states; with a past it takes the same
four tensors per layer back and computes nothing from the encoder again. An encoder-decoder
(``DecoderSpec.has_encoder``) also takes ``encoder_attention_mask: [B, E] int64`` on every call
and has ``module.encode(input_ids [B, E], attention_mask [B, E]) -> [B, E, encoder_dim]``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kiln.plugins.cache_layout import CacheLayout

if TYPE_CHECKING:  # importing kiln.plugins.base must stay cheap: the CLI reads specs without torch
    from torch import Tensor, nn

__all__ = [
    "MAX_DIM",
    "DecoderSpec",
    "LayerPlan",
    "LoadedModel",
    "ModelFamily",
    "PLEExtendMode",
    "PLEFolding",
    "PLETables",
    "StaticStateProof",
    "TextDecoderOf",
    "dim_error",
    "non_finite",
]

# the largest dimension a config may give: TensorRT's dimensions and ONNX Runtime GenAI's config are 32-bit
MAX_DIM = 2**31 - 1


def _shown(value: object) -> str:
    """``repr(value)``, but a huge integer by its number of digits (no 400-digit line)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    return repr(value)


def dim_error(name: str, value: object) -> str | None:
    """Why ``value`` cannot be the model dimension ``name`` (a positive integer up to ``MAX_DIM``), or None."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return f"{name} must be a positive integer, found {_shown(value)}"
    if value > MAX_DIM:
        return (
            f"{name} must be at most 2**31 - 1 (TensorRT's and ONNX Runtime GenAI's dimensions are 32-bit), found "
            f"{_shown(value)}"
        )
    return None


class PLEExtendMode(str, enum.Enum):
    CLAMP = "clamp"  # positions past the trained table reuse its last row
    INTERPOLATE = "interpolate"  # position interpolation: row p samples the table at p*(M-1)/(N-1)


class PLETables(str, enum.Enum):
    CONSTANT = "constant"  # folded tables are initializers in the weights file
    INPUT = "input"  # folded tables are graph inputs (serving stacks that swap them)


class PLEFolding(Protocol):
    """How a family with position-aware linear embeddings (PLE) lets the exporter fold them into
    constant tables (docs/how-it-works.md, fold). A PLE sub-layer, folded or not, is called as
    ``sub(x [B, S, d], positions [B, S]) -> [B, S, d]``."""

    def fold(self, module: nn.Module) -> nn.Module:
        """A copy of ``module`` with every PLE sub-layer folded, sharing its parameters."""
        ...

    def extend(self, module: nn.Module, rows: int, mode: PLEExtendMode) -> None:
        """Replace every (unfolded) PLE table of ``module`` by a ``rows``-row one, in place."""
        ...

    def sublayers(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        """Every PLE sub-layer of ``module`` (folded or not), in module order."""
        ...

    def tables(self, folded: nn.Module) -> list[tuple[Tensor, Tensor]]:
        """The ``(scale, shift)`` tables ``[rows, d]`` of every folded sub-layer, in module order."""
        ...


@dataclasses.dataclass(frozen=True)
class TextDecoderOf:
    """A multimodal checkpoint exported as its text decoder alone: the wrapper's class, the text
    decoder's module in it, and the wrapper's modules the export leaves out (its vision tower)."""

    architecture: str  # the checkpoint's class (Gemma3ForConditionalGeneration)
    prefix: str  # the text decoder's module path in it (model.language_model)
    not_exported: tuple[str, ...]  # the wrapper's other modules (model.vision_tower, ...)


@dataclasses.dataclass(frozen=True)
class StaticStateProof:
    """What a family declares of its recurrent state (a ``state`` or ``hybrid`` cache) in graphs of
    ONNX's own ops whose state is a plain input and output beside a static key/value cache (the
    ``--target onnx`` graphs, ``exporter/targets/onnx/states.py``): the precisions a test proves it
    at there, or why its trace cannot be written so. A family that declares nothing is not proved."""

    precisions: tuple[str, ...] = ()  # the precisions' values a test proves ("fp32", "fp16"); empty: none
    unparsed: str | None = None  # why its trace holds an op TensorRT's ONNX parser is not documented to take


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """The shape of a decoder as the exporter sees it."""

    family: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    # longest context the model supports (positions 0 .. max_context - 1); None: no limit of its
    # own (ALiBi extrapolates), the export must say (--max-context)
    max_context: int | None
    ple_positions: int | None = None  # rows of the PLE tables, when the model has PLE
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    encoder_dim: int | None = None  # width of encoder_hidden_states; set when the decoder has cross-attention
    # an encoder-decoder whose module also runs its encoder (``module.encode(input_ids,
    # attention_mask) -> states``) and whose decoder reads ``encoder_attention_mask``
    has_encoder: bool = False
    decoder_start_token_id: int | None = None  # the decoder's first input token (encoder-decoders)
    # a speech encoder-decoder (Whisper): ``(n_mels, frames)`` of the log-mel ``input_features``
    # ``[batch, n_mels, frames]`` its encoder takes instead of token ids (``module.encode_features``),
    # the frame count fixed by the checkpoint; its decoder graphs take no ``encoder_attention_mask``
    encoder_features: tuple[int, int] | None = None
    dtype: str = "float32"  # the checkpoint's floating-point dtype, as the module holds it (float32, bfloat16, float16)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # the family's own config, for the manifest
    max_context_why: str | None = (
        None  # why max_context is what it is, when it is not the config's own limit (errors say it)
    )
    text_decoder_of: TextDecoderOf | None = (
        None  # set when the checkpoint is a multimodal wrapper and this is its text decoder
    )
    # what each layer caches when it is not keys and values of n_kv_heads x head_dim (``cache_layout``)
    cache: CacheLayout | None = None
    # --fp16: the fp32 islands the family's own computation needs beyond the default policy
    # (``exporter.precision.policy`` rules: a Gated DeltaNet's delta rule, ``*.linear_attn``)
    keep_fp32: tuple[str, ...] = ()
    # its recurrent state in graphs of ONNX's own ops with a static cache: proved, or why not (``StaticStateProof``)
    static_state: StaticStateProof | None = None
    # its sliding window is what its config says (``sliding_window``, on the layers ``layer_types`` names
    # ``sliding_attention``, else on every layer) and its forward applies it so (a query at slot i sees j > i - window),
    # proved by a test whose window is shorter than its parity run; False: a window is refused, never guessed
    # (``--target onnx``: ``exporter/targets/onnx/windows.py``)
    sliding_window_proved: bool = False

    def __post_init__(self) -> None:
        if self.cache is not None and len(self.cache.layers) != self.n_layers:
            raise ValueError(
                f"the cache layout describes {len(self.cache.layers)} layers, the decoder has {self.n_layers}"
            )  # a family's bug

    @property
    def cache_layout(self) -> CacheLayout:
        """Every layer's cache tensors: the family's own layout, else keys and values of
        ``n_kv_heads`` x ``head_dim`` (and a cross-attention decoder's cross cache)."""
        return self.cache or CacheLayout.kv(
            self.n_layers, self.n_kv_heads, self.head_dim, cross=self.encoder_dim is not None
        )


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """How the exporter may trace a family's decoder one layer per structure and stamp the rest
    (``exporter.trace``): export time then does not grow with depth.

    ``prefix`` is layer i's module path in the family's module, with ``{}`` for i
    (``"layers.{}"``); layers with equal ``signatures`` compute the same graph up to their weights
    (and read nothing of another layer but the hidden state the one before hands on);
    ``template(n)`` builds the model with only its first ``n`` layers on the meta device (no
    weights, no memory), with the same forward contract. A family that cannot promise this gives
    no plan and is traced whole."""

    prefix: str
    signatures: tuple[Hashable, ...]
    template: Callable[[int], nn.Module]


@dataclasses.dataclass
class LoadedModel:
    module: nn.Module  # in eval mode, on the CPU, in the checkpoint's own dtype (``spec.dtype``)
    spec: DecoderSpec
    source: Path  # the checkpoint directory or file it came from
    tokenizer: Path | None = None  # a tokenizer.json beside the checkpoint, when there is one
    files: tuple[Path, ...] = ()  # the checkpoint files that were read (hashed for caches and the manifest)
    ple: PLEFolding | None = None  # set by families whose decoder has PLE sub-layers
    layers: LayerPlan | None = None  # set by families whose layers can be traced once and stamped
    # set by families whose one-token step has a form of its own (a recurrent mixer's update, not its scan on
    # one position): decode.onnx is then traced at a static length of one, not derived from the unified graph
    decode_traced: bool = False
    # the checkpoint's own files that its usual consumers want beside the graphs (Hugging Face's
    # config.json and generation_config.json, for Optimum), copied into the export's onnx/
    serving_files: tuple[Path, ...] = ()
    # ONNX translations of custom ops the family's code calls (torch.onnx.export's
    # custom_translation_table: op overload -> onnxscript function), e.g. transformers' expert kernel
    translations: Mapping[Any, Callable[..., Any]] = dataclasses.field(default_factory=dict)


@runtime_checkable
class ModelFamily(Protocol):
    """One model family: registered in ``kiln.plugins`` or through the ``kiln.plugins`` entry-point group."""

    name: str
    description: str

    def claims(self, config: dict[str, Any]) -> bool:
        """True when a checkpoint's ``config.json`` belongs to this family."""
        ...

    def load(self, path: Path) -> LoadedModel:
        """Load and validate a checkpoint; raise ``CheckpointError``/``ConfigError`` naming the problem."""
        ...

    def tiny(self, seed: int) -> LoadedModel:
        """A tiny randomly initialised model of this family, for tests."""
        ...

    # Optional (``kiln plugins`` calls them when a family has them):
    #   config_spec(path) -> DecoderSpec: the spec the config alone gives, validated, no weight
    #     read (what an export checks --max-context against before loading);
    #   table() -> list[list[str]]: what the family exports, a header row first;
    #   specs() -> list[DecoderSpec]: one per row of table(), its structure as the export's
    #     refusals read it (no weights): kiln plugins adds what each row takes per precision and
    #     target (``kiln.exporter.support``) after the row's first cell;
    #   unavailable() -> str | None: why it cannot load a checkpoint here (a missing dependency).
    # A family's module is imported to list it: it should import torch and its libraries lazily.


def non_finite(tensor: Tensor, slice_elements: int = 1 << 24) -> int:
    """How many NaN/Inf values a float tensor holds, counted slice by slice: a memory-mapped
    checkpoint tensor is read once and no mask of its full size is ever made. A slice whose min
    and max are finite holds none (a NaN makes both NaN, an Inf is one of them): that one pass
    without a mask clears a sound checkpoint, several times faster than the mask and its count,
    which only a slice that fails it pays."""
    import torch

    from kiln.file_pages import release_file_pages

    flat = tensor.detach().reshape(-1)
    count = sum(
        0 if _finite_range(part) else int((~torch.isfinite(_countable(part))).sum())
        for part in (flat[i : i + slice_elements] for i in range(0, flat.numel(), slice_elements))
    )
    release_file_pages([tensor])  # read: its file's pages go back to the page cache (``kiln.file_pages``)
    return count


def _countable(part: Tensor) -> Tensor:
    """The slice in a dtype torch's ``isfinite`` takes: fp8 slices (torch 2.13 has no ``aminmax`` for
    them and no ``isfinite`` for e4m3fn) widened to float32, which keeps every NaN and Inf."""

    return part.float() if part.dtype.is_floating_point and part.element_size() == 1 else part


def _finite_range(part: Tensor) -> bool:
    """Whether a slice's min and max are both finite; False where torch has no min/max for its
    dtype (complex): the mask then counts."""
    import torch

    try:
        low, high = torch.aminmax(part)
    except RuntimeError:  # NotImplementedError too: "aminmax_cpu" not implemented for 'ComplexFloat'
        return False
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))
