"""The load stage: the PyTorch side of an export. The reference module at the plan's context (the
refusals, the context's among them, are the plan's: ``exporter.plan``), the LoRA adapters merged into it
(``--adapter``), and the reference module that parity is measured against (shared by ``export`` and
``check``): with adapters, PEFT's own model of base + adapters."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from kiln.errors import ConfigError, ExportError
from kiln.exporter.options import ExportOptions
from kiln.file_pages import release_module_pages
from kiln.plugins import LoadedModel
from kiln.plugins.base import DecoderSpec
from kiln.plugins.hub_cache import HF_EXTRA

if TYPE_CHECKING:
    from kiln.exporter.contract.lora import LoraSlots
    from kiln.exporter.plan import ExportPlan
    from kiln.plugins.hf.adapter import LoraAdapter

__all__ = [
    "Reference",
    "adapter_reference",
    "load_reference",
    "lora_slots",
    "merge_adapters",
    "prepare_reference",
    "read_adapters",
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


def load_reference(loaded: LoadedModel, planned: ExportPlan) -> Reference:
    """The reference of ``loaded`` at the context ``planned`` (asked with ``loaded``'s spec) was sized for."""
    assert planned.spec is loaded.spec and planned.max_context is not None, "the plan of this model, sized"
    return Reference(loaded, prepare_reference(loaded, planned.options), planned.max_context)


def prepare_reference(loaded: LoadedModel, options: ExportOptions) -> nn.Module:
    """The PyTorch module parity is measured against: the checkpoint's, with its PLE tables
    extended when ``--ple-extend`` asks for it (the extended model is what is deployed)."""
    if options.ple.extend is not None:
        if loaded.ple is None:
            raise ExportError("--ple-extend was given but the model has no PLE tables")
        loaded.ple.extend(loaded.module, options.ple.extend, options.ple.extend_mode)
    release_module_pages(loaded.module)  # the load's checks read every weight: each stage maps what it reads again
    return loaded.module


def lora_slots(reference: Reference, options: ExportOptions) -> LoraSlots | None:
    """``--lora-slots RANK``: the slots of a Hugging Face decoder (other families have no PEFT
    module paths to name them by, and are refused)."""
    if options.lora.slots is None:
        return None
    from kiln.exporter.lora import plan_slots
    from kiln.plugins.hf.decoder import HFDecoder

    if not isinstance(reference.module, HFDecoder):
        raise ConfigError(
            "--lora-slots: kiln writes LoRA slots on Hugging Face decoder checkpoints only; "
            f"{reference.loaded.source} is not one"
        )
    return plan_slots(reference.module.model, options.lora.slots, options.precision.kv_dtype, options.lora.targets)


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
    if not options.lora.adapters:
        return ()
    from kiln.plugins.hf.adapter import merge

    adapters = read_adapters(loaded, [(a.path, a.weight) for a in options.lora.adapters], model_ref)
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
