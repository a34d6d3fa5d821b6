"""``kiln check``'s calibration data: the file the user names (``--calib-data``), never a path the manifest records.

An int8 or fp8 export's calibration (``qdq_rerun``) and a GPTQ int4 export's quantizer (``int4.rerun``)
run again over the export's calibration data. The manifest records where that data was when the export
ran and its token windows' sha256; opening that path would let a manifest from elsewhere make ``kiln
check`` open any file of the checker's machine (the sha256 is compared only after it is read), and an
export moved to another machine would lose its rerun without a word. So the rerun reads only:

- the file passed with ``--calib-data``, refused in one line naming both hashes unless its token
  windows hash as the manifest records;
- nothing, for ``synthetic`` data (random tokens from a fixed seed);
- kiln's own bundled demo held-out text (``demo/checkpoint/heldout.txt``, found in the installed
  package, not at the recorded path) when the checkpoint is the bundled demo and that text's token
  windows hash as recorded: the demo's documented calibration needs no option.

Otherwise the rerun is skipped with one line saying how to have it (``Skip``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.calibration.data import SYNTHETIC, load_calibration_data
from kiln.errors import CalibrationError, ConfigError
from kiln.exporter.artifacts.manifest import Manifest
from kiln.exporter.precision.kinds.base import Needs
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln.exporter.precision.kinds.plan import Precision
from kiln.plugins import LoadedModel, demo_heldout

__all__ = ["Recorded", "Skip", "rerun_source", "refuse_unread"]


@dataclasses.dataclass(frozen=True)
class Recorded:
    """The manifest's record of the calibration data: its source as given at export (named in
    messages, never opened), its token windows' sha256, and their count and length."""

    source: str
    sha256: str
    samples: int
    window: int


@dataclasses.dataclass(frozen=True)
class Skip:
    """No calibration data the rerun may read: why, and how to give it, in one line."""

    reason: str


def rerun_source(recorded: Recorded, given: Path | None, loaded: LoadedModel) -> str | Skip:
    """The calibration source the rerun reads (a path, or ``synthetic``): ``given`` once its
    token windows hash as recorded (else a ``CalibrationError`` naming both hashes), ``synthetic``
    as recorded, the bundled demo text where it hashes as recorded; else ``Skip``."""
    if given is not None:
        source = str(given.absolute()) if str(given) == SYNTHETIC else str(given)  # a file named so, not the tokens
        found = _sha256(source, recorded, loaded)
        if found != recorded.sha256:
            raise CalibrationError(
                f"--calib-data {given}: its token windows' sha256 is {found}, the export's calibration data's "
                f"{recorded.sha256} (recorded as {recorded.source}): not the data the export was calibrated on; "
                "pass that file"
            )
        return source
    if recorded.source == SYNTHETIC:
        return SYNTHETIC
    bundled = demo_heldout(loaded)
    if bundled is not None and _sha256(str(bundled), recorded, loaded) == recorded.sha256:
        return str(bundled)
    return Skip(
        "kiln check reads no calibration data from a path the manifest records: pass --calib-data FILE, the "
        f"export's calibration data (recorded as {recorded.source}; its token windows' sha256 {recorded.sha256}), "
        "to run it again"
    )


def refuse_unread(directory: Path, manifest: Manifest, backend: str, given: Path | None) -> None:
    """``--calib-data`` given to a check that reads no calibration data (a precision that calibrates
    nothing, int4 RTN, Q/DQ scales on TensorRT's engines) is refused rather than ignored."""
    if given is None or _reads_calibration(manifest, backend):
        return
    what = f"its {manifest.precision} graphs" if backend == "onnxruntime" else "its TensorRT engines"
    raise ConfigError(
        f"--calib-data {given}: the check of {directory} ({what}) runs no calibration again; leave --calib-data out "
        "(it is read for int8 and fp8 exports on ONNX Runtime and for int4 GPTQ exports)"
    )


def _reads_calibration(manifest: Manifest, backend: str) -> bool:
    """Whether ``kiln check`` runs a calibration again on this export: an int8 or fp8 export's
    (on ONNX Runtime: ``qdq_rerun``), or an int4 export's GPTQ (``int4.rerun``)."""
    precision = Precision.parse(manifest.precision)
    if precision.needs(Needs.RANGES):
        return backend == "onnxruntime"
    record: Mapping[str, Any] = manifest.export.quantization or {}
    return precision.weight_only_float is not None and record.get("method") == Int4Method.GPTQ.value


def _sha256(source: str, recorded: Recorded, loaded: LoadedModel) -> str:
    """The sha256 of the token windows ``source`` gives, cut as the recorded ones were."""
    return load_calibration_data(
        source,
        tokenizer=loaded.tokenizer,
        vocab_size=loaded.spec.vocab_size,
        samples=recorded.samples,
        window=recorded.window,
    ).sha256
