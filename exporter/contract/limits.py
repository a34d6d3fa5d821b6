"""The largest shapes an export may declare: the manifest's schema holds the same bounds
(``artifacts/manifest.schema.json``; ``tests/unit/test_limits.py`` keeps them equal), so anything
the command line or a config lets through is an export ``kiln verify`` accepts (an export written
with ``--max-batch 100000`` was refused afterwards as "damaged or edited")."""

from __future__ import annotations

__all__ = ["MAX_BATCH", "MAX_CONTEXT", "MIN_CONTEXT", "MAX_LORA_RANK"]

MAX_BATCH = 65536  # rows of one step: far past any serving batch, well inside 32-bit dims
MIN_CONTEXT = 2  # a prompt token and one generated: a KV cache needs a past
MAX_CONTEXT = 16_777_216  # 2**24 tokens: past every released model's context (and fp32's exact integers)
MAX_LORA_RANK = 65536  # a LoRA rank beyond any hidden size kiln exports is a typo
