"""Precision kinds: what each is (``base``), the registry (``registry``: one line a kind), an
export's precision composed of them (``plan``) and each kind's declaration (``fp16``, ``int8``,
``fp8``, ``int4``). Their machinery (the passes) is ``exporter.precision``'s modules."""

from __future__ import annotations

from kiln.exporter.precision.kinds.fp8 import Fp8
from kiln.exporter.precision.kinds.fp16 import Fp16
from kiln.exporter.precision.kinds.int4 import Int4
from kiln.exporter.precision.kinds.int8 import Int8
from kiln.exporter.precision.kinds.registry import kind, kinds

__all__ = ["Fp16", "Int8", "Int4", "Fp8", "kind", "kinds"]
