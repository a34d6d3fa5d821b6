"""Which GPUs TensorRT builds each precision for (checked before a build, noted in trtexec.sh).

Strongly typed builds take the precision from the ONNX, so nothing else changes per precision;
but the low-bit kernels exist only on some GPUs (NVIDIA's TensorRT Model Optimizer support
matrix: W4A16 block-wise int4 weights "Ampere and later", FP8 per-tensor activations and
per-channel weights "Ada and later"; compute capability 8.0 and 8.9). A build elsewhere would
fail deep in TensorRT's tactic selection, so it is refused first, in one line.
"""

from __future__ import annotations

from kiln.errors import ConfigError, EngineError
from kiln.exporter.precision.kinds.plan import Precision

__all__ = ["min_compute_capability", "require_gpu_for", "gpu_note"]


def min_compute_capability(precision: str) -> tuple[int, int, str] | None:
    """The oldest GPUs that build ``precision`` (each kind declares its own: ``precision.kinds``);
    None: any TensorRT GPU (a name kiln does not write too: nothing to say of it)."""
    try:
        return Precision.parse(precision).min_compute_capability
    except ConfigError:
        return None


def _parse(capability: str) -> tuple[int, int]:
    major, _, minor = capability.partition(".")
    return int(major), int(minor or 0)


def require_gpu_for(precision: str, compute_capability: str, gpu: str) -> None:
    """An ``EngineError`` when ``gpu`` (of ``compute_capability``) cannot build ``precision``."""
    need = min_compute_capability(precision)
    if need is not None and _parse(compute_capability) < need[:2]:
        raise EngineError(
            f"{precision} engines need a GPU of compute capability {need[0]}.{need[1]} or later ({need[2]}); "
            f"this {gpu} is {compute_capability}: export --fp16 or --int8 for it"
        )


def gpu_note(precision: str) -> str | None:
    """The trtexec.sh comment line saying which GPUs build ``precision`` (None: any TensorRT GPU)."""
    need = min_compute_capability(precision)
    return (
        None
        if need is None
        else f"# {precision} graphs build on GPUs of compute capability {need[0]}.{need[1]} or later: {need[2]}."
    )
