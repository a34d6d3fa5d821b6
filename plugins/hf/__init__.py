"""Hugging Face causal LMs from a local checkpoint directory (config.json + safetensors; no hub).

Llama, Qwen2 and Mistral (``LlamaForCausalLM``-like: RoPE, GQA, RMSNorm, SwiGLU) and GPT-2
(``GPT2LMHeadModel``) load through ``transformers`` and are wrapped in the decoder contract
(``HFDecoder``): the model's own forward pass with its own ``DynamicCache``, so parity is
against Hugging Face's implementation, not a re-implementation. ``transformers`` is imported
only when such a checkpoint is loaded (install ``kiln[hf]``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from kiln.errors import CheckpointError
from kiln.plugins.base import DecoderSpec, LayerPlan, LoadedModel, non_finite

__all__ = ["HFFamily", "HF", "HFDecoder", "SUPPORTED"]

KV = tuple[Tensor, Tensor]


@dataclasses.dataclass(frozen=True)
class _Arch:
    heads: str  # config attribute: attention heads
    kv_heads: str | None  # config attribute: KV heads (None: same as heads)
    hidden: str
    layers: str
    context: str


_LLAMA = _Arch("num_attention_heads", "num_key_value_heads", "hidden_size", "num_hidden_layers", "max_position_embeddings")
SUPPORTED: Mapping[str, _Arch] = {
    "LlamaForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "GPT2LMHeadModel": _Arch("n_head", None, "n_embd", "n_layer", "n_positions"),
}


class HFDecoder(nn.Module):
    """A Hugging Face causal LM behind kiln's decoder contract (BNSH caches in and out)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        past_key_values: list[KV] | None = None,
        last_logits_only: bool = False,
    ) -> tuple[Tensor, list[KV]]:
        from transformers import DynamicCache

        # no config: every layer keeps the full past (the contract's present = past + new), also a
        # sliding-window layer, whose window the model's own mask still applies; with the config,
        # transformers gives such a layer a cache capped at the window, which breaks the contract
        cache = DynamicCache()
        for i, (key, value) in enumerate(past_key_values or []):
            cache.update(key, value, i)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1 if last_logits_only else 0,
        )
        layers = out.past_key_values.layers
        return out.logits, [(layer.keys, layer.values) for layer in layers]


def _architecture(config: Mapping[str, Any], path: Path) -> str:
    names = config.get("architectures") or []
    arch = names[0] if isinstance(names, list) and names else config.get("model_type", "<none>")
    if arch not in SUPPORTED:
        raise CheckpointError(f"{path}: unsupported Hugging Face architecture {arch!r}; supported: {', '.join(sorted(SUPPORTED))}")
    return str(arch)


def _spec(model: nn.Module, arch: str) -> DecoderSpec:
    cfg: Any = model.config  # a transformers PretrainedConfig
    a = SUPPORTED[arch]
    heads = int(getattr(cfg, a.heads))
    kv = int(getattr(cfg, a.kv_heads) or heads) if a.kv_heads else heads
    hidden = int(getattr(cfg, a.hidden))
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)

    def token(name: str) -> int | None:
        value = getattr(cfg, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        return int(value) if value is not None else None

    return DecoderSpec(
        family=HFFamily.name,
        n_layers=int(getattr(cfg, a.layers)),
        n_kv_heads=kv,
        head_dim=head_dim,
        vocab_size=int(cfg.vocab_size),
        max_context=int(getattr(cfg, a.context)),
        bos_token_id=token("bos_token_id"),
        eos_token_id=token("eos_token_id"),
        pad_token_id=token("pad_token_id"),
        config={"architecture": arch, **{k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))}},
    )


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise CheckpointError("Hugging Face checkpoints need transformers: pip install 'kiln[hf]'") from None
    return transformers


class HFFamily:
    name = "hf"
    description = "Hugging Face causal LMs from a local directory: " + ", ".join(sorted(SUPPORTED))

    def claims(self, config: dict[str, Any]) -> bool:
        return "architectures" in config or "model_type" in config

    def load(self, path: Path) -> LoadedModel:
        directory = path if path.is_dir() else path.parent
        from kiln.plugins import read_config

        arch = _architecture(read_config(directory), directory)
        weights = sorted(directory.glob("*.safetensors"))
        if not weights:
            raise CheckpointError(f"{directory}: no *.safetensors weights (kiln reads no pickled Hugging Face weights)")
        transformers = _transformers()
        try:
            model = getattr(transformers, arch).from_pretrained(
                directory, local_files_only=True, use_safetensors=True, dtype="auto", attn_implementation="eager"  # the checkpoint's dtype
            )
        except (OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{directory}: transformers could not load it ({str(exc).splitlines()[0]})") from None
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and non_finite(tensor):
                raise CheckpointError(f"{directory}: {name} has non-finite values (NaN or Inf)")
        tokenizer = directory / "tokenizer.json"
        files = (directory / "config.json", *weights) + ((tokenizer,) if tokenizer.is_file() else ())
        # beside model.onnx these make the export's onnx/ a directory Optimum's ORTModelForCausalLM loads
        serving = tuple(p for p in (directory / "config.json", directory / "generation_config.json") if p.is_file())
        return _loaded(model, arch, path, tokenizer if tokenizer.is_file() else None, files, serving)

    def tiny(self, seed: int) -> LoadedModel:
        return tiny_model("LlamaForCausalLM", seed)


TINY_CONFIGS: dict[str, Callable[[Any], Any]] = {
    "LlamaForCausalLM": lambda t: t.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    "Qwen2ForCausalLM": lambda t: t.Qwen2Config(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    "MistralForCausalLM": lambda t: t.MistralConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64),
    "GPT2LMHeadModel": lambda t: t.GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=64),
}


def tiny_model(arch: str, seed: int) -> LoadedModel:
    """A tiny randomly initialised model of ``arch`` (for tests; no download)."""
    transformers = _transformers()
    torch.manual_seed(seed)
    config = TINY_CONFIGS[arch](transformers)
    config.architectures = [arch]
    # eager attention, as load() uses: with SDPA, fully masked (left-padding) query rows differ
    # between PyTorch and the traced graph, and padded positions' keys with them
    model = getattr(transformers, arch)._from_config(config, attn_implementation="eager").eval()
    return _loaded(model, arch, Path(f"<tiny {arch}>"))


def _loaded(
    model: nn.Module, arch: str, source: Path, tokenizer: Path | None = None, files: tuple[Path, ...] = (), serving: tuple[Path, ...] = ()
) -> LoadedModel:
    spec = dataclasses.replace(_spec(model, arch), dtype=str(next(model.parameters()).dtype).removeprefix("torch."))
    return LoadedModel(HFDecoder(model).eval(), spec, source, tokenizer, files, layers=_layer_plan(model, arch), serving_files=serving)


def _layer_plan(model: nn.Module, arch: str) -> LayerPlan | None:
    """The decoder layers are the one ``nn.ModuleList`` with a module per layer; layers of one
    class, parameter shapes and ``config.layer_types`` entry (sliding or full attention...) share
    a structure. The template is the model built from its config with fewer layers, on meta."""
    config: Any = model.config
    n_layers = int(config.num_hidden_layers)
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    if len(lists) != 1:
        return None
    path, layers = lists[0]
    kinds = list(getattr(config, "layer_types", None) or [None] * n_layers)
    signatures = tuple((type(layer).__name__, tuple((n, tuple(t.shape)) for n, t in layer.state_dict().items()), kind) for layer, kind in zip(layers, kinds, strict=True))
    return LayerPlan(f"model.{path}.{{}}", signatures, functools.partial(_meta_template, arch, config))


def _meta_template(arch: str, config: Any, n_layers: int) -> nn.Module:
    transformers = _transformers()
    template = copy.deepcopy(config)
    template.num_hidden_layers = n_layers
    if getattr(template, "layer_types", None):
        template.layer_types = list(template.layer_types)[:n_layers]
    with torch.device("meta"):
        model = getattr(transformers, arch)._from_config(template, attn_implementation="eager", dtype=torch.float32)  # the graphs' dtype
    return HFDecoder(model.eval()).eval()


HF = HFFamily()
