"""The native family's ``DecoderSpec`` from its config alone (no torch, no weights)."""

from __future__ import annotations

from kiln.plugins.base import DecoderSpec
from kiln.plugins.native.config import NativeConfig

__all__ = ["FAMILY", "spec_of"]

FAMILY = "native"


def spec_of(cfg: NativeConfig) -> DecoderSpec:
    return DecoderSpec(
        family=FAMILY,
        n_layers=cfg.n_layers,
        n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        max_context=cfg.max_context,
        ple_positions=cfg.ple.max_positions if cfg.ple.enabled else None,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        encoder_dim=cfg.d_model if cfg.cross_attention else None,
        config=cfg.to_dict(),
    )
