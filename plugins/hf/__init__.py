"""Hugging Face causal LMs from a local checkpoint directory (config.json + safetensors; no hub).

The architectures of ``archs.ARCHS`` load through ``transformers`` and are wrapped in the decoder
contract (``decoder.HFDecoder``): the model's own forward pass with its own ``DynamicCache``, so
parity is against Hugging Face's implementation, not a re-implementation. Their configs are read
by the standard field names (``config.read_spec``), and what kiln does not export exactly is
refused by name (``config.refuse``); another architecture is refused with the mechanism kiln
lacks (``unsupported.refusal``). ``transformers`` is imported only when such a checkpoint is
loaded (install the ``hf`` extra: ``pip install -e ".[hf]"`` in kiln's checkout).
"""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.errors import CheckpointError
from kiln.plugins.base import DecoderSpec, LoadedModel
from kiln.plugins.files import checkpoint_dir, read_config
from kiln.plugins.hf.archs import ALIASES, ARCHS, Arch
from kiln.plugins.hf.seq2seq import SEQ2SEQ
from kiln.plugins.hf.unsupported import refusal
from kiln.plugins.hub_cache import HF_EXTRA

__all__ = ["HF", "SUPPORTED", "HFFamily", "tiny_model"]

SUPPORTED: Mapping[str, object] = {**ARCHS, **SEQ2SEQ}  # the architectures kiln exports (by class name)


def _architecture(config: Mapping[str, Any], path: Path) -> str:
    names = config.get("architectures") or []
    arch = names[0] if isinstance(names, list) and names else config.get("model_type", "<none>")
    arch = (
        ALIASES.get(arch, arch) if isinstance(arch, str) else arch
    )  # a checkpoint's own name for a class transformers names otherwise
    if arch not in SUPPORTED:  # one line: the mechanism kiln lacks and the nearest it exports
        raise CheckpointError(f"{path}: {refusal(str(arch), config, SUPPORTED, [a.label for a in SEQ2SEQ.values()])}")
    return str(arch)


class HFFamily:
    name = "hf"
    description = (
        f"Hugging Face causal LMs ({len(ARCHS)} architectures) and encoder-decoders ({len(SEQ2SEQ)}) from a "
        "local directory,"
        " each proved against transformers' generate()"
    )

    def claims(self, config: dict[str, Any]) -> bool:
        return "architectures" in config or "model_type" in config

    def config_spec(self, path: Path) -> DecoderSpec:
        """The spec of the checkpoint's config, read and checked by transformers and kiln (no weight read)."""
        from kiln.plugins.hf.build import config_spec

        directory = checkpoint_dir(path)
        return config_spec(directory, _architecture(read_config(directory), directory))

    def load(self, path: Path) -> LoadedModel:
        directory = checkpoint_dir(path)
        from kiln.plugins.hf.build import load

        return load(path, directory, _architecture(read_config(directory), directory))

    def unavailable(self) -> str | None:
        """Why this family cannot load a checkpoint here (``kiln plugins`` says it), or None."""
        if importlib.util.find_spec("transformers") is None:
            return f"unavailable: transformers is not installed ({HF_EXTRA})"
        return None

    def tiny(self, seed: int) -> LoadedModel:
        return tiny_model("LlamaForCausalLM", seed)

    def table(self) -> list[list[str]]:
        """What ``kiln plugins`` prints: every architecture with what its tests prove (the precisions
        and targets each takes are asked of the export's refusals: ``specs``)."""
        rows = [[a.label, name, a.ort, a.notes] for name, a in ARCHS.items()]
        rows += [[a.label, name, a.ort, f"encoder-decoder: {a.notes}"] for name, a in SEQ2SEQ.items()]
        return [["architecture", "class", "--target ort", "notes"], *rows]

    def specs(self) -> list[DecoderSpec]:
        """Each row of ``table``'s structure, as far as the export's refusals read it (no config
        is read: the sizes are placeholders), for ``kiln plugins`` to ask them what it takes;
        tests/unit/test_support.py checks it against the specs the tiny models' configs give."""
        decoders = [_structure(name, a) for name, a in ARCHS.items()]
        return decoders + [_structure(name, encoder=True) for name in SEQ2SEQ]


_PLACEHOLDER = types.SimpleNamespace(
    num_hidden_layers=1, kv_lora_rank=64, qk_rope_head_dim=64,
    expand=2, hidden_size=64, n_groups=1, state_size=16, conv_kernel=4, num_heads=8, head_dim=16,
    layer_types=["linear_attention"], num_attention_heads=1, num_key_value_heads=1, mamba_expand=2, mamba_n_groups=1,
    mamba_d_state=16, mamba_d_conv=4, mamba_n_heads=8, mamba_d_head=16,
    linear_num_key_heads=1, linear_key_head_dim=16, linear_num_value_heads=1, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, conv_L_cache=3, intermediate_size=128,
    layers_block_type=["linear_attention"], mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, mamba_d_ssm=None,
)  # the sizes a cache layout reads (MLA's, Mamba2's, Mamba's, the Mamba2 hybrids', Qwen3.5's, LFM2's)  # fmt: skip


def _structure(arch: str, row: Arch | None = None, *, encoder: bool = False) -> DecoderSpec:
    """A decoder of ``arch`` as its row of ``ARCHS`` declares it: its config with a sliding_window
    field (unset) where its class has one, an attention_chunk_size field (unset) where it has chunked
    layers, its own cache layout where it has one (of placeholder sizes), and what it declares to
    ``--target onnx`` (its state, its window: ``static_state``, ``sliding_window_proved``); an
    encoder-decoder's (no row) with cross-attention over its own encoder's states."""
    a = row or Arch(arch)
    config = {
        "architecture": arch,
        **({"sliding_window": None} if a.window else {}),
        **({"attention_chunk_size": None} if a.chunked else {}),
    }
    return DecoderSpec(
        family=HFFamily.name, n_layers=1, n_kv_heads=1, head_dim=64, vocab_size=1, max_context=None,
        encoder_dim=64 if encoder else None, has_encoder=encoder, config=config,
        cache=a.cache(_PLACEHOLDER) if a.cache is not None else None, static_state=a.static_state,
        sliding_window_proved=a.sliding_window_proved,
    )  # fmt: skip


def tiny_model(case: str, seed: int, **overrides: Any) -> LoadedModel:
    """A tiny randomly initialised model of ``TINY[case]`` (for tests; no download), its config
    changed by ``overrides`` (``num_hidden_layers=4``); an architecture's name is its first case."""
    from kiln.plugins.hf import build

    return build.tiny_model(case, seed, **overrides)


HF = HFFamily()
