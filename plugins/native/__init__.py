"""The native family: kiln's own PLE decoder (the seed documents' model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.plugins.base import DecoderSpec, LoadedModel
from kiln.plugins.native.checkpoint import apply_state_dict, find_weights, read_state_dict
from kiln.plugins.native.config import ARCHITECTURE, NativeConfig
from kiln.plugins.native.model import PLEDecoder
from kiln.plugins.native.ple import NATIVE_PLE

__all__ = ["NativeFamily", "NATIVE", "NativeConfig", "PLEDecoder", "spec_of"]


def spec_of(cfg: NativeConfig) -> DecoderSpec:
    return DecoderSpec(
        family=NativeFamily.name,
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


class NativeFamily:
    name = "native"
    description = "kiln's PLE decoder (config.json with architecture 'kiln-ple-decoder' + model.safetensors)"

    def claims(self, config: dict[str, Any]) -> bool:
        return config.get("architecture") == ARCHITECTURE

    def load(self, path: Path) -> LoadedModel:
        directory = path if path.is_dir() else path.parent
        cfg = NativeConfig.load(directory / "config.json")
        weights = find_weights(path)
        module = PLEDecoder(cfg)
        apply_state_dict(module, read_state_dict(weights), weights)
        tokenizer = directory / "tokenizer.json"
        files = (directory / "config.json", weights) + ((tokenizer,) if tokenizer.is_file() else ())
        return LoadedModel(
            module=module.eval(),
            spec=spec_of(cfg),
            source=path,
            tokenizer=tokenizer if tokenizer.is_file() else None,
            files=files,
            ple=NATIVE_PLE if cfg.ple.enabled else None,
        )

    def tiny(self, seed: int) -> LoadedModel:
        cfg = NativeConfig(vocab_size=101, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_context=64)
        return LoadedModel(module=random_model(cfg, seed), spec=spec_of(cfg), source=Path("<tiny>"), ple=NATIVE_PLE if cfg.ple.enabled else None)


def random_model(cfg: NativeConfig, seed: int) -> PLEDecoder:
    """A randomly initialised model whose PLE tables are non-identity (as after training), so
    that folding is tested on real values, not on zeros."""
    gen = torch.Generator().manual_seed(seed)
    model = PLEDecoder(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "ple." in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model.eval()


NATIVE = NativeFamily()
