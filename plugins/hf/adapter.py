"""PEFT LoRA adapters merged into a Hugging Face checkpoint at export (``kiln export --adapter``).

An adapter is a directory PEFT's ``save_pretrained`` wrote: ``adapter_config.json`` and
``adapter_model.safetensors`` (a pickled ``adapter_model.bin`` is refused, as kiln reads no pickled
weights). Each target module's weight becomes

    W' = W + sum_i w_i * s_i * (B_i @ A_i)        (transposed for GPT-2's Conv1D, whose weight is [in, out])

with ``s_i = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``) and ``w_i`` the weight
``--adapter DIR:W`` gives (1 by default): the exact sum that PEFT's ``add_weighted_adapter(...,
combination_type="cat")`` merges. The merge is done once on the loaded float weights, so every
later stage (precisions, targets, serving configs) sees a plain model.

Refused by name, before any weight changes: another PEFT type (IA3, ...), DoRA and the other
LoRA variants and fields that make an adapter more than ``B @ A`` per module (``_REFUSED``),
LoRA on embeddings, a module that is not a Linear or Conv1D, a tied weight, a lora_A/lora_B of
another shape than the base's weight, and a ``base_model_name_or_path`` whose last component is
not the checkpoint's name (``check_base``).

The parity reference is PEFT's own model (``peft_reference``): the base with every adapter
injected and active, each scaled by its weight (``set_scale``), never kiln's merged weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn

from kiln.errors import ConfigError
from kiln.inputs import check_input, open_input
from kiln.jsonfile import read_json_object

__all__ = [
    "CONFIG",
    "WEIGHTS",
    "LoraAdapter",
    "base_names",
    "check_base",
    "check_base_name",
    "merge",
    "peft_reference",
    "read_adapter",
]

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."  # what PEFT's saved keys start with: the LoRA model's wrapped model
_HALVES = (".lora_A.weight", ".lora_B.weight")
# a base weight PEFT saves beside the LoRA (an lm_head target: in case the vocabulary was resized)
_SAVED = ".base_layer.weight"
# adapter_config.json fields that make an adapter more than B @ A per module (refused when set)
_REFUSED = {
    "use_dora": "DoRA rescales every column of the merged weight by a learned magnitude",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "whole modules saved beside the LoRA weights",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "layer_replication": "layers duplicated by the adapter",
    "target_parameters": "LoRA on bare parameters (mixture-of-experts weights)",
    "trainable_token_indices": "trained embedding rows",
    "alora_invocation_tokens": "activated LoRA (applied only after its invocation tokens)",
    "megatron_config": "Megatron-parallel layers",
    "use_qalora": "QA-LoRA (pooled inputs)",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing between adapters",
    "kasa_config": "KaSA (singular values of the base weight)",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA (sampled weights)",
}


@dataclasses.dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One adapter as read and checked: its config's numbers and its lora_A/lora_B per module."""

    path: Path  # as given on the command line
    weight: float  # its w in the weighted sum
    rank: int  # r
    alpha: float  # lora_alpha
    rslora: bool  # scaling alpha / sqrt(r) instead of alpha / r
    base: str | None  # base_model_name_or_path (None when empty)
    sha256: dict[str, str]  # of adapter_config.json and adapter_model.safetensors
    tensors: Mapping[str, tuple[Tensor, Tensor]]  # module path in the transformers model -> (A [r, in], B [out, r])
    saved: Mapping[str, Tensor] = dataclasses.field(
        default_factory=dict
    )  # module path -> the base weight PEFT saved (must be the checkpoint's)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @property
    def targets(self) -> tuple[str, ...]:
        """The names of the modules it changes (``q_proj``, ``c_attn``), sorted."""
        return tuple(sorted({path.rsplit(".", 1)[-1] for path in self.tensors}))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open_input(path, ConfigError, None) as file:  # streamed: any size; never a FIFO or a device
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_adapter(path: Path, weight: float) -> LoraAdapter:
    """The adapter in directory ``path``, its config refused by name where kiln cannot merge it exactly."""
    where = f"--adapter {path}"
    if not path.is_dir():
        raise ConfigError(f"{where}: no such directory (an adapter is the directory PEFT's save_pretrained writes)")
    if not (path / WEIGHTS).is_file():
        pickled = (
            " (adapter_model.bin is pickled, which kiln does not read: save it again with safe_serialization=True)"
            if (path / "adapter_model.bin").is_file()
            else ""
        )
        raise ConfigError(f"{where}: no {WEIGHTS}{pickled}")
    config = read_json_object(path / CONFIG, ConfigError, f"{where}: no {CONFIG}")
    rank, alpha = _refuse_config(config, where)
    check_input(path / WEIGHTS, ConfigError, None)  # safetensors opens it by name
    try:
        tensors = load_file(str(path / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(
            f"{where}: {WEIGHTS} is not a readable safetensors file "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        ) from None
    base = config.get("base_model_name_or_path")
    saved = {
        key[len(_PREFIX) : -len(_SAVED)]: tensors.pop(key)
        for key in list(tensors)
        if key.startswith(_PREFIX) and key.endswith(_SAVED)
    }
    pairs = _pairs(tensors, where, rank)
    if alone := sorted(set(saved) - set(pairs)):
        raise ConfigError(
            f"{where}: {WEIGHTS} holds base weights of {', '.join(alone)} without a lora_A/lora_B for them, "
            "which kiln does not merge"
        )
    return LoraAdapter(
        path,
        float(weight),
        rank,
        alpha,
        bool(config.get("use_rslora")),
        str(base) if base else None,
        {CONFIG: _sha256(path / CONFIG), WEIGHTS: _sha256(path / WEIGHTS)},
        pairs,
        saved,
    )


def _refuse_config(config: Mapping[str, Any], where: str) -> tuple[int, float]:
    """``(r, lora_alpha)`` of a plain LoRA config; anything else is refused by name."""
    kind = config.get("peft_type")
    if kind != "LORA":
        raise ConfigError(
            f"{where}: peft_type {kind!r} is not supported: kiln merges LoRA adapters only (peft_type 'LORA')"
        )
    for name, what in _REFUSED.items():
        if config.get(name):
            raise ConfigError(
                f"{where}: {name}={config[name]!r} is not supported ({what}): kiln merges plain LoRA, W + s * B "
                "@ A per module"
            )
    if config.get("bias", "none") != "none":
        raise ConfigError(
            f"{where}: bias={config['bias']!r} is not supported (trained biases of the base): kiln merges plain "
            "LoRA, bias 'none'"
        )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ConfigError(f"{where}: r must be a positive integer in {CONFIG}, found {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ConfigError(f"{where}: lora_alpha must be a finite number in {CONFIG}, found {alpha!r}")
    return rank, float(alpha)


def _pairs(tensors: Mapping[str, Tensor], where: str, rank: int) -> dict[str, tuple[Tensor, Tensor]]:
    """Module path -> (lora_A, lora_B), every key accounted for and every pair of rank ``r``."""
    halves: dict[str, dict[int, Tensor]] = {}
    for key, tensor in tensors.items():
        half = next((i for i, suffix in enumerate(_HALVES) if key.endswith(suffix)), None)
        if not key.startswith(_PREFIX) or half is None:
            what = (
                "LoRA on an embedding"
                if "lora_embedding_" in key
                else "DoRA's magnitude"
                if "lora_magnitude_vector" in key
                else "not a lora_A/lora_B weight"
            )
            raise ConfigError(f"{where}: {WEIGHTS} holds {key!r} ({what}), which kiln does not merge")
        halves.setdefault(key[len(_PREFIX) : -len(_HALVES[half])], {})[half] = tensor
    if not halves:
        raise ConfigError(f"{where}: {WEIGHTS} holds no lora_A/lora_B weights")
    pairs = {}
    for module, found in sorted(halves.items()):
        if set(found) != {0, 1}:
            have, lack = ("A", "B") if 0 in found else ("B", "A")
            raise ConfigError(f"{where}: {module} has lora_{have} but no lora_{lack} in {WEIGHTS}")
        a, b = found[0], found[1]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ConfigError(
                f"{where}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, not [r, in] and [out, "
                f"r] with r={rank} of {CONFIG}"
            )
        for name, tensor in (("lora_A", a), ("lora_B", b)):
            if tensor.is_floating_point() and not bool(
                torch.isfinite(tensor).all()
            ):  # refused here, not after the trace
                raise ConfigError(f"{where}: {module}'s {name} holds NaN or infinite values")
        pairs[module] = (a, b)
    return pairs


def base_names(model_ref: str | Path, source: Path) -> set[str]:
    """The names a checkpoint goes by: the last component of ``--model`` (a repo id's NAME, a
    directory's name) and of the directory read (a cached snapshot's repo NAME), lower case."""
    names = {PurePosixPath(str(model_ref).rstrip("/")).name, source.name}
    names |= {part.split("--")[-1] for part in source.absolute().parts if part.startswith("models--")}
    return {name.lower() for name in names if name}


def check_base_name(adapter: LoraAdapter, names: set[str], where: str) -> None:
    """The adapter's named base (when it names one) is one of ``names`` (``base_names``)."""
    if adapter.base is not None and PurePosixPath(adapter.base.rstrip("/")).name.lower() not in names:
        raise ConfigError(
            f"{where}: its base_model_name_or_path {adapter.base!r} is not this checkpoint "
            f"({', '.join(sorted(names))}): kiln compares the last"
            f" path components; export it onto its own base, or empty base_model_name_or_path in {CONFIG} if "
            "this is that model under another name"
        )


def check_base(adapter: LoraAdapter, model: nn.Module, names: set[str]) -> None:
    """The adapter was trained on this base: its named base (when it names one) and every
    module's shapes. ``model`` is the transformers model (``HFDecoder.model``)."""
    where = f"--adapter {adapter.path}"
    check_base_name(adapter, names, where)
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    for path, (a, b) in adapter.tensors.items():
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise ConfigError(f"{where}: the base has no module {path} (an adapter of another architecture?)") from None
        out, inp = _shape(module, where, path)
        if [out, inp] != [b.shape[0], a.shape[1]]:
            raise ConfigError(
                f"{where}: {path} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, the base's weight needs "
                f"[r, {inp}] and [{out}, r]"
                " (an adapter of another base?)"
            )
        if path in adapter.saved and not torch.equal(
            adapter.saved[path], _weight(module).to(adapter.saved[path].dtype)
        ):
            raise ConfigError(
                f"{where}: {WEIGHTS} holds its own {path} base weight, which is not the checkpoint's (a resized "
                "vocabulary?); kiln merges onto the checkpoint's weights only"
            )
        if len(shared := owners[id(module.weight)]) > 1:
            raise ConfigError(
                f"{where}: {path}.weight is tied to {', '.join(n for n in shared if n != f'{path}.weight')}: "
                "merging into it would change both"
            )


def _weight(module: nn.Module) -> Tensor:
    weight = module.weight
    assert isinstance(weight, Tensor), "a Linear's or Conv1D's weight"
    return weight.detach()


def _shape(module: nn.Module, where: str, path: str) -> tuple[int, int]:
    """(out, in) of a Linear's or a Conv1D's weight; other modules are refused."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D):
        return int(module.weight.shape[1]), int(
            module.weight.shape[0]
        )  # Conv1D's weight is [in, out] (PEFT's fan_in_fan_out)
    if isinstance(module, nn.Linear):
        return int(module.out_features), int(module.in_features)
    raise ConfigError(
        f"{where}: {path} is a {type(module).__name__}; kiln merges LoRA into Linear and Conv1D modules only"
    )


def merge(model: nn.Module, adapters: Sequence[LoraAdapter]) -> None:
    """``W += sum_i w_i * s_i * B_i @ A_i`` in float32 (``check_base`` first). A bf16 or fp16
    checkpoint's merged weights are kept in float32: rounded back to the checkpoint's dtype they
    would differ from the adapter's model by that dtype's rounding (what PEFT's own
    ``merge_and_unload`` does), more than fp32 parity allows."""
    from transformers.pytorch_utils import Conv1D

    modules = sorted({path for adapter in adapters for path in adapter.tensors})
    with torch.no_grad():
        for path in modules:
            module = model.get_submodule(path)
            delta = sum(
                a.weight * a.scaling * (a.tensors[path][1].float() @ a.tensors[path][0].float())
                for a in adapters
                if path in a.tensors
            )  # [out, in]
            assert isinstance(delta, Tensor)
            if not bool(torch.isfinite(delta).all()):  # finite halves whose product overflows float32: before the trace
                named = ", ".join(str(a.path) for a in adapters if path in a.tensors)
                raise ConfigError(
                    f"--adapter {named}: {path}'s merged update (weight x scaling x B @ A) overflows float32"
                )
            weight = module.weight
            assert isinstance(weight, Tensor)
            update = delta.T if isinstance(module, Conv1D) else delta  # Conv1D: [in, out]
            if weight.dtype == torch.float32:
                weight.add_(update)
            else:
                # W + delta is no bf16/fp16 value: the merged weight stays fp32 (the graphs' own dtype, which the
                # reference computes in)
                module.weight = nn.Parameter(weight.float() + update, requires_grad=False)


def peft_reference(model: nn.Module, adapters: Sequence[LoraAdapter]) -> nn.Module:
    """PEFT's model of the base ``model`` (a transformers model, changed in place) and the
    adapters: each loaded by ``PeftModel`` from its directory, all active, each one's scale
    multiplied by its weight. Returns the transformers model with PEFT's LoRA layers in it.

    Not ``add_weighted_adapter(combination_type="cat")``, the same sum as one adapter: peft 0.21.2
    gives that adapter the first one's ``use_rslora``, so its scale is sqrt(r) instead of 1."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    names = [f"kiln{i}" for i in range(len(adapters))]
    with warnings.catch_warnings():  # GPT-2's Conv1D: PEFT warns that it sets fan_in_fan_out itself
        warnings.simplefilter("ignore")
        peft = PeftModel.from_pretrained(model, str(adapters[0].path), adapter_name=names[0], is_trainable=False)
        for name, adapter in zip(names[1:], adapters[1:], strict=True):
            peft.load_adapter(str(adapter.path), adapter_name=name, is_trainable=False)
    lora: Any = peft.base_model  # PEFT's LoraModel (nn.Module attributes type as Tensor | Module)
    lora.set_adapter(names, inference_mode=True)
    for layer in peft.modules():
        if isinstance(layer, LoraLayer):
            for name, adapter in zip(names, adapters, strict=True):
                layer.set_scale(name, adapter.weight)
    inner: nn.Module = lora.model
    return inner.eval()
