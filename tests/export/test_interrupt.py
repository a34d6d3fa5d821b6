"""A killed export leaves nothing behind; a second export into the same directory fails at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _start(ckpt: Path, out: Path) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "kiln.cli",
        "export",
        "--model",
        str(ckpt),
        "--out",
        str(out),
        "--json",
        "--parity-tokens",
        "4",
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_staging(parent: Path, name: str, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.name.startswith(f".{name}.tmp-") for p in parent.iterdir()):
            return
        if proc.poll() is not None:
            pytest.fail(f"export ended before staging: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.05)
    pytest.fail("export never started writing")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_mid_export_leaves_nothing(tiny_ckpt: Path, tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "out"
    proc = _start(tiny_ckpt, out)
    _wait_for_staging(tmp_path, "out", proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig
    assert "Traceback" not in stderr
    assert (
        stderr.strip().splitlines()[-1] == f"interrupted ({sig.name}): nothing was written"
    )  # the same line for both signals
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directory, no lock file


def test_concurrent_exports_one_wins(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = _start(tiny_ckpt, out)
    _wait_for_staging(tmp_path, "out", first)
    first.send_signal(
        signal.SIGSTOP
    )  # held mid-export while the second runs: a fast first export (a cached trace) ended before the second looked
    try:
        second = _start(tiny_ckpt, out)
        _, err2 = second.communicate(timeout=120)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 1
    assert err2.strip().splitlines() == [
        f"error: artifacts: {out}: another kiln process is writing this directory (pid {first.pid}, lock "
        f"{tmp_path / '.out.lock'}); wait for it or choose another --out"
    ]
    _, err1 = first.communicate(timeout=300)
    assert first.returncode == 0, err1
    assert (out / "manifest.json").is_file() and (out / "onnx" / "weights.bin").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]
