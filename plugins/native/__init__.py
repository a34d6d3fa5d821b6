"""The native family: kiln's own PLE decoder (the seed documents' model).

This module is what the registry imports to list and match families, so it stays free of torch;
the model itself is built in ``kiln.plugins.native.build``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.plugins.base import DecoderSpec, LoadedModel
from kiln.plugins.files import checkpoint_dir
from kiln.plugins.native.config import ARCHITECTURE, NativeConfig
from kiln.plugins.native.spec import FAMILY, spec_of

__all__ = ["NativeFamily", "NATIVE", "NativeConfig", "spec_of"]


class NativeFamily:
    name = FAMILY
    description = "kiln's PLE decoder (config.json with architecture 'kiln-ple-decoder' + model.safetensors)"

    def claims(self, config: dict[str, Any]) -> bool:
        return config.get("architecture") == ARCHITECTURE

    def config_spec(self, path: Path) -> DecoderSpec:
        """The spec of the checkpoint's config alone (no weight read, no torch)."""
        return spec_of(NativeConfig.load(checkpoint_dir(path) / "config.json"))

    def load(self, path: Path) -> LoadedModel:
        from kiln.plugins.native.build import load

        return load(path)

    def tiny(self, seed: int) -> LoadedModel:
        from kiln.plugins.native.build import loaded_model, random_model

        cfg = _tiny_config()
        return loaded_model(cfg, random_model(cfg, seed), Path("<tiny>"))

    def table(self) -> list[list[str]]:
        """What ``kiln plugins`` prints: the decoder with and without cross-attention (the
        precisions and targets each takes are asked of the export's refusals: ``specs``)."""
        return [
            ["model", "notes"],
            ["PLE decoder", "every option of its config (tests/export/test_matrix.py)"],
            [
                "cross-attention",
                '"cross_attention": true; no Triton, genai_config.json, kiln generate or encoder padding mask',
            ],
        ]

    def specs(self) -> list[DecoderSpec]:
        """The spec of each row of ``table`` (the tiny model's config, with cross-attention for the second)."""
        return [spec_of(_tiny_config()), spec_of(_tiny_config(cross_attention=True))]


def _tiny_config(**changes: Any) -> NativeConfig:
    """The tiny model's config (``tiny``), with ``changes``."""
    return NativeConfig(
        vocab_size=101, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_context=64, **changes
    )


NATIVE = NativeFamily()
