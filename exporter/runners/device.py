"""``--parity-device auto|cpu|cuda``: where parity's PyTorch reference, its ONNX Runtime sessions
and GPTQ's Hessians and solves run.

    resolve(asked, probes) ──► ParityDevice("cpu" | "cuda")
        auto: cuda when torch sees a GPU (``torch.cuda.is_available()``) and ONNX Runtime offers
              ``CUDAExecutionProvider`` (``onnxruntime.get_available_providers()``), else cpu
        cuda: refused in one line naming what is missing (``missing``; the plan stage asks it)

The device is set for a stage with ``on(device)`` and read with ``current()`` by the parts that
place work on it (``TorchRunner``, ``OrtRunner``, GPTQ): outside ``on`` it is the CPU, so every
other use of those (calibration, ``kiln bench``, ``kiln generate``) is unchanged. Nothing here
imports torch or ONNX Runtime until a probe runs (the CLI asks the plan before importing torch).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kiln.errors import ConfigError

__all__ = [
    "CHOICES",
    "CPU",
    "CUDA_OPTIONS",
    "CUDA_PROVIDER",
    "ParityDevice",
    "Probes",
    "current",
    "missing",
    "on",
    "refusal",
    "resolve",
]

CHOICES = ("auto", "cpu", "cuda")
CUDA_PROVIDER = "CUDAExecutionProvider"
# ONNX Runtime's CUDA provider computes fp32 MatMuls in TF32 by default (``use_tf32``, on since Ampere):
# 10-bit mantissas, not the fp32 the graphs state, so parity's sessions turn it off
CUDA_OPTIONS: dict[str, str] = {"use_tf32": "0"}


def _torch_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _ort_providers() -> Sequence[str]:
    import onnxruntime

    return tuple(onnxruntime.get_available_providers())


@dataclasses.dataclass(frozen=True)
class Probes:
    """What the choice reads of the machine (injectable: a test says "torch sees a GPU, ONNX
    Runtime has no CUDA provider" without a GPU or a mocked session)."""

    torch_cuda: Callable[[], bool] = _torch_cuda
    ort_providers: Callable[[], Sequence[str]] = _ort_providers


@dataclasses.dataclass(frozen=True)
class ParityDevice:
    """Where parity runs: ``name`` "cpu" or "cuda" (torch's device name too)."""

    name: str

    @property
    def cuda(self) -> bool:
        return self.name == "cuda"

    @property
    def providers(self) -> list[Any]:
        """ONNX Runtime's providers for a parity session: CUDA (TF32 off) then CPU for the nodes it
        lacks, or the CPU alone."""
        cpu = "CPUExecutionProvider"
        return [(CUDA_PROVIDER, dict(CUDA_OPTIONS)), cpu] if self.cuda else [cpu]


CPU = ParityDevice("cpu")
_CURRENT: contextvars.ContextVar[ParityDevice] = contextvars.ContextVar("kiln_parity_device", default=CPU)


def missing(probes: Probes | None = None) -> list[str]:
    """What CUDA parity lacks on this machine, one phrase each (empty: it can run)."""
    probes = probes or Probes()
    found = []
    if not probes.torch_cuda():
        found.append("torch sees no CUDA GPU (torch.cuda.is_available() is False: a CUDA build of torch and a GPU)")
    if CUDA_PROVIDER not in probes.ort_providers():
        found.append(f"onnxruntime offers no {CUDA_PROVIDER} (install onnxruntime-gpu in place of onnxruntime)")
    return found


def refusal(asked: str, probes: Probes | None = None) -> list[str]:
    """The plan stage's reason to refuse ``--parity-device asked`` (one line, or none)."""
    if asked != "cuda":
        return []
    lacking = missing(probes)
    if not lacking:
        return []
    return [f"--parity-device cuda: {' and '.join(lacking)}; or run parity on the CPU with --parity-device cpu"]


def resolve(asked: str, probes: Probes | None = None) -> ParityDevice:
    """The device ``--parity-device asked`` runs parity on (``ConfigError``: cuda asked where it
    cannot run, or an unknown name)."""
    if asked not in CHOICES:
        raise ConfigError(f"--parity-device must be one of {', '.join(CHOICES)}, found {asked!r}")
    if asked == "cpu":
        return CPU
    if reasons := refusal(asked, probes):
        raise ConfigError(reasons[0])
    return ParityDevice("cuda") if asked == "cuda" or not missing(probes) else CPU


def current() -> ParityDevice:
    """The device set by the innermost ``on`` (the CPU outside any)."""
    return _CURRENT.get()


@contextlib.contextmanager
def on(device: ParityDevice) -> Iterator[ParityDevice]:
    """Parity's work placed on ``device`` inside the block. On CUDA, PyTorch's TF32 for MatMuls and
    convolutions is off meanwhile (the reference computes in fp32, as on the CPU) and restored after."""
    token = _CURRENT.set(device)
    try:
        if not device.cuda:
            yield device
            return
        import torch

        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            yield device
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    finally:
        _CURRENT.reset(token)
