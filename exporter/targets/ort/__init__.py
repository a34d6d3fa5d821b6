"""``--target ort``: ONNX Runtime-target copies of the portable graphs (``graphs``: what the
rewrite does; ``target``: the ``Target`` the registry holds). Importing this package is cheap:
the rewrites load when the target writes."""

from __future__ import annotations

from kiln.exporter.targets.ort.target import ORT, OrtTarget

__all__ = ["ORT", "OrtTarget"]
