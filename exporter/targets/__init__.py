"""Runtime targets: copies of the portable graphs rewritten for one runtime, written beside the
portable graphs (never replacing them) and parity-checked the same way.

The registry of ``Target`` objects (``base``): the pipeline, parity, ``kiln check`` and the CLI's
``--target`` choices and each target's own flags iterate it. A new target is its own folder and
one entry in ``TARGETS`` (a ``kiln.registry.Registry``: name -> ``"module:attribute"``; another
package's, an entry point of the ``kiln.targets`` group), imported only when first asked for:
the CLI reads the names without importing onnx or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.errors import ConfigError
from kiln.registry import Registry

if TYPE_CHECKING:
    from kiln.exporter.targets.base import EngineGraphs, Target

__all__ = ["PORTABLE", "TARGETS", "engine_target", "names", "target", "targets"]

PORTABLE = "portable"  # --target portable: the portable graphs only (every export has them)


def _target(obj: Any) -> Target | None:
    """What a target entry must load to: an object with the ``Target`` interface's name, flags and methods."""
    needed: tuple[str, ...] = ("name", "label", "description", "flags", "kv_caches", "letter", "lora_slots")
    needed += ("reasons", "wanted", "write", "runner", "quantized_precision", "serves_genai")
    return obj if all(hasattr(obj, attribute) for attribute in needed) else None


TARGETS: Registry[Target] = Registry(
    "target",
    "kiln.targets",
    {  # the one registration of each target
        "ort": "kiln.exporter.targets.ort:ORT",
        "onnx": "kiln.exporter.targets.onnx:ONNX",
    },
    _target,
)


def names() -> tuple[str, ...]:
    """Every target's name (``--target`` takes these and ``portable``)."""
    return TARGETS.names()


def target(name: str) -> Target:
    """The registered target ``name``; an unknown name is one ``ConfigError``."""
    if name not in TARGETS:
        raise ConfigError(f"--target {name!r} is not a target; choose {', '.join((PORTABLE, *TARGETS.names()))}")
    return TARGETS.get(name)


def targets() -> list[Target]:
    """Every registered target, in registration order."""
    return TARGETS.all()


def engine_target() -> tuple[Target, EngineGraphs]:
    """The target whose graphs ``kiln build`` makes TensorRT engines of (the first that declares
    ``engines``, ``targets.base``), with that declaration; none is one ``ConfigError``."""
    for each in targets():
        declared = getattr(each, "engines", None)
        if declared is not None:
            return each, declared
    raise ConfigError("no registered target declares graphs kiln build makes TensorRT engines of (Target.engines)")
