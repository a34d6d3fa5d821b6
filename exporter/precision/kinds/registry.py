"""The registry of precision kinds (``base``): the CLI's precision options, option
checks, the pipeline's precision passes, the manifest's names and records, the tolerances and
the GPU requirements all come from it. A new kind is its own file here and one entry in
``KINDS`` (a ``kiln.registry.Registry``: name -> ``"module:class"``; another package's, an entry
point of the ``kiln.precisions`` group); the order is the order of their options in
``kiln export --help`` and of their names in messages.
"""

from __future__ import annotations

from kiln.errors import ConfigError
from kiln.exporter.precision.kinds.base import PrecisionKind
from kiln.registry import Registry

__all__ = ["KINDS", "kind", "kinds"]

_HERE = "kiln.exporter.precision.kinds"
KINDS: Registry[type[PrecisionKind]] = Registry(
    "precision kind",
    "kiln.precisions",
    {  # the one registration of each kind
        "fp16": f"{_HERE}.fp16:Fp16",
        "int8": f"{_HERE}.int8:Int8",
        "fp8": f"{_HERE}.fp8:Fp8",
        "int4": f"{_HERE}.int4:Int4",
    },
    lambda obj: obj if isinstance(obj, type) and issubclass(obj, PrecisionKind) else None,
)


def kinds() -> tuple[type[PrecisionKind], ...]:
    """Every registered kind, in registration order."""
    return tuple(KINDS.all())


def kind(name: str) -> type[PrecisionKind]:
    if name in KINDS:
        return KINDS.get(name)
    raise ConfigError(f"{name!r} is not a precision kind; kiln has {', '.join(KINDS.names())}")
