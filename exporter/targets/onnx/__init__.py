"""``--target onnx``: copies of the portable graphs in ONNX's own operators with a static,
in-place KV cache, the graphs TensorRT 10.15+ parses natively (``graphs``: what the rewrite does;
``target``: the ``Target`` the registry holds; ``runner``: parity through the static contract).
Importing this package is cheap: the rewrites load when the target writes."""

from __future__ import annotations

from kiln.exporter.targets.onnx.target import ONNX, OnnxTarget

__all__ = ["ONNX", "OnnxTarget"]
