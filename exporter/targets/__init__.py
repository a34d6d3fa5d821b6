"""Runtime targets: copies of the portable graphs rewritten for one runtime, written beside the
portable graphs (never replacing them) and parity-checked the same way.

The registry of ``Target`` objects (``base``): the pipeline, parity, ``kiln check`` and the CLI's
``--target`` choices iterate it. A new target is its own folder and one line in ``_BUILTIN``
(name -> module and attribute), imported only when first asked for: the CLI reads the names
without importing onnx or torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kiln.errors import ConfigError

if TYPE_CHECKING:
    from kiln.exporter.targets.base import Target

__all__ = ["PORTABLE", "names", "target", "targets"]

PORTABLE = "portable"  # --target portable: the portable graphs only (every export has them)
_BUILTIN = {  # the one registration of each target
    "ort": ("kiln.exporter.targets.ort", "ORT"),
    "onnx": ("kiln.exporter.targets.onnx", "ONNX"),
}
_LOADED: dict[str, Target] = {}


def names() -> tuple[str, ...]:
    """Every target's name (``--target`` takes these and ``portable``)."""
    return tuple(_BUILTIN)


def target(name: str) -> Target:
    """The registered target ``name``; an unknown name is one ``ConfigError``."""
    if name not in _BUILTIN:
        raise ConfigError(f"--target {name!r} is not a target; choose {', '.join((PORTABLE, *_BUILTIN))}")
    if name not in _LOADED:
        module, attribute = _BUILTIN[name]
        _LOADED[name] = getattr(importlib.import_module(module), attribute)
    return _LOADED[name]


def targets() -> list[Target]:
    """Every registered target, in registration order."""
    return [target(name) for name in _BUILTIN]
