"""The decoder contract as flat tensors: what is traced, and what the PyTorch reference runs."""

from __future__ import annotations

from kiln.exporter.contract.io import GraphKind
from torch import Tensor, nn

__all__ = ["GraphModule"]


class GraphModule(nn.Module):
    """The decoder contract with flat tensors in and out, in the contract's order: the past as
    ``[k0, v0, k1, v1, ...]`` (``[k0, v0, ck0, cv0, ...]`` with cross-attention, whose cross
    keys/values only prefill returns), and ``encoder_hidden_states`` after the first three
    inputs of a cross-attention prefill."""

    def __init__(self, model: nn.Module, kind: GraphKind, n_layers: int, last_logits_only: bool, cross: bool = False) -> None:
        super().__init__()
        self.model, self.kind, self.n_layers, self.cross = model, kind, n_layers, cross
        self.last_logits_only = last_logits_only and kind is GraphKind.PREFILL

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, extra: object = None) -> tuple[Tensor, ...]:
        # prefill's extra input is the encoder states (cross-attention), the others' the flat past
        encoder = extra if self.kind is GraphKind.PREFILL and isinstance(extra, Tensor) else None
        past = list(extra) if self.kind is not GraphKind.PREFILL and isinstance(extra, (list, tuple)) else None
        per_layer = 4 if self.cross else 2
        pkv = [tuple(past[per_layer * i : per_layer * (i + 1)]) for i in range(self.n_layers)] if past is not None else None
        kwargs = {"encoder_hidden_states": encoder} if self.cross else {}
        logits, presents = self.model(input_ids, attention_mask, position_ids, pkv, self.last_logits_only, **kwargs)
        returned = per_layer if self.kind is GraphKind.PREFILL else 2  # the cross cache never grows
        return (logits, *[t for kv in presents for t in kv[:returned]])
