"""The load stage: the PyTorch side of an export. What may be exported (context limit; the refusals are the plan's,
``exporter.plan``), the LoRA adapters merged into it (``--adapter``), and the reference module that parity is measured
against (shared by ``export`` and ``check``): with adapters, PEFT's own model of base + adapters."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from kiln.errors import ConfigError, ExportError
from kiln.exporter.contract.limits import MAX_CONTEXT, MIN_CONTEXT
from kiln.exporter.options import ExportOptions
from kiln.exporter.plan import plan
from kiln.plugins import LoadedModel
from kiln.plugins.base import DecoderSpec
from kiln.plugins.hub_cache import HF_EXTRA

if TYPE_CHECKING:
    from kiln.exporter.contract.lora import LoraSlots
    from kiln.plugins.hf.adapter import LoraAdapter

__all__ = [
    "Reference",
    "adapter_reference",
    "load_reference",
    "lora_slots",
    "merge_adapters",
    "prepare_reference",
    "read_adapters",
    "resolve_limits",
]


@dataclasses.dataclass(frozen=True)
class Reference:
    """The model as it is deployed (PLE tables extended when asked) and the context it is exported for."""

    loaded: LoadedModel
    module: nn.Module
    max_context: int

    @property
    def spec(self) -> DecoderSpec:
        return self.loaded.spec


def load_reference(loaded: LoadedModel, options: ExportOptions) -> Reference:
    plan(options, loaded.spec)  # every refusal, the model's structure's among them, before any work is done
    max_context = resolve_limits(loaded.spec, options)
    return Reference(loaded, prepare_reference(loaded, options), max_context)


def resolve_limits(spec: DecoderSpec, options: ExportOptions) -> int:
    """The exported context length; refuses one longer than the model or its PLE table (a
    config's spec will do: ``export`` checks it before the weights load)."""
    table = options.ple_extend or spec.ple_positions
    limit = spec.max_context
    context = options.max_context or (min(limit, table) if table and limit else limit or table)
    if context is None:
        raise ExportError(f"{spec.max_context_why or 'the model has no context limit'}: pass --max-context N")
    if not MIN_CONTEXT <= context <= MAX_CONTEXT:  # a config's limit (--max-context is ranged at the command line)
        raise ExportError(
            f"the model's max_context {context} is outside what an export can declare ({MIN_CONTEXT} to {MAX_CONTEXT})"
            + ("; pass --max-context N" if context > MAX_CONTEXT else "")
        )
    if limit is not None and context > limit:
        why = f" ({spec.max_context_why})" if spec.max_context_why else ""
        raise ExportError(f"--max-context {context} exceeds the model's max_context {limit}{why}")
    if spec.ple_positions is not None and context > (options.ple_extend or spec.ple_positions):
        rows = options.ple_extend or spec.ple_positions
        raise ExportError(
            f"--max-context {context} is longer than the PLE table ({rows} rows): positions past it would "
            f"gather out of bounds; pass --ple-extend {context} (with --ple-extend-mode clamp|interpolate) or a "
            "smaller --max-context"
        )
    if options.ple_extend is not None and spec.ple_positions is None:
        raise ExportError("--ple-extend was given but the model has no PLE tables")
    return context


def prepare_reference(loaded: LoadedModel, options: ExportOptions) -> nn.Module:
    """The PyTorch module parity is measured against: the checkpoint's, with its PLE tables
    extended when ``--ple-extend`` asks for it (the extended model is what is deployed)."""
    if options.ple_extend is not None:
        if loaded.ple is None:
            raise ExportError("--ple-extend was given but the model has no PLE tables")
        loaded.ple.extend(loaded.module, options.ple_extend, options.ple_extend_mode)
    return loaded.module


def lora_slots(reference: Reference, options: ExportOptions) -> LoraSlots | None:
    """``--lora-slots RANK``: the slots of a Hugging Face decoder (other families have no PEFT
    module paths to name them by, and are refused)."""
    if options.lora_slots is None:
        return None
    from kiln.exporter.lora import plan_slots
    from kiln.plugins.hf.decoder import HFDecoder

    if not isinstance(reference.module, HFDecoder):
        raise ConfigError(
            "--lora-slots: kiln writes LoRA slots on Hugging Face decoder checkpoints only; "
            f"{reference.loaded.source} is not one"
        )
    return plan_slots(reference.module.model, options.lora_slots, options.precision.kv_dtype, options.lora_targets)


def read_adapters(
    loaded: LoadedModel, adapters: Sequence[tuple[Path, float]], model_ref: str | Path | None
) -> tuple[LoraAdapter, ...]:
    """``(directory, weight)`` adapters read and checked against ``loaded``'s base (its name and
    every module's shapes); refused for anything but a Hugging Face decoder read from disk."""
    from kiln.plugins.hf.adapter import base_names, check_base, read_adapter
    from kiln.plugins.hf.decoder import HFDecoder

    if not isinstance(loaded.module, HFDecoder):
        kind = "an encoder-decoder" if loaded.spec.has_encoder else f"a {loaded.spec.family} checkpoint"
        raise ConfigError(
            f"--adapter: kiln merges LoRA adapters into Hugging Face decoder checkpoints only; {loaded.source} "
            f"is {kind}"
        )
    if not loaded.source.exists():
        raise ConfigError(
            f"--adapter: {loaded.source} is not on disk; parity loads the base again for PEFT's model of base + "
            "adapters"
        )
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(
            f"--adapter needs peft (parity's reference is PEFT's own model of base + adapters): {HF_EXTRA}"
        )
    read = tuple(read_adapter(Path(path), weight) for path, weight in adapters)
    names = base_names(model_ref if model_ref is not None else loaded.source, loaded.source)
    for adapter in read:
        check_base(adapter, loaded.module.model, names)
    return read


def merge_adapters(
    loaded: LoadedModel, options: ExportOptions, model_ref: str | Path | None
) -> tuple[LoraAdapter, ...]:
    """``--adapter``: the adapters read, checked and merged into ``loaded``'s weights in place
    (what is traced and deployed); none given: nothing changes."""
    if not options.adapters:
        return ()
    from kiln.plugins.hf.adapter import merge

    adapters = read_adapters(loaded, [(a.path, a.weight) for a in options.adapters], model_ref)
    hf: Any = loaded.module  # an HFDecoder (read_adapters refuses other families)
    merge(hf.model, adapters)
    return adapters


def adapter_reference(base: LoadedModel, adapters: Sequence[LoraAdapter]) -> nn.Module:
    """Parity's reference with ``--adapter``: PEFT's model of ``base`` (loaded unmerged; changed in
    place) and the adapters, behind the decoder contract. Never kiln's merged weights."""
    from kiln.plugins.hf.adapter import peft_reference
    from kiln.plugins.hf.decoder import HFDecoder

    assert isinstance(base.module, HFDecoder), "read_adapters refuses other families"
    return HFDecoder(peft_reference(base.module.model, adapters)).eval()
