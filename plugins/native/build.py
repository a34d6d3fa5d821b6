"""The native family's torch side: a checkpoint loaded into ``PLEDecoder``, the meta template the
exporter traces, and randomly initialised models for tests (imported only when a model is built)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from kiln.plugins.base import LayerPlan, LoadedModel
from kiln.plugins.native import NativeFamily, spec_of
from kiln.plugins.native.checkpoint import apply_state_dict, find_weights, read_state_dict, state_dtype
from kiln.plugins.native.config import NativeConfig
from kiln.plugins.native.model import PLEDecoder
from kiln.plugins.native.ple import NATIVE_PLE

__all__ = ["load", "loaded_model", "meta_template", "random_model"]


def load(path: Path) -> LoadedModel:
    """The checkpoint at ``path`` (a directory, or its weights file) in its own dtype."""
    directory = path if path.is_dir() else path.parent
    cfg = NativeConfig.load(directory / "config.json")
    weights = find_weights(path)
    state = read_state_dict(weights)
    module = PLEDecoder(cfg)
    dtype = state_dtype(state)
    for parameter in module.parameters():  # the checkpoint's dtype, not an fp32 copy of it (buffers such as inv_freq stay fp32)
        parameter.data = parameter.data.to(dtype)
    apply_state_dict(module, state, weights)
    tokenizer = directory / "tokenizer.json"
    files = (directory / "config.json", weights) + ((tokenizer,) if tokenizer.is_file() else ())
    return loaded_model(cfg, module, path, tokenizer if tokenizer.is_file() else None, files)


def loaded_model(cfg: NativeConfig, module: PLEDecoder, source: Path, tokenizer: Path | None = None, files: tuple[Path, ...] = ()) -> LoadedModel:
    """A native model as the exporter sees it, with the family's PLE folding and layer plan."""
    plan = LayerPlan("layers.{}", (NativeFamily.name,) * cfg.n_layers, functools.partial(meta_template, cfg))
    spec = dataclasses.replace(spec_of(cfg), dtype=str(next(module.parameters()).dtype).removeprefix("torch."))
    return LoadedModel(module.eval(), spec, source, tokenizer, files, NATIVE_PLE if cfg.ple.enabled else None, plan)


def meta_template(cfg: NativeConfig, n_layers: int) -> PLEDecoder:
    """The model with its first ``n_layers`` layers, weights on the meta device (no memory); every
    layer of the native decoder has the one structure its config gives."""
    with torch.device("meta"):
        return PLEDecoder(dataclasses.replace(cfg, n_layers=n_layers)).eval()


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
