"""Parity tolerances, by precision."""

from __future__ import annotations

import dataclasses

__all__ = ["Tolerance", "TOLERANCES"]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    logits_atol: float  # max abs error of logits
    kv_atol: float  # max abs error of present keys/values
    min_cosine: float  # of each output, flattened
    min_token_match: float = 1.0  # teacher-forced argmax agreement; 1.0: any non-tie difference fails


TOLERANCES = {
    "fp32": Tolerance(logits_atol=1e-4, kv_atol=1e-4, min_cosine=0.999999),
    # fp16 weights, activations and KV (10-bit mantissa) against fp32 PyTorch
    "fp16": Tolerance(logits_atol=5e-2, kv_atol=2e-2, min_cosine=0.9999),
    # int8 MatMuls: an approximation by design; judged by agreement, not by exact tokens
    "int8": Tolerance(logits_atol=1.5, kv_atol=1.0, min_cosine=0.99, min_token_match=0.9),
    "int8+fp16": Tolerance(logits_atol=1.5, kv_atol=1.0, min_cosine=0.99, min_token_match=0.9),
    # int4 weights (16 levels a block): agreement again, looser than int8's
    "int4": Tolerance(logits_atol=3.0, kv_atol=2.0, min_cosine=0.97, min_token_match=0.7),
    "int4+fp16": Tolerance(logits_atol=3.0, kv_atol=2.0, min_cosine=0.97, min_token_match=0.7),
    # fp8 E4M3 weights and activations (3 mantissa bits): int8's agreement
    "fp8": Tolerance(logits_atol=1.5, kv_atol=1.0, min_cosine=0.99, min_token_match=0.9),
}
