"""A transformers config -> kiln's ``DecoderSpec``, by the standard field names, and the refusals.

Standard fields (resolved through each config's ``attribute_map``, so GPT-2's ``n_head`` is
``num_attention_heads``): ``num_attention_heads``, ``num_key_value_heads`` (absent: every head),
``head_dim`` (absent or None: hidden / heads), ``hidden_size``, ``num_hidden_layers``,
``vocab_size`` and ``max_position_embeddings``; ``archs.ARCHS`` overrides only what differs.

Refused by name, in one line (never guessed): sizes that are no positive 32-bit integers or whose
heads do not divide (``refuse_sizes``, before any weight is read), attributes that vary by layer
(``refuse_per_layer``), a rope type kiln does not
prove, a layer type other than full or sliding attention, a quantized checkpoint, an
encoder-decoder, and each architecture's own ``Refusal`` entries.

``read_spec``'s ``config`` (the manifest's) is the config's own fields plus the standard names
its ``attribute_map`` resolves (GPT-2's ``n_head`` is also written as ``num_attention_heads``),
so a consumer reads every family's sizes by the standard names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kiln.errors import CheckpointError
from kiln.plugins.base import DecoderSpec, dim_error
from kiln.plugins.hf.archs import ARCHS, Arch

__all__ = [
    "LAYER_TYPES",
    "SIZES",
    "STATIC_ROPE",
    "read_spec",
    "refuse",
    "refuse_per_layer",
    "refuse_quantized",
    "refuse_sizes",
    "rope_types",
]

SIZES = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
)  # every architecture's, by the standard names

# rope types whose frequencies are fixed at init (traced as constants), and longrope, whose
# switch at original_max_position_embeddings is traced as a Where on max(position_ids)
STATIC_ROPE = ("default", "linear", "yarn", "llama3", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")
_ROPE_WHY = {
    "dynamic": (
        "dynamic NTK recomputes its frequencies from the sequence length at run time and keeps them on the module "
        "between calls (a data-dependent, stateful branch a traced graph cannot reproduce)"
    ),
}


def rope_types(cfg: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every ``(rope_type, parameters)`` the config's ``rope_parameters`` holds (Gemma 3 has one
    set per layer type)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    sets = params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]
    for p in sets:
        yield str(p.get("rope_type", "default")), dict(p)


def refuse_quantized(cfg: Any, arch: str) -> None:
    """Every Hugging Face checkpoint kiln reads is a float one (decoders and encoder-decoders alike)."""
    if getattr(cfg, "quantization_config", None):
        method = (
            dict(cfg.quantization_config).get("quant_method", "?")
            if isinstance(cfg.quantization_config, dict)
            else type(cfg.quantization_config).__name__
        )
        raise CheckpointError(
            f"{arch}: quantization_config ({method}) is not supported: kiln exports float checkpoints (its "
            "--int8/--fp16 quantize them)"
        )


def _per_layer(cfg: Any, arch: str) -> list[Any]:
    """The configs to read sizes from: each layer's (``per_layer_config``) where ``ARCHS[arch]`` reads
    attributes per layer and the config varies them, else the config itself."""
    if arch in ARCHS and ARCHS[arch].per_layer and getattr(cfg, "is_heterogeneous", False):
        return [cfg.per_layer_config[i] for i in range(int(cfg.num_hidden_layers))]
    return [cfg]


def refuse_sizes(cfg: Any, arch: str, optional: tuple[str | None, ...] = ()) -> None:
    """Every size in ``SIZES`` (and each of ``optional`` the config sets) is a positive 32-bit integer
    (in every layer's config where they vary by layer)."""
    own = ARCHS[arch].heads if arch in ARCHS else "num_attention_heads"  # a state-space model's heads: num_heads
    for layer in _per_layer(cfg, arch):
        for name in (*(own if n == "num_attention_heads" else n for n in SIZES), *optional):
            value = getattr(layer, name, None) if name is not None else None
            if (name in SIZES or value is not None) and (problem := dim_error(str(name), value)):
                raise CheckpointError(f"{arch}: {problem} in config.json")


def _kv_heads(cfg: Any, a: Arch) -> int:
    """The heads the cache holds: the architecture's rule, else ``num_key_value_heads`` (absent: every head)."""
    return (
        a.kv_heads(cfg)
        if a.kv_heads is not None
        else int(getattr(cfg, "num_key_value_heads", None) or getattr(cfg, a.heads))
    )


def _refuse_heads(cfg: Any, arch: str) -> None:
    """The heads split the hidden size (unless the config gives ``head_dim``) and share the KV heads evenly."""
    for layer in _per_layer(cfg, arch):
        heads, hidden = getattr(layer, ARCHS[arch].heads), layer.hidden_size
        if getattr(layer, "head_dim", None) is None and hidden % heads:
            raise CheckpointError(
                f"{arch}: num_attention_heads ({heads}) does not divide hidden_size ({hidden}), and config.json "
                "gives no head_dim"
            )
        kv = _kv_heads(layer, ARCHS[arch])
        if heads % kv:
            raise CheckpointError(
                f"{arch}: num_attention_heads ({heads}) is not a multiple of the key/value heads ({kv})"
            )


def refuse_per_layer(cfg: Any, arch: str) -> None:
    """A config whose attributes vary by layer (transformers' ``per_layer_config``: reading one
    of them globally raises) is refused by name: kiln reads each size once, for every layer, except the
    attributes ``ARCHS[arch].per_layer`` reads per layer (Gemma 4's head dims and KV heads)."""
    varying = getattr(cfg, "per_layer_attributes", None) if getattr(cfg, "is_heterogeneous", False) else None
    varying = set(varying or ()) - set(ARCHS[arch].per_layer if arch in ARCHS else ())
    if varying:
        raise CheckpointError(
            f"{arch}: config attributes that vary by layer (per_layer_config: {', '.join(sorted(varying))}) are "
            "not supported yet"
        )


def refuse(cfg: Any, arch: str) -> None:
    """Raise ``CheckpointError`` naming the first config value kiln does not export exactly."""
    where = f"{arch}"
    refuse_per_layer(cfg, arch)
    refuse_sizes(cfg, arch, ("num_key_value_heads", "head_dim", ARCHS[arch].context))
    _refuse_heads(cfg, arch)
    refuse_quantized(cfg, arch)
    if getattr(cfg, "is_encoder_decoder", False):
        raise CheckpointError(
            f"{where}: is_encoder_decoder is not supported: kiln exports decoder-only Hugging Face models"
        )
    for rope_type, _ in rope_types(cfg):
        if rope_type not in (*STATIC_ROPE, *ARCHS[arch].ropes):
            why = _ROPE_WHY.get(rope_type, f"kiln proves {', '.join(STATIC_ROPE)}")
            raise CheckpointError(f"{where}: rope_type {rope_type!r} is not supported: {why}")
    proved = (*LAYER_TYPES, *(("chunked_attention",) if ARCHS[arch].chunked else ()), *ARCHS[arch].layer_types)
    kinds = sorted(set(getattr(cfg, "layer_types", None) or ()) - set(proved))
    if kinds:
        raise CheckpointError(
            f"{where}: layer_types {kinds} are not supported: kiln exports {', '.join(proved)} layers"
        )
    for refusal in ARCHS[arch].refusals:
        value = _field(cfg, refusal.field)
        if refusal.refused(value):
            raise CheckpointError(f"{where}: {refusal.field}={value!r} is not supported: {refusal.why}")


def _field(cfg: Any, name: str) -> Any:
    """A config field, or the rope parameter of that name (transformers 5 moves legacy rope keys
    such as ``partial_rotary_factor`` into ``rope_parameters``)."""
    value = getattr(cfg, name, None)
    if value is None:
        for _, params in rope_types(cfg):
            value = params.get(name, value)
    return value


def _longrope_limit(cfg: Any, arch: str) -> int | None:
    """Phi-3 (and its kin) with longrope: the context up to which generate() is a plain KV-cache loop."""
    if arch != "Phi3ForCausalLM":
        return None
    for rope_type, params in rope_types(cfg):
        original = params.get("original_max_position_embeddings") or getattr(
            cfg, "original_max_position_embeddings", None
        )
        if rope_type == "longrope" and original:
            return int(original)
    return None


def _token(cfg: Any, name: str) -> int | None:
    value = getattr(cfg, name, None)
    if isinstance(value, list):
        value = value[0] if value else None
    if value is not None and int(value) < 0:  # written into the manifest, whose schema refuses it afterwards
        raise CheckpointError(f"{name} must be a token id (0 or more), found {int(value)}")
    return int(value) if value is not None else None


def read_spec(cfg: Any, arch: str, family: str) -> DecoderSpec:
    """The spec of a loaded model's config (standard fields, with ``ARCHS[arch]``'s overrides)."""
    a = ARCHS[arch]
    first = _per_layer(cfg, arch)[0]  # the first layer's sizes where they vary by layer (its cache gives every one)
    heads = int(getattr(first, a.heads))
    hidden = int(cfg.hidden_size)
    kv = _kv_heads(first, a)
    context = getattr(cfg, a.context, None) if a.context is not None else getattr(cfg, "seq_length", None)
    why = (
        None
        if context is not None
        else f"{arch} has no context length of its own (its config has no {a.context or 'seq_length'})"
    )
    longrope = _longrope_limit(cfg, arch)
    if longrope is not None and context is not None and longrope < int(context):
        context, why = (
            longrope,
            (
                "Phi-3's generate() recomputes the whole sequence with longrope's long factors once it passes "
                "original_max_position_embeddings"
                f" ({longrope}), which a KV cache cannot do, so kiln exports it up to there"
            ),
        )
    return DecoderSpec(
        family=family,
        n_layers=int(cfg.num_hidden_layers),
        n_kv_heads=kv,
        head_dim=int(getattr(first, "head_dim", None) or hidden // heads),
        vocab_size=int(cfg.vocab_size),
        max_context=int(context) if context is not None else None,
        max_context_why=why,
        bos_token_id=_token(cfg, "bos_token_id"),
        eos_token_id=_token(cfg, "eos_token_id"),
        pad_token_id=_token(cfg, "pad_token_id"),
        config=_manifest_config(cfg, arch),
        cache=a.cache(cfg) if a.cache is not None else None,
        keep_fp32=a.keep_fp32,
        static_state=a.static_state,
        sliding_window_proved=a.sliding_window_proved,
    )


def _manifest_config(cfg: Any, arch: str) -> dict[str, Any]:
    """The config's scalar fields, its sizes under the standard names too (``attribute_map``), and
    ``layer_types`` (each layer's attention kind: a host, and ``--target onnx``, need its windows)."""
    own = {k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))}
    standard = {
        k: getattr(cfg, k)
        for k in getattr(cfg, "attribute_map", {})
        if isinstance(getattr(cfg, k, None), (int, float, str, bool))
    }
    kinds = getattr(cfg, "layer_types", None)
    layers = {"layer_types": [str(kind) for kind in kinds]} if isinstance(kinds, (list, tuple)) else {}
    return {"architecture": arch, **own, **standard, **layers}
