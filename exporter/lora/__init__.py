"""Swappable LoRA adapters on one export (``--lora-slots``): the slots a model gets (``slots``;
their types are the contract's, ``contract.lora``), the pass that wires them
(``passes.lora_slots``), and the adapter files that ``kiln adapter`` (``exporter.adapter``)
writes from a PEFT adapter and runtimes load by name (``adapter_file``)."""

from __future__ import annotations

from kiln.exporter.lora.slots import LoraSlot, LoraSlots, plan_slots

__all__ = ["LoraSlot", "LoraSlots", "plan_slots"]
