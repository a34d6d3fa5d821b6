"""SIGINT and SIGTERM at drawn moments of every command (issue 38's fuzz profile for signals).

Each example runs the real CLI in a subprocess and delivers one signal after a delay hypothesis
draws (the same draws every run in CI: conftest's profile). Whatever the moment, the command ends
in one of the outcomes kiln promises: exit 0 (it finished first), exit 1 with one ``error:`` line
(kiln build, where TensorRT is missing), or exit 128 + the signal with an ``interrupted (SIG...)``
line last; never a traceback; the checkpoint byte-identical; the export it worked on verifying
(``kiln verify``), and a new export either absent or verifying; ``kiln adapter`` (a Llama exported
with LoRA slots and a PEFT adapter: its own test) leaves its inputs byte-identical and its file whole
or absent, with nothing beside it. ``tests/export/test_signals.py``
holds the chosen points (before and after a commit); this file covers every command at random ones.
"""

from __future__ import annotations

import hashlib
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.exporter.options import ExportOptions
from kiln.exporter.pipeline import export
from kiln_testing import tiny_config, write_checkpoint

# each command, with the export it works on ("EXPORT": a fresh copy; "NEW": a directory it creates)
COMMANDS: dict[str, list[str]] = {
    "export": ["export", "--model", "CKPT", "--out", "NEW", "--max-batch", "1", "--parity-tokens", "2"],
    "export --force": [
        "export",
        "--model",
        "CKPT",
        "--out",
        "EXPORT",
        "--force",
        "--max-batch",
        "1",
        "--parity-tokens",
        "2",
    ],
    "check": ["check", "EXPORT"],
    "verify": ["verify", "EXPORT"],
    "generate": ["generate", "EXPORT", "--ids", "1,2", "--max-new-tokens", "8"],
    "triton": ["triton", "EXPORT", "--name", "fuzz"],
    "bench": ["bench", "EXPORT", "--runs", "3", "--prefill-seq", "8", "--past", "8"],
    "build": ["build", "EXPORT"],
    "adapter": [
        "adapter",
        "ADAPTER",
        "--export",
        "SLOTS",
        "--out",
        "NEWFILE",
    ],  # a PEFT adapter for an export with LoRA slots
}
EXAMPLES = 2  # per command: 18 runs in CI; explore more with --hypothesis-profile explore
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fuzz-signals")
    ckpt = write_checkpoint(root / "ckpt", tiny_config())
    export(ckpt, root / "out", ExportOptions.from_flags(max_batch=1, parity_tokens=2))
    return ckpt, root / "out"


@pytest.fixture(scope="module")
def slots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, bytes]:
    """kiln adapter's inputs (a tiny Llama exported with --lora-slots, a PEFT adapter of it) and the
    adapter file an uninterrupted run writes: an interrupted one leaves it whole or absent."""
    pytest.importorskip("peft", reason="kiln adapter converts PEFT adapters (pip install -e .[hf])")
    from kiln_testing import make_adapter, save_base

    root = tmp_path_factory.mktemp("fuzz-adapter")
    ckpt = save_base("llama", root / "ckpt")
    adapter = make_adapter(ckpt, root / "peft", ["q_proj", "v_proj"], seed=2)
    export(ckpt, root / "slots", ExportOptions.from_flags(max_batch=2, parity_tokens=2, lora_slots=4))
    args = _args("adapter", {"ADAPTER": adapter, "SLOTS": root / "slots", "NEWFILE": root / "a.onnx_adapter"})
    done = subprocess.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return adapter, root / "slots", (root / "a.onnx_adapter").read_bytes()


def _args(name: str, names: dict[str, Path]) -> list[str]:
    return [str(names[a]) if a in names else a for a in COMMANDS[name]]


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _run(args: list[str], delay: float, signum: int, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``kiln ARGS`` with ``signum`` delivered ``delay`` seconds after it starts (if still running)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    time.sleep(delay)
    if process.poll() is None:
        process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def _assert_an_outcome_kiln_promises(name: str, result: subprocess.CompletedProcess[str], signum: int) -> None:
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr, (name, result.stderr)
    if result.returncode == 128 + signum:
        assert lines and lines[-1].startswith(f"interrupted ({signal.Signals(signum).name})"), (name, result.stderr)
    elif result.returncode == 1:
        assert name == "build" and lines[-1].startswith("error: engine: TensorRT is not installed"), (
            name,
            result.stderr,
        )
    else:
        assert result.returncode == 0, (name, result.returncode, result.stderr)


@pytest.mark.parametrize("name", sorted(set(COMMANDS) - {"adapter"}))
@SETTINGS
@given(delay=st.floats(0.2, 6.0), signum=st.sampled_from([signal.SIGINT, signal.SIGTERM]))
def test_a_signal_at_any_moment_ends_in_a_promised_outcome(
    name: str, pristine: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory, delay: float, signum: int
) -> None:
    ckpt, exported = pristine
    work = tmp_path_factory.mktemp("run")
    copy = Path(shutil.copytree(exported, work / "export"))
    fresh = work / "new"
    before = _digest(ckpt)
    result = _run(_args(name, {"CKPT": ckpt, "EXPORT": copy, "NEW": fresh}), delay, signum, work)
    _assert_an_outcome_kiln_promises(name, result, signum)
    assert _digest(ckpt) == before
    for directory in (copy, fresh):
        if directory.exists():
            verified = subprocess.run(
                [sys.executable, "-m", "kiln.cli", "verify", str(directory)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert verified.returncode == 0, (name, delay, signum, verified.stdout, verified.stderr)


@SETTINGS
@given(delay=st.floats(0.2, 8.0), signum=st.sampled_from([signal.SIGINT, signal.SIGTERM]))
def test_a_signal_at_any_moment_of_kiln_adapter(
    slots: tuple[Path, Path, bytes], tmp_path_factory: pytest.TempPathFactory, delay: float, signum: int
) -> None:
    """``kiln adapter`` (its conversion, then its check): the PEFT adapter and the export it reads
    byte-identical, its --out whole (the bytes an uninterrupted run writes) or absent, and nothing
    else beside it (no ``.NAME.<hex>.kiln-tmp`` temporary: newfile.py)."""
    adapter, exported, written = slots
    work = tmp_path_factory.mktemp("run")
    out = work / "a.onnx_adapter"
    before = (_digest(adapter), _digest(exported))
    result = _run(_args("adapter", {"ADAPTER": adapter, "SLOTS": exported, "NEWFILE": out}), delay, signum, work)
    _assert_an_outcome_kiln_promises("adapter", result, signum)
    assert (_digest(adapter), _digest(exported)) == before, (delay, signum)
    assert sorted(p.name for p in work.iterdir()) == ([out.name] if out.exists() else []), (
        delay,
        signum,
        result.stderr,
    )
    assert not out.exists() or out.read_bytes() == written, (delay, signum, result.returncode)
    assert out.exists() or result.returncode != 0, (delay, signum, "exit 0 without its file")
