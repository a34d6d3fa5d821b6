"""A Hugging Face causal LM behind kiln's decoder contract (BNSH caches in and out)."""

from __future__ import annotations

import inspect

from torch import Tensor, nn

__all__ = ["KV", "HFDecoder"]

KV = tuple[Tensor, Tensor]


def _forward_kwargs(model: nn.Module) -> tuple[str, bool]:
    """The cache keyword of ``model.forward`` (transformers 5.x: ``cache``; before:
    ``past_key_values``, deprecated from 5.24) and whether it takes ``position_ids`` (Bloom's
    ALiBi takes none: its positions come from the mask)."""
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "position_ids" in params


class HFDecoder(nn.Module):
    """The model's own forward pass with its own ``DynamicCache``, flattened to kiln's contract."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        past_key_values: list[KV] | None = None,
        last_logits_only: bool = False,
    ) -> tuple[Tensor, list[KV]]:
        from transformers import DynamicCache

        # no config: every layer keeps the full past (the contract's present = past + new), also a
        # sliding-window layer, whose window the model's own mask still applies; with the config,
        # transformers gives such a layer a cache capped at the window - 1, which breaks the
        # contract and the unified graph's trace (a guard past_seq <= window - 1)
        cache = DynamicCache()
        for i, (key, value) in enumerate(past_key_values or []):
            cache.update(key, value, i)
        cache_kwarg, takes_positions = _forward_kwargs(self.model)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            use_cache=True,
            logits_to_keep=1 if last_logits_only else 0,
            **{cache_kwarg: cache},
            **({"position_ids": position_ids} if takes_positions else {}),
        )
        layers = out.past_key_values.layers
        return out.logits, [(layer.keys, layer.values) for layer in layers]
