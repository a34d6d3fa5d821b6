"""The registry of precision kinds (``base``): the CLI's precision options, option
checks, the pipeline's precision passes, the manifest's names and records, the tolerances and
the GPU requirements all come from it. A new kind is its own file here and one line in
``_BUILTIN``; the order is the order of their options in ``kiln export --help`` and of their
names in messages.
"""

from __future__ import annotations

from kiln.errors import ConfigError
from kiln.exporter.precision.kinds.base import PrecisionKind
from kiln.exporter.precision.kinds.fp8 import Fp8
from kiln.exporter.precision.kinds.fp16 import Fp16
from kiln.exporter.precision.kinds.int4 import Int4
from kiln.exporter.precision.kinds.int8 import Int8

__all__ = ["kind", "kinds"]

_BUILTIN: tuple[type[PrecisionKind], ...] = (Fp16, Int8, Fp8, Int4)  # the one registration of each kind


def kinds() -> tuple[type[PrecisionKind], ...]:
    """Every registered kind, in registration order."""
    return _BUILTIN


def kind(name: str) -> type[PrecisionKind]:
    for each in _BUILTIN:
        if each.name == name:
            return each
    raise ConfigError(f"{name!r} is not a precision kind; kiln has {', '.join(k.name for k in _BUILTIN)}")
