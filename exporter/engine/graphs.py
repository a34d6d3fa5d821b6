"""Which graphs ``kiln build`` builds engines from: the portable ones or ``--target onnx``'s.

The ``--target onnx`` graphs (``onnx/*.std.onnx``, the manifest's ``targets.onnx``: ONNX's own
``Attention``, ``RotaryEmbedding``, ``RMSNormalization`` and a static cache written in place by
``TensorScatter``) need a TensorRT whose ONNX parser imports all four, which is 10.15 and newer
(onnx/onnx-tensorrt ``docs/operators.md`` for 10.15, "TensorRT 10.15 supports operators in the
inclusive range of opset 9 to opset 24": ``Attention`` (Q, K, V and the mask 4-D; no past/present,
no ``softcap``), ``RMSNormalization``, ``RotaryEmbedding`` (int64 ``position_ids``) and
``TensorScatter`` (``past_cache`` and ``update`` 4-D, ``axis`` -2); ``Attention`` alone is parsed
from 10.14; ``IKVCacheUpdateLayer``, the layer a static cache is written by, and
``ICudaEngine.get_aliased_input_tensor`` exist from 10.15: NVIDIA/TensorRT ``release/10.15``
``python/src/infer/pyGraph.cpp`` and ``pyCore.cpp``). ``--graphs auto`` takes them where the export
has them and TensorRT is new enough, else the portable graphs, which every TensorRT kiln builds
with parses; ``--graphs onnx`` is refused by name where either is missing. The target and the
version are the target's declaration (``Target.engines``: ``targets.onnx.target.ENGINES``), asked of
the registry (``targets.engine_target``).
Pure: no TensorRT import (the version is passed in), so it is unit-tested.
"""

from __future__ import annotations

import dataclasses

from kiln.errors import ConfigError, EngineError
from kiln.exporter.artifacts.manifest import Manifest
from kiln.exporter.engine.options import GraphSet
from kiln.exporter.targets import engine_target

__all__ = ["ONNX_TARGET", "ONNX_MIN_VERSION", "GraphChoice", "has_onnx_graphs", "require_onnx_graphs", "choose_graphs"]

ONNX_TARGET = GraphSet.ONNX.value  # the manifest's targets.<name> of the --target onnx graphs
ONNX_MIN_VERSION = engine_target()[1].min_tensorrt  # TensorScatter, RotaryEmbedding, RMSNormalization parsed
_NEED = engine_target()[1].needs


@dataclasses.dataclass(frozen=True)
class GraphChoice:
    """The graph set chosen (``PORTABLE`` or ``ONNX``, never ``AUTO``) and why, in words."""

    graphs: GraphSet
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"set": self.graphs.value, "reason": self.reason}


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def has_onnx_graphs(manifest: Manifest) -> bool:
    """Whether the export holds ``--target onnx``'s graph set (``targets.onnx`` in its manifest)."""
    return ONNX_TARGET in (manifest.targets or {})


def require_onnx_graphs(manifest: Manifest, requested: GraphSet) -> None:
    """Refuse ``--graphs onnx`` on an export without ``--target onnx`` graphs (no TensorRT needed)."""
    if requested is GraphSet.ONNX and not has_onnx_graphs(manifest):
        raise ConfigError(
            "--graphs onnx builds the --target onnx graphs (onnx/*.std.onnx), and this export has none (its "
            "manifest has no targets.onnx); "
            "re-export with --target onnx, or build the portable graphs with --graphs portable or auto"
        )


def choose_graphs(manifest: Manifest, requested: GraphSet, version: tuple[int, ...]) -> GraphChoice:
    """The graphs to build with TensorRT ``version`` (``compat.trt_version``) for ``--graphs requested``."""
    require_onnx_graphs(manifest, requested)
    found = _dotted(version)
    new_enough = version[:2] >= ONNX_MIN_VERSION
    if requested is GraphSet.PORTABLE:
        return GraphChoice(GraphSet.PORTABLE, "--graphs portable")
    if requested is GraphSet.ONNX:
        if not new_enough:
            raise EngineError(
                f"--graphs onnx needs {_NEED}, found TensorRT {found}; pip install -U tensorrt, or build the "
                "portable graphs with --graphs portable or auto"
            )
        return GraphChoice(GraphSet.ONNX, f"--graphs onnx, TensorRT {found}")
    if not has_onnx_graphs(manifest):
        return GraphChoice(GraphSet.PORTABLE, "the export has no --target onnx graphs (manifest targets.onnx)")
    if not new_enough:
        return GraphChoice(
            GraphSet.PORTABLE,
            f"TensorRT {found} is older than {_dotted(ONNX_MIN_VERSION)}, the first whose ONNX parser imports the "
            "--target onnx graphs' TensorScatter, RotaryEmbedding and RMSNormalization",
        )
    parsed = f"the export has --target onnx graphs and TensorRT {found} parses them ({_dotted(ONNX_MIN_VERSION)}+)"
    return GraphChoice(GraphSet.ONNX, parsed)
