"""A Hugging Face causal LM behind kiln's decoder contract (BNSH caches in and out)."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
from torch import Tensor, nn

from kiln.plugins.hf.deepseek_rotary import deepseek_rewrites_for
from kiln.plugins.hf.gated_deltanet import DELTANETS, deltanet_rewrites_for
from kiln.plugins.hf.gemma3n_sparsity import gemma3n_rewrites_for
from kiln.plugins.hf.mamba1_scan import (
    continues_a_state,
    flat_states,
    is_mamba1,
    mamba1_rewrites_for,
    step_mask,
    token_by_token,
)
from kiln.plugins.hf.mamba2_scan import MIXERS, mamba2_rewrites_for
from kiln.plugins.hf.real_rotary import rewrites_for
from kiln.plugins.hf.recurrent_state import layer_names, layer_tensors, seed_layer
from kiln.plugins.hf.short_conv import SHORT_CONVS, short_conv_rewrites_for

__all__ = ["KV", "HFDecoder", "HFSeq2Seq"]

KV = tuple[Tensor, Tensor]


def _forward_kwargs(model: nn.Module) -> tuple[str, bool]:
    """The cache keyword of ``model.forward`` (transformers 5.x: ``cache``; before:
    ``past_key_values``, deprecated from 5.24) and whether it takes ``position_ids`` (Bloom's
    ALiBi takes none: its positions come from the mask)."""
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "position_ids" in params


def _cache_of(out: Any) -> Any:
    """The cache a forward pass returns: ``out.cache`` (transformers 5.24+; reading
    ``out.past_key_values`` there logs a deprecation warning), else ``out.past_key_values``."""
    return out.cache if "cache" in out else out.past_key_values


def _cache(recurrent_config: Any, past: list[tuple[Tensor, ...]] | None) -> Any:
    """The model's ``DynamicCache`` holding kiln's flat past: keys and values per layer, or a
    recurrent layer's ``conv`` and ``ssm`` state (``recurrent_state``). A recurrent model's cache
    is built from its config (which makes its ``LinearAttentionLayer``s); any other's without."""
    from transformers import DynamicCache

    if recurrent_config is None:
        # no config: every layer keeps the full past (the contract's present = past + new), also a
        # sliding-window layer, whose window the model's own mask still applies; with the config,
        # transformers gives such a layer a cache capped at the window - 1, which breaks the
        # contract and the unified graph's trace (a guard past_seq <= window - 1)
        cache = DynamicCache()
        for i, kv in enumerate(past or []):
            if kv:  # a layer that reads another's cache (Gemma 3n's last layers) carries none
                cache.update(kv[0], kv[1], i)
        return cache
    cache = DynamicCache(config=recurrent_config)  # a hybrid's: attention layers and LinearAttentionLayers
    for i, tensors in enumerate(past or []):
        seed_layer(cache.layers[i], tensors, i, cache)
    return cache


def _cache_names(model: nn.Module, recurrent: bool) -> tuple[str, ...] | tuple[tuple[str, ...], ...]:
    """The cache tensors' names: ``key``/``value`` for every layer of an attention-only model, else
    per layer ``conv``/``ssm`` where transformers' cache for the model's config holds a recurrent
    state and ``key``/``value`` elsewhere (a hybrid mixes them; ``recurrent_state.layer_names``: all four
    on a layer with both, none on a layer without attention or state)."""
    from transformers import DynamicCache

    if not recurrent:
        return ("key", "value")
    config: Any = model.config  # transformers' (untyped)
    layers = DynamicCache(config=config).layers
    kinds = list(getattr(config, "layer_types", None) or [None] * len(layers))  # LFM2's "conv": conv alone
    return tuple(layer_names(layer, kind) for layer, kind in zip(layers, kinds, strict=True))


class HFDecoder(nn.Module):
    """The model's own forward pass with its own ``DynamicCache``, flattened to kiln's contract
    (traced with ``real_rotary.rewrites_for`` its code: complex rotary in real arithmetic)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        # the trace-time rewrites (plugins/hf/trace_rewrites.py: each enters only while torch.export traces a
        # model with the module it replaces; eager runs keep transformers' code), entered in this order
        self.trace_rewrites = (
            mamba1_rewrites_for(model),  # Mamba v1's scan in one form at every length (mamba1_scan)
            rewrites_for(model),  # Llama 4's complex rotary in real arithmetic (real_rotary)
            deepseek_rewrites_for(model),  # DeepSeek-V2's complex rotary (deepseek_rotary)
            mamba2_rewrites_for(model),  # Mamba2's mixer in one form at every length (mamba2_scan)
            gemma3n_rewrites_for(model),  # Gemma 3n's icdf as a constant (gemma3n_sparsity)
            deltanet_rewrites_for(model),  # Gated DeltaNet in one form (gated_deltanet)
            short_conv_rewrites_for(model),  # LFM2's short convolution in one form (short_conv)
        )
        self.mamba1 = is_mamba1(model)  # Mamba v1 mixers (Mamba, FalconMamba, Jamba): a 3-D SSM state
        self.step_mask = step_mask(model)  # Mamba and FalconMamba: their mixers read the step's mask columns
        # a recurrent state on some layer: Mamba2's or a hybrid's Mamba2, Gated DeltaNet, LFM2 conv or Mamba v1 layers
        self.recurrent = self.mamba1 or any(
            type(m).__name__ in {**MIXERS, **DELTANETS, **SHORT_CONVS} for m in model.modules()
        )
        self.cache_names = _cache_names(model, self.recurrent)  # each layer's (TorchRunner)
        # a mixer whose one-token step is a form of its own (Mamba2, Mamba v1, Gated DeltaNet: the recurrence, not
        # the scan on one position): the family traces decode at seq 1 (LoadedModel.decode_traced)
        self.decode_traced = self.mamba1 or any(type(m).__name__ in {**MIXERS, **DELTANETS} for m in model.modules())

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        past_key_values: list[tuple[Tensor, ...]] | None = None,
        last_logits_only: bool = False,
    ) -> tuple[Tensor, list[tuple[Tensor, ...]]]:
        if (
            self.mamba1
            and past_key_values
            and input_ids.shape[1] > 1
            and not torch.compiler.is_exporting()
            and continues_a_state(input_ids, attention_mask, past_key_values)
        ):
            args = (input_ids, attention_mask, position_ids, past_key_values, last_logits_only)
            return token_by_token(self.forward, *args)  # Mamba v1's eager reference (mamba1_scan.token_by_token)
        cache = _cache(self.model.config if self.recurrent else None, past_key_values)
        cache_kwarg, takes_positions = _forward_kwargs(self.model)
        if self.mamba1:
            flat_states(cache)
        if self.step_mask:
            attention_mask = attention_mask[:, -input_ids.shape[1] :]
        with contextlib.ExitStack() as rewrites:
            for rewrite in self.trace_rewrites:
                rewrites.enter_context(rewrite())
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                use_cache=True,
                logits_to_keep=1 if last_logits_only else 0,
                **{cache_kwarg: cache},
                **({"position_ids": position_ids} if takes_positions else {}),
            )
        layers = _cache_of(out).layers
        return out.logits, [layer_tensors(layer) for layer in layers]


class HFSeq2Seq(nn.Module):
    """A Hugging Face encoder-decoder behind kiln's contract: ``encode`` runs its encoder, and
    ``forward`` its decoder and head with an ``EncoderDecoderCache`` rebuilt from the flat
    per-layer ``(key, value, cross_key, cross_value)``. With a past, the cross cache is marked
    computed (``is_updated``), so the model reads it and projects nothing from the encoder; the
    encoder states it is then handed are a broadcast zero of the right shape, which only says
    that the layers are cross-attending and how long the encoder's output is."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def encode(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        model: Any = self.model  # transformers' (untyped)
        states: Tensor = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return states

    def encode_features(self, input_features: Tensor) -> Tensor:
        """A speech encoder's output (Whisper's: log-mel ``[batch, n_mels, frames]``, no mask)."""
        model: Any = self.model
        states: Tensor = model.get_encoder()(input_features=input_features).last_hidden_state
        return states

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        # the decoder's positions are its cache's length (no left padding in a decoder of generate())
        position_ids: Tensor,
        past_key_values: list[tuple[Tensor, ...]] | None = None,
        last_logits_only: bool = False,
        encoder_hidden_states: Tensor | None = None,
        encoder_attention_mask: Tensor | None = None,
    ) -> tuple[Tensor, list[tuple[Tensor, ...]]]:
        from transformers import DynamicCache, EncoderDecoderCache
        from transformers.modeling_outputs import BaseModelOutput

        own, cross = DynamicCache(), DynamicCache()
        for i, (key, value, cross_key, cross_value) in enumerate(past_key_values or []):
            own.update(key, value, i)
            cross.update(cross_key, cross_value, i)
        cache = EncoderDecoderCache(own, cross)
        if past_key_values:
            for i in range(len(past_key_values)):
                cache.is_updated[i] = True
            first = past_key_values[0][2]
            config: Any = self.model.config
            encoder_hidden_states = first.new_zeros(()).expand(first.shape[0], first.shape[2], int(config.d_model))
        if encoder_hidden_states is None:
            raise ValueError("an encoder-decoder's first call needs encoder_hidden_states")
        out = self.model(
            encoder_outputs=BaseModelOutput(last_hidden_state=encoder_hidden_states),
            attention_mask=encoder_attention_mask,
            decoder_input_ids=input_ids,
            decoder_attention_mask=attention_mask,
            cache=cache,
            use_cache=True,
        )
        logits = out.logits[:, -1:] if last_logits_only else out.logits
        done = _cache_of(out)
        pairs = zip(done.self_attention_cache.layers, done.cross_attention_cache.layers, strict=True)
        return logits, [(s.keys, s.values, c.keys, c.values) for s, c in pairs]
