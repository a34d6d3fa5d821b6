"""Test helpers: tiny checkpoints written in-process with a seed (importable from every tier)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_model

from kiln.plugins.native import random_model
from kiln.plugins.native.config import NativeConfig, PLEConfig

TINY = dict(vocab_size=101, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_context=48)


def tiny_config(**overrides: Any) -> NativeConfig:
    """The tiny test model with some fields changed; ``ple`` may be a dict of PLEConfig fields."""
    fields = {**TINY, **overrides}
    fields["ple"] = PLEConfig(**{"max_positions": 48, **fields.get("ple", {})})
    return NativeConfig(**fields)


def write_checkpoint(directory: Path, cfg: NativeConfig, seed: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    cfg.save(directory / "config.json")
    save_model(random_model(cfg, seed), str(directory / "model.safetensors"))
    return directory


def edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


