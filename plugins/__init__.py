"""The registry of model families.

``load_model(path)`` reads the checkpoint's ``config.json`` and asks each registered family
whether it claims it. Families register with ``register``; third-party packages can add theirs
through the ``kiln.plugins`` entry-point group (each entry point names a ``ModelFamily``
instance or a zero-argument callable returning one).
"""

from __future__ import annotations

from importlib import metadata, resources
from pathlib import Path
from typing import Any

from kiln.errors import CheckpointError
from kiln.jsonfile import read_json_object
from kiln.plugins.base import DecoderSpec, LoadedModel, ModelFamily

__all__ = [
    "DecoderSpec",
    "LoadedModel",
    "ModelFamily",
    "register",
    "families",
    "resolve_checkpoint",
    "load_model",
    "DEMO",
]

DEMO = "demo"
_FAMILIES: dict[str, ModelFamily] = {}
_ENTRY_POINTS_LOADED = False


def register(family: ModelFamily) -> ModelFamily:
    """Add a family; a second family under the same name is a programming error."""
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family:
        raise ValueError(f"a model family named {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def families() -> list[ModelFamily]:
    """Every registered family: built-in ones first, then entry points, in name order."""
    _load_entry_points()
    return [_FAMILIES[name] for name in sorted(_FAMILIES)]


def _load_entry_points() -> None:
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    for ep in metadata.entry_points(group="kiln.plugins"):
        obj = ep.load()
        family = obj
        if not isinstance(obj, ModelFamily) and callable(obj):
            try:
                family = obj()
            except Exception:  # third-party code: any failure means "not a family factory"
                family = None
        if not isinstance(family, ModelFamily):
            raise CheckpointError(f"entry point {ep.name!r} ({ep.value}) does not provide a kiln ModelFamily")
        register(family)


def resolve_checkpoint(model: str | Path) -> Path:
    """``"demo"`` is the bundled demo checkpoint; anything else is a path that must exist."""
    if str(model) == DEMO:
        path = Path(str(resources.files("kiln.demo") / "checkpoint"))
        if not (path / "config.json").is_file():
            raise CheckpointError(f"the bundled demo checkpoint is missing at {path}; reinstall kiln")
        return path
    path = Path(model)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint file or directory")
    return path


def read_config(path: Path) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint directory (or beside a checkpoint file)."""
    cfg_path = (path if path.is_dir() else path.parent) / "config.json"
    missing = f"{cfg_path}: config.json not found; a checkpoint is a directory with config.json and model.safetensors"
    return read_json_object(cfg_path, CheckpointError, missing)


def load_model(model: str | Path) -> LoadedModel:
    """Find the family that claims the checkpoint and load it."""
    path = resolve_checkpoint(model)
    config = read_config(path)
    for family in families():
        if family.claims(config):
            return family.load(path)
    arch = config.get("architecture", config.get("architectures", config.get("model_type", "<none>")))
    names = ", ".join(f.name for f in families())
    raise CheckpointError(f"{path}: unknown architecture {arch!r}; supported families: {names}")


def _register_builtins() -> None:
    from kiln.plugins.hf import HF
    from kiln.plugins.native import NATIVE

    register(NATIVE)
    register(HF)


_register_builtins()
