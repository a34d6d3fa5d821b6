"""One exception hierarchy: ``KilnError`` and one subclass per pipeline stage.

A message says what was expected, what was found and what to do. The CLI prints a
``KilnError`` as one line on stderr and exits 1; any other exception is a bug and keeps its
traceback.
"""

from __future__ import annotations

__all__ = [
    "KilnError",
    "ConfigError",
    "CheckpointError",
    "ExportError",
    "CalibrationError",
    "ParityError",
    "ArtifactError",
    "BenchError",
    "EngineError",
    "GenerateError",
    "MemoryLimitError",
]


class KilnError(Exception):
    """Base class of every error kiln reports to a user."""

    stage = "kiln"

    def __str__(self) -> str:
        return f"{self.stage}: {super().__str__()}"


class ConfigError(KilnError):
    """A model or export configuration value is invalid."""

    stage = "config"


class CheckpointError(KilnError):
    """A checkpoint is missing, unreadable, unsafe or inconsistent with its config."""

    stage = "checkpoint"


class ExportError(KilnError):
    """Tracing, PLE folding or an ONNX graph pass failed."""

    stage = "export"


class CalibrationError(KilnError):
    """Calibration data is missing, unreadable or does not fit the model."""

    stage = "calibration"


class ParityError(KilnError):
    """An artifact's outputs differ from the PyTorch model beyond tolerance."""

    stage = "parity"


class ArtifactError(KilnError):
    """An output directory, manifest or artifact file is missing, locked or inconsistent."""

    stage = "artifacts"


class BenchError(KilnError):
    """A benchmark could not run."""

    stage = "bench"


class EngineError(KilnError):
    """A TensorRT engine could not be built, loaded or run (or TensorRT is missing)."""

    stage = "engine"


class GenerateError(KilnError):
    """Text generation through exported graphs could not run (bad prompt, ids, or directory)."""

    stage = "generate"


class MemoryLimitError(KilnError):
    """The machine's memory ran out: an allocator (ONNX Runtime's arena) refused a buffer."""

    stage = "memory"
