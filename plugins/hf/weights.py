"""A Hugging Face checkpoint's weights against its config, before and after transformers loads them.

Before: the safetensors headers (``model.safetensors``, or the shards a
``model.safetensors.index.json`` names; shapes and dtypes read with ``safe_open``, no tensor
read) against the model built from the config on the meta device (no memory): a config whose
sizes the weights do not have is one line before transformers allocates anything. Names the two
do not share are left to transformers' own key mapping (renamed or fused checkpoint keys).

After: transformers' loading info (``output_loading_info=True``), which kiln turns into one
line instead of transformers' load report: a weight the checkpoint lacks would be initialised at
random, one the model has no place for would be dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kiln.errors import CheckpointError
from kiln.inputs import check_input
from kiln.jsonfile import read_json_object

__all__ = ["INDEX", "SINGLE", "Header", "check_sizes", "read_headers", "refuse_loading_info"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHOWN = 5  # names an error lists before "and N more"

Header = dict[str, tuple[tuple[int, ...], Path]]  # tensor name -> (shape, the file holding it)


def _shards(directory: Path) -> list[Path]:
    """The files transformers reads: ``model.safetensors``, else the index's shards (each checked
    to be a plain file name in ``directory``); none when there is neither."""
    if (directory / SINGLE).is_file():
        return [directory / SINGLE]
    index = directory / INDEX
    if not index.is_file():
        return []
    data = read_json_object(index, CheckpointError, f"{index}: not found")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: expected a weight_map object of tensor name -> shard file name")
    if not isinstance(data.get("metadata", {}), dict):  # transformers reads its fields by name
        raise CheckpointError(f"{index}: metadata must be an object, found {type(data['metadata']).__name__}")
    names = sorted(set(weight_map.values()))
    for name in names:
        if Path(name).name != name or not (directory / name).is_file():
            raise CheckpointError(f"{index}: names the shard {name!r}, which is not a file of {directory}")
    return [directory / name for name in names]


def read_headers(directory: Path) -> Header:
    """Every tensor's shape, from the headers of the safetensors files transformers would read."""
    header: Header = {}
    for path in _shards(directory):
        check_input(path, CheckpointError, None)  # safetensors opens it by name, and would wait on a FIFO
        try:
            with safe_open(str(path), framework="pt") as file:
                for key in file.keys():
                    header[key] = (tuple(file.get_slice(key).get_shape()), path)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(
                f"{path}: not a readable safetensors file "
                f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
            ) from None
    return header


def _capped(items: list[str], sep: str = ", ") -> str:
    shown = sep.join(items[:_SHOWN])
    return shown + (f"{sep}and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def check_sizes(model_class: Any, config: Any, header: Header, directory: Path) -> None:
    """The shapes of the model ``config`` describes (built on meta) against ``header``."""
    if not header and not _shards(directory):
        # no safetensors file transformers reads: from_pretrained says so (a file of no tensors is checked below)
        return
    layers = int(
        getattr(config, "text_config", config).num_hidden_layers
    )  # a multimodal wrapper's are its text decoder's
    if layers > len(header):  # every layer holds a tensor of its own
        raise CheckpointError(
            f"{directory}: weights do not match the config: config.json says num_hidden_layers={layers}, but the "
            f"weights hold {len(header)} tensors in all"
        )
    try:
        with torch.device("meta"):
            # PreTrainedModel._from_config is private, but transformers has no public way to build a named
            # class (not the Auto mapping's) from a config with an attention implementation and dtype
            model = model_class._from_config(config, attn_implementation="eager")
    # values transformers' config accepts but its modules cannot be built from (issue 38's fuzz: an int
    # dtype, an unknown hidden_act, a negative size, a pad id past the vocabulary, a rope_theta of null)
    except (
        KeyError,
        RuntimeError,
        AssertionError,
        TypeError,
        AttributeError,
        ValueError,
        ArithmeticError,
        IndexError,
    ) as exc:
        first = " ".join(str(exc).split()) or type(exc).__name__
        raise CheckpointError(
            f"{directory / 'config.json'}: transformers cannot build the model it describes "
            f"({type(exc).__name__}: {first[:200]})"
        ) from None
    prefix = f"{model.base_model_prefix}."
    problems = []
    for name, tensor in model.state_dict().items():
        key = next((k for k in (name, prefix + name, name.removeprefix(prefix)) if k in header), None)
        if key is not None and header[key][0] != tuple(tensor.shape):
            shape, path = header[key]
            problems.append(f"{key} has shape {list(shape)} in {path.name}, the config needs {list(tensor.shape)}")
    if problems:
        raise CheckpointError(f"{directory}: weights do not match the config: {_capped(problems, '; ')}")


def refuse_loading_info(info: Mapping[str, Any], directory: Path) -> None:
    """What transformers would initialise at random (missing) or drop (unexpected), in one line."""
    problems = []
    if missing := sorted(info.get("missing_keys") or ()):
        problems.append(f"missing keys {_capped(missing)} (transformers would initialise them at random)")
    if unexpected := sorted(info.get("unexpected_keys") or ()):
        problems.append(f"unexpected keys {_capped(unexpected)} (transformers would drop them)")
    if mismatched := sorted(str(m[0]) for m in info.get("mismatched_keys") or ()):
        problems.append(f"keys of another shape {_capped(mismatched)}")
    if problems:
        raise CheckpointError(f"{directory}: weights do not match the config: {'; '.join(problems)}")
