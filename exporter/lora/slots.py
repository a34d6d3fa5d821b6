"""``kiln export --lora-slots RANK``: which Linear layers get a LoRA slot, and its graph inputs.

A slot is one Linear (or GPT-2 Conv1D) of a Hugging Face decoder whose graphs compute

    y = x @ W  +  (x @ A) @ B          A: [in, r], B: [r, out], 0 <= r <= RANK

with ``A`` and ``B`` graph inputs named ``<module>.lora_A`` and ``<module>.lora_B`` after the
module's path in the transformers model (PEFT's own path: ``model.layers.0.self_attn.q_proj``).
Each is an *overridable initializer*: its default is an empty ``[in, 0]`` / ``[0, out]`` tensor,
so a run that feeds nothing computes the base model (rank 0), and ONNX Runtime's adapter files
(``AdapterFormat``, what ``kiln adapter`` writes and GenAI's ``og.Adapters`` loads) override them
by name. PEFT's scaling (``alpha / r``) is folded into ``B`` by ``kiln adapter``, so the graphs
carry no scale. Each slot has its own rank dim (``<module>.rank``): an adapter that leaves a
module out feeds nothing there, and a runtime never sees two different ranks under one dim name.

Every Linear and Conv1D of the model gets a slot except the output head (LoRA on the LM head
is merged with ``--adapter``, never swapped) and weights tied to another parameter.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kiln.errors import ConfigError
from kiln.exporter.contract.lora import GRAPH_PREFIX, LoraSlot, LoraSlots

__all__ = ["LoraSlot", "LoraSlots", "plan_slots", "GRAPH_PREFIX"]


def plan_slots(model: nn.Module, rank: int, dtype: str, targets: tuple[str, ...] = ()) -> LoraSlots:
    """The slots of a transformers model (``HFDecoder.model``): every Linear and Conv1D but the
    output head and tied weights, in module order; with ``targets`` (``--lora-targets``, module
    names as PEFT's ``target_modules`` gives them) only those, each of which must name one."""
    from transformers.pytorch_utils import Conv1D

    hf: Any = model  # a transformers PreTrainedModel (untyped)
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    owners: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        owners[id(param)] = owners.get(id(param), 0) + 1
    slots, names = [], set()
    for path, module in model.named_modules():
        if module is head or not isinstance(module, (nn.Linear, Conv1D)) or owners.get(id(module.weight), 0) > 1:
            continue
        names.add(path.rsplit(".", 1)[-1])
        if targets and path.rsplit(".", 1)[-1] not in targets:
            continue
        rows, cols = (int(d) for d in module.weight.shape)
        slots.append(
            LoraSlot.of(path, cols, rows) if isinstance(module, nn.Linear) else LoraSlot.of(path, rows, cols)
        )  # Conv1D's weight is [in, out]
    if unknown := sorted(set(targets) - names):
        raise ConfigError(
            f"--lora-targets: {', '.join(unknown)} names no Linear of the model that can take a slot; it has "
            f"{', '.join(sorted(names))}"
        )
    if not slots:
        raise ConfigError(
            "--lora-slots: the model has no Linear or Conv1D layer besides its output head to give a slot"
        )
    return LoraSlots(rank, dtype, tuple(slots))
