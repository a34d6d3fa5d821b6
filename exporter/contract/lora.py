"""The LoRA slots of an export (``kiln export --lora-slots``): graph inputs beyond the decoder
contract, recorded in the manifest's ``lora`` section (``exporter.lora`` makes and fills them).

A slot is one Linear (or GPT-2 Conv1D) whose graphs compute ``y = x @ W + (x @ A) @ B`` with
``A`` [in, r] and ``B`` [r, out] graph inputs named after the module's path in the transformers
model (PEFT's own path), each an overridable initializer of rank 0 by default: nothing fed is the
base model. Each slot has its own rank dim, so a runtime never sees two ranks under one name.
"""

from __future__ import annotations

import dataclasses

__all__ = ["GRAPH_PREFIX", "LoraSlot", "LoraSlots"]

GRAPH_PREFIX = "model."  # kiln's HFDecoder holds the transformers model as .model: node /model.<path>/MatMul


@dataclasses.dataclass(frozen=True)
class LoraSlot:
    """One LoRA'd Linear: its PEFT module path, its weight's sizes and its two graph inputs."""

    module: str  # path in the transformers model, as PEFT names it
    in_features: int
    out_features: int
    a: str  # graph input [in_features, rank_dim]
    b: str  # graph input [rank_dim, out_features]
    rank_dim: str  # the dim name of its rank

    @classmethod
    def of(cls, module: str, in_features: int, out_features: int) -> LoraSlot:
        return cls(module, in_features, out_features, f"{module}.lora_A", f"{module}.lora_B", f"{module}.rank")


@dataclasses.dataclass(frozen=True)
class LoraSlots:
    """The manifest's ``lora`` section: what ``kiln adapter`` checks an adapter against."""

    max_rank: int  # --lora-slots RANK: the largest r an adapter may have (an engine profile's max)
    dtype: str  # of A and B: the graphs' float dtype ("float32", "float16")
    slots: tuple[LoraSlot, ...]

    def by_module(self) -> dict[str, LoraSlot]:
        return {slot.module: slot for slot in self.slots}

    def inputs(self) -> dict[str, tuple[str, int | str, int | str]]:
        """Every slot input: name -> (module, dim 0, dim 1)."""
        out: dict[str, tuple[str, int | str, int | str]] = {}
        for s in self.slots:
            out[s.a] = (s.module, s.in_features, s.rank_dim)
            out[s.b] = (s.module, s.rank_dim, s.out_features)
        return out
