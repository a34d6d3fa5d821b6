"""Multimodal checkpoints exported as their text decoder (``archs.TextDecoder``).

A wrapper such as ``Gemma3ForConditionalGeneration`` or ``Mistral3ForConditionalGeneration``
computes text-only logits as ``lm_head(language_model(inputs_embeds=embed(input_ids)))``: its
language model at ``model.language_model`` (transformers 5.25's names, which its loader maps older
checkpoints' keys to; Llama 4's at ``language_model.model``) and its head at ``lm_head`` (Llama
4's ``language_model.lm_head``), with the sizes in ``config.text_config``. kiln
loads the wrapper as transformers does, then builds the causal LM class transformers maps
``text_config`` to (``Gemma3ForCausalLM``, ``MistralForCausalLM``) around those two modules (the
same tensors, tied as the wrapper ties them): the decoder every later stage exports. The rest of
the wrapper (its vision tower and projector) is dropped, and the spec says so
(``DecoderSpec.text_decoder_of``: the export's output and manifest record it).
"""

from __future__ import annotations

import copy
from typing import Any

from kiln.errors import CheckpointError
from kiln.plugins.base import DecoderSpec, TextDecoderOf
from kiln.plugins.hf.archs import ARCHS, TextDecoder
from kiln.plugins.hf.config import read_spec, refuse, refuse_quantized

__all__ = ["read_any_spec", "refuse_wrapper", "text_arch", "text_decoder", "wrapped"]


def wrapped(arch: str) -> TextDecoder | None:
    """The wrapper trait of ``arch`` (None: a plain decoder or not in ``ARCHS``)."""
    entry = ARCHS.get(arch)
    return entry.text if entry is not None else None


def text_arch(cfg: Any, arch: str) -> str:
    """The causal LM class transformers maps the wrapper's ``text_config`` to, one its entry proves."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    trait = wrapped(arch)
    assert trait is not None, arch
    text = getattr(cfg, "text_config", None)
    if text is None:
        raise CheckpointError(
            f"{arch}: config.json has no text_config (where a multimodal checkpoint gives its text decoder's sizes)"
        )
    kind = getattr(text, "model_type", None)
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(kind))
    if name not in trait.texts:
        raise CheckpointError(
            f"{arch}: text_config.model_type {kind!r} ({name or 'no causal LM class'}) is not supported: kiln "
            f"exports this wrapper's text decoder as {', '.join(trait.texts)}"
        )
    return str(name)


def refuse_wrapper(cfg: Any, arch: str) -> None:
    """The wrapper's quantization, its text decoder's config by that class's own refusals, and the
    wrapper's refusals of ``text_config`` values (where the wrapper computes otherwise)."""
    refuse_quantized(cfg, arch)
    name = text_arch(cfg, arch)
    try:
        refuse(cfg.text_config, name)
    except CheckpointError as exc:
        raise CheckpointError(f"{arch}'s text_config: {exc.args[0]}") from None
    for refusal in ARCHS[arch].refusals:
        value = getattr(cfg.text_config, refusal.field, None)
        if refusal.refused(value):
            raise CheckpointError(f"{arch}: text_config.{refusal.field}={value!r} is not supported: {refusal.why}")


def read_any_spec(cfg: Any, arch: str, family: str) -> DecoderSpec:
    """``read_spec`` of a decoder's config, or of a wrapper's text decoder (``text_config``)."""
    if wrapped(arch) is None:
        return read_spec(cfg, arch, family)
    return read_spec(_text_config(cfg), text_arch(cfg, arch), family)


def _text_config(cfg: Any) -> Any:
    """A copy of ``text_config`` with the wrapper's own special token ids where it sets them (a
    published Gemma 3 gives its ``eos_token_id`` at the top of config.json, not in text_config)."""
    text = copy.deepcopy(cfg.text_config)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, name, None) is not None:
            setattr(text, name, getattr(cfg, name))
    return text


def _left_out(model: Any, trait: TextDecoder) -> tuple[str, ...]:
    """The wrapper's modules beside the text decoder and the head, by path (its vision tower...)."""
    kept = (trait.prefix, trait.head)
    paths = [
        name
        for name, _ in model.named_modules()
        if name and not any(k == name or k.startswith(f"{name}.") or name.startswith(f"{k}.") for k in kept)
    ]
    return tuple(sorted(p for p in paths if not any(p.startswith(f"{q}.") for q in paths)))  # the outermost ones


def text_decoder(model: Any, arch: str) -> tuple[Any, str, TextDecoderOf]:
    """The wrapper's text decoder as its causal LM class (sharing the wrapper's tensors), that
    class's name, and what the export leaves out."""
    import torch
    import transformers

    trait = wrapped(arch)
    assert trait is not None, arch
    name = text_arch(model.config, arch)
    body, head = model.get_submodule(trait.prefix), model.get_submodule(trait.head)
    config = _text_config(model.config)
    config.tie_word_embeddings = head.weight is body.get_input_embeddings().weight  # as the wrapper ties them
    config.architectures = [name]
    with torch.device("meta"):  # its own modules are replaced by the wrapper's: no memory
        # _from_config is private, but transformers has no public way to build a named class with an attention
        # implementation
        text = getattr(transformers, name)._from_config(config, attn_implementation="eager", dtype=head.weight.dtype)
    # the attribute that holds its base model (Llama4ForCausalLM's is ``model``, though its base_model_prefix says
    # language_model)
    own = next(name for name, child in text.named_children() if type(child) is type(body))
    setattr(text, own, body)
    text.set_output_embeddings(head)
    return text.eval(), name, TextDecoderOf(arch, trait.prefix, _left_out(model, trait))
