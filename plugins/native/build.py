"""The native family's torch side: a checkpoint loaded into ``PLEDecoder``, the meta template the
exporter traces, and randomly initialised models for tests (imported only when a model is built)."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import torch

from kiln.errors import CheckpointError
from kiln.plugins.base import LayerPlan, LoadedModel
from kiln.plugins.files import checkpoint_dir, checkpoint_tokenizer
from kiln.plugins.native.checkpoint import (
    Header,
    apply_state_dict,
    check_header,
    find_weights,
    read_state_dict,
    state_dtype,
    state_header,
)
from kiln.plugins.native.config import NativeConfig
from kiln.plugins.native.model import PLEDecoder
from kiln.plugins.native.ple import NATIVE_PLE
from kiln.plugins.native.spec import FAMILY, spec_of

__all__ = ["load", "loaded_model", "meta_template", "random_model"]

_LAYER = re.compile(r"^layers\.(\d+)\.")  # layer i's tensors (LayerPlan's prefix "layers.{}")


def load(path: Path) -> LoadedModel:
    """The checkpoint at ``path`` (a directory, or its weights file) in its own dtype: its
    config, tokenizer and weights' header checked before the module is built (nothing the
    config's sizes would allocate is allocated for weights that do not have them)."""
    directory = checkpoint_dir(path)
    cfg = NativeConfig.load(directory / "config.json")
    tokenizer = checkpoint_tokenizer(directory)
    weights = find_weights(path)
    state = read_state_dict(weights)
    header = state_header(state)
    _check_sizes(cfg, header, weights)
    check_header(meta_template(cfg, cfg.n_layers), header, weights)
    module = PLEDecoder(cfg)
    dtype = state_dtype(state)
    for (
        parameter
    ) in module.parameters():  # the checkpoint's dtype, not an fp32 copy of it (buffers such as inv_freq stay fp32)
        parameter.data = parameter.data.to(dtype)
    apply_state_dict(module, state, weights)
    files = (directory / "config.json", weights) + ((tokenizer,) if tokenizer else ())
    return loaded_model(cfg, module, path, tokenizer, files)


def _check_sizes(cfg: NativeConfig, header: Header, weights: Path) -> None:
    """The config's sizes that every native checkpoint shows at a glance, against the weights'
    header: the layers it holds (``layers.{i}.``) and the embedding ``[vocab_size, d_model]``
    (stored as ``embed.weight``, or ``lm_head.weight`` when tied). Checked before any template
    is built, so a config of absurd sizes is named at once (fewer layers in the config than in
    the weights: ``check_header`` names the unexpected ones)."""
    held = {int(m.group(1)) for key in header if (m := _LAYER.match(key))}
    problem = None
    if cfg.n_layers > len(held):
        span = f" (layers.{min(held)} to layers.{max(held)})" if held else ""
        problem = f"config.json says n_layers={cfg.n_layers}, the weights hold {len(held)} layers{span}"
    key = next((k for k in ("embed.weight", "lm_head.weight") if k in header), None)
    if problem is None and key is not None and header[key][0] != (cfg.vocab_size, cfg.d_model):
        problem = (
            f"{key} has shape {list(header[key][0])}, the config needs [vocab_size, d_model] = "
            f"{[cfg.vocab_size, cfg.d_model]}"
        )
    if problem is not None:
        raise CheckpointError(f"{weights}: weights do not match the config: {problem}")


def loaded_model(
    cfg: NativeConfig, module: PLEDecoder, source: Path, tokenizer: Path | None = None, files: tuple[Path, ...] = ()
) -> LoadedModel:
    """A native model as the exporter sees it, with the family's PLE folding and layer plan."""
    plan = LayerPlan("layers.{}", (FAMILY,) * cfg.n_layers, functools.partial(meta_template, cfg))
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
