"""``kiln build`` options: one frozen dataclass the CLI fills and every engine module reads."""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path

from kiln.errors import ConfigError
from kiln.exporter.targets import engine_target

__all__ = ["HardwareCompat", "GraphSet", "BuildOptions", "parse_size", "MIB", "GIB", "MAX_OPT_LEVEL"]

MIB = 1 << 20
GIB = 1 << 30
MAX_OPT_LEVEL = 5  # IBuilderConfig.builder_optimization_level: 0..5, default 3
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": MIB, "G": GIB, "T": 1 << 40}


class HardwareCompat(str, enum.Enum):
    """Which GPUs an engine must run on (TensorRT's HardwareCompatibilityLevel)."""

    NONE = "none"  # the compute capability it was built on
    AMPERE_PLUS = "ampere+"  # every GPU of compute capability 8.0 and newer
    SAME_CC = "same-cc"  # every GPU of the compute capability it was built on


class GraphSet(str, enum.Enum):
    """Which graphs ``kiln build`` builds engines from (``--graphs``; ``engine.graphs`` chooses)."""

    AUTO = "auto"  # the --target onnx graphs where the export has them and TensorRT is 10.15+, else the portable ones
    PORTABLE = "portable"  # onnx/{prefill,decode}.onnx: any TensorRT kiln builds with (10.12+)
    # onnx/{prefill,decode}.std.onnx (manifest targets.onnx): the graphs of the target that declares engines
    # (``Target.engines``), spelt by its name (--graphs onnx); TensorRT 10.15+
    ONNX = engine_target()[0].name


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    workspace: int = 4 * GIB  # bytes of the WORKSPACE memory pool
    opt_level: int = 3  # builder optimization level, 0..5
    timing_cache: Path | None = None  # None: DIR/engines/timing.cache; loaded if it exists, saved back
    hardware_compat: HardwareCompat = HardwareCompat.NONE
    version_compatible: bool = False  # plans run on later TensorRT versions (lean runtime embedded)
    refittable: bool = False  # weights can be replaced later without a rebuild
    opt_batch: int | None = None  # None: 1
    opt_context: int | None = None  # past + new tokens at the opt point; None: max_context // 2
    graphs: GraphSet = GraphSet.AUTO

    def __post_init__(self) -> None:
        if self.workspace < MIB:
            raise ConfigError(f"--workspace must be at least 1M, found {self.workspace} bytes")
        if not 0 <= self.opt_level <= MAX_OPT_LEVEL:
            raise ConfigError(f"--opt-level must be between 0 and {MAX_OPT_LEVEL}, found {self.opt_level}")
        if self.opt_batch is not None and self.opt_batch < 1:
            raise ConfigError(f"--opt-batch must be at least 1, found {self.opt_batch}")
        if self.opt_context is not None and self.opt_context < 1:
            raise ConfigError(f"--opt-context must be at least 1, found {self.opt_context}")
        if not isinstance(self.hardware_compat, HardwareCompat):
            raise ConfigError(
                f"--hardware-compat must be one of none, ampere+, same-cc, found {self.hardware_compat!r}"
            )
        if not isinstance(self.graphs, GraphSet):
            raise ConfigError(f"--graphs must be one of {', '.join(g.value for g in GraphSet)}, found {self.graphs!r}")

    def to_dict(self) -> dict[str, object]:
        return {
            "workspace": self.workspace,
            "opt_level": self.opt_level,
            "timing_cache": None if self.timing_cache is None else str(self.timing_cache),
            "hardware_compat": self.hardware_compat.value,
            "version_compatible": self.version_compatible,
            "refittable": self.refittable,
            "opt_batch": self.opt_batch,
            "opt_context": self.opt_context,
            "graphs": self.graphs.value,
        }


def parse_size(text: str) -> int:
    """Bytes of a size such as ``4G``, ``512M``, ``1.5G`` or ``1073741824`` (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([BKMGT]?)(?:I?B)?\s*", text.upper())
    if match is None:
        raise ConfigError(f"--workspace: expected a size such as 4G, 512M or a number of bytes, found {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])
