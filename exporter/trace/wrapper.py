"""The decoder contract as flat tensors: what is traced, and what the PyTorch reference runs."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from kiln.exporter.contract.io import GraphKind

__all__ = ["EncoderModule", "FeaturesEncoderModule", "GraphModule"]


class GraphModule(nn.Module):
    """The decoder contract with flat tensors in and out, in the contract's order: the past as
    ``[k0, v0, k1, v1, ...]`` (``[k0, v0, ck0, cv0, ...]`` with cross-attention, whose cross
    keys/values only prefill returns), and ``encoder_hidden_states`` after the first three
    inputs of a cross-attention prefill. An encoder-decoder's graphs (``encoder_mask``) take
    ``encoder_attention_mask`` fourth, before the encoder states or the past."""

    def __init__(
        self,
        model: nn.Module,
        kind: GraphKind,
        n_layers: int,
        last_logits_only: bool,
        cross: bool = False,
        encoder_mask: bool = False,
    ) -> None:
        super().__init__()
        self.model, self.kind, self.n_layers, self.cross, self.encoder_mask = model, kind, n_layers, cross, encoder_mask
        self.last_logits_only = last_logits_only and kind is GraphKind.PREFILL

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        fourth: object = None,
        fifth: object = None,
    ) -> tuple[Tensor, ...]:
        # (explicit arguments, not *args: torch.export's dynamic_shapes follow the signature)
        kwargs: dict[str, object] = {"encoder_attention_mask": fourth} if self.encoder_mask else {}
        extra = fifth if self.encoder_mask else fourth
        # prefill's extra input is the encoder states (cross-attention), the others' the flat past
        encoder = extra if self.kind is GraphKind.PREFILL and isinstance(extra, Tensor) else None
        past = list(extra) if self.kind is not GraphKind.PREFILL and isinstance(extra, (list, tuple)) else None
        pkv = self._per_layer(past) if past is not None else None
        if self.cross:
            kwargs["encoder_hidden_states"] = encoder
        logits, presents = self.model(input_ids, attention_mask, position_ids, pkv, self.last_logits_only, **kwargs)
        returned = 2 if self.cross and self.kind is not GraphKind.PREFILL else None  # the cross cache never grows
        return (logits, *[t for kv in presents for t in kv[:returned]])

    def _per_layer(self, past: list[Any]) -> list[tuple[Any, ...]]:
        """The flat past cut into layers: by the model's per-layer ``cache_names`` where it has them (a
        hybrid's layers carry 0, 2 or 4 tensors), else 2 per layer (4 with cross-attention; the last
        layers of a ``shared_kv`` cache get none)."""
        names = getattr(self.model, "cache_names", ("key", "value"))
        per_layer = 4 if self.cross else 2
        counts = [len(n) for n in names] if names and not isinstance(names[0], str) else [per_layer] * self.n_layers
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return [tuple(past[start : start + count]) for start, count in zip(starts, counts, strict=True)]


class EncoderModule(nn.Module):
    """An encoder-decoder's encoder graph: ``model.encode(input_ids, attention_mask)``. It holds
    the same module as ``GraphModule`` under the same attribute, so the weights the encoder
    shares with the decoder (the embedding) have one name in every graph."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        encode: Any = self.model.encode  # a family's module (nn.Module's attribute type is Tensor | Module)
        states: Tensor = encode(input_ids, attention_mask)
        return states


class FeaturesEncoderModule(nn.Module):
    """A speech encoder-decoder's encoder graph: ``model.encode_features(input_features)``
    (log-mel ``[batch, n_mels, frames]``; no mask), the module held as ``EncoderModule`` holds it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_features: Tensor) -> Tensor:
        encode: Any = self.model.encode_features  # a family's module (nn.Module's attribute type is Tensor | Module)
        states: Tensor = encode(input_features)
        return states
