"""Signals and full disks end every command in one line (issue 38, items 4 and 10).

A signal: exit 128 + its number, one line on stderr that is true (``nothing was written`` before a
commit, what was written after it), no traceback, the export as it was or whole. The real CLI runs
in a subprocess; a signal lands at a chosen point where the process sends it to itself from a
wrapped function (``_at_point``: no hook in kiln's code), or after a fixed delay (a few tries,
each outcome allowed by the rules). What a killed ``kiln triton`` leaves inside an export is
kiln's own: every command accepts the export and the next kiln triton removes it. A full disk is
ENOSPC (or ONNX Runtime's bare RuntimeError) raised through monkeypatching, in-process.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from kiln import interrupts
from kiln.cli import main
from kiln.exporter.artifacts.verify import verify_dir
from kiln.exporter.options import ExportOptions
from kiln.exporter.pipeline import export
from kiln_testing import tiny_config, write_checkpoint

SIGNALS = [signal.SIGINT, signal.SIGTERM]
BEFORE = "interrupted ({}): nothing was written"
AFTER = "interrupted ({}) after {} was written: the export is whole"
NOT_CHECKED = "{}: not checked: {}, left by an interrupted kiln triton (the next one removes them)"
REMOVED = "removed {}: the unfinished output of an earlier kiln process (pid {}) that was killed"
NO_SPACE = "{0}: cannot write here: no space left on the device holding {0}; free some space or choose another --out"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny export holding a Triton repository (so that kiln triton replaces one)."""
    root = tmp_path_factory.mktemp("signals")
    out = root / "out"
    export(
        write_checkpoint(root / "ckpt", tiny_config()),
        out,
        ExportOptions.from_flags(max_batch=1, parity_tokens=2, triton="m"),
    )
    return out


@pytest.fixture
def export_dir(exported: Path, tmp_path: Path) -> Path:
    """This test's own copy of the export (absolute: the messages name it so)."""
    return Path(shutil.copytree(exported, tmp_path / "out")).absolute()


def _tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: a file by its sha256, a folder, a link by where it points."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_dir():
            out[rel] = "folder"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _start(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "kiln.cli", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True, timeout=120)


def _at_point(args: list[str], patch: str, sig: signal.Signals) -> subprocess.CompletedProcess[str]:
    """The CLI as ``kiln`` runs it (signals held from before its imports), with ``patch`` (Python
    that may use ``kill()``: this process sends itself ``sig``) run first."""
    script = (
        textwrap.dedent(
            f"""
        import os, signal, sys
        from kiln import interrupts
        interrupts.hold()
        def kill():
            os.kill(os.getpid(), {int(sig)})
        """
        )
        + textwrap.dedent(patch)
        + f"\nfrom kiln.cli import main\nsys.argv = ['kiln', *{args!r}]\nmain()\n"
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def _assert_one_line(proc: subprocess.CompletedProcess[str], sig: signal.Signals, line: str) -> None:
    assert proc.returncode == 128 + sig, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [line]


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda sig: sig.name)
def test_triton_signal_before_the_commit_leaves_the_export_as_it_was(export_dir: Path, sig: signal.Signals) -> None:
    before = _tree(export_dir)
    patch = """
        from kiln.exporter.serving import triton
        real = triton._write_repo
        def write(*args):
            real(*args)
            kill()
        triton._write_repo = write
        """
    proc = _at_point(["triton", str(export_dir), "--name", "m2"], patch, sig)
    _assert_one_line(proc, sig, BEFORE.format(sig.name))
    assert _tree(export_dir) == before


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda sig: sig.name)
def test_triton_signal_after_the_commit_says_so_and_the_export_is_whole(export_dir: Path, sig: signal.Signals) -> None:
    """The signal lands while the earlier repository is deleted (outside the deferred renames): the
    line says what was written; the lock file and the half-deleted copy stay inside the export, and
    verify, generate and triton accept it; the next triton removes them."""
    patch = """
        import shutil
        real = shutil.rmtree
        def rmtree(path, *args, **kwargs):
            if os.path.basename(path).startswith(".triton.old-"):
                kill()
            real(path, *args, **kwargs)
        shutil.rmtree = rmtree
        """
    proc = _at_point(["triton", str(export_dir), "--name", "m"], patch, sig)  # the same files: no line of what went
    _assert_one_line(proc, sig, AFTER.format(sig.name, export_dir / "triton"))
    left = sorted(p.name for p in export_dir.iterdir() if p.name.startswith("."))
    assert len(left) == 2 and left[0] == ".triton.lock" and left[1].startswith(".triton.old-")
    assert (export_dir / left[1] / "triton" / "m" / "config.pbtxt").is_file()  # the earlier repository, set aside
    verified = _run("verify", str(export_dir))
    assert verified.returncode == 0 and verified.stdout.startswith(f"{export_dir}: all ")
    assert verified.stderr.splitlines() == [NOT_CHECKED.format(export_dir, ", ".join(left))]
    assert _run("generate", str(export_dir), "--ids", "1,2", "--max-new-tokens", "2").returncode == 0
    again = _run("triton", str(export_dir), "--name", "m3")
    assert again.returncode == 0, again.stderr
    assert not [p for p in export_dir.iterdir() if p.name.startswith(".")]
    assert verify_dir(export_dir).ok


def test_a_signal_inside_an_import_is_raised_when_the_import_ends(export_dir: Path, tmp_path: Path) -> None:
    """A KeyboardInterrupt inside an import left a module half initialised (ONNX Runtime's
    ImportError, torch's pybind11 abort): the import completes, then the command ends."""
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "slow_module.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGINT)\ntotal = sum(range(200_000))\n"
        f"open({str(tmp_path / 'done')!r}, 'w').close()\n"
    )
    patch = f"""
        sys.path.insert(0, {str(tmp_path / "mod")!r})
        from kiln.exporter.serving import triton
        real = triton.triton_models
        def models(*args):
            import slow_module
            import time
            time.sleep(5)  # the signal lands here, 20 ms after the import
            return real(*args)
        triton.triton_models = models
        """
    before = _tree(export_dir)
    proc = _at_point(["triton", str(export_dir), "--name", "m2"], patch, signal.SIGINT)
    _assert_one_line(proc, signal.SIGINT, BEFORE.format("SIGINT"))
    assert (tmp_path / "done").exists() and _tree(export_dir) == before


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda sig: sig.name)
def test_timed_signals_to_generate_and_triton(export_dir: Path, sig: signal.Signals) -> None:
    """A few fixed delays (4 runs a signal): each run ends either finished (the signal came after
    its last line) or on the one line, never a traceback; the export always verifies."""
    lines = {BEFORE.format(sig.name), AFTER.format(sig.name, export_dir / "triton")}
    generate = ["generate", str(export_dir), "--ids", "1,2,3", "--max-new-tokens", "8"]
    for args in (generate, ["triton", str(export_dir), "--name", "m2"]):
        for delay in (0.25, 0.6):
            proc = _start(*args)
            time.sleep(delay)
            proc.send_signal(sig)
            _, stderr = proc.communicate(timeout=120)
            assert "Traceback" not in stderr
            assert proc.returncode in (0, 128 + sig, -sig)  # -sig: after the interpreter's own shutdown began
            if proc.returncode == 128 + sig:
                assert stderr.splitlines()[-1] in lines
            assert verify_dir(export_dir).ok


def _leftovers_of_a_killed_triton(export_dir: Path) -> tuple[Path, Path]:
    """What a kiln triton SIGKILLed while replacing the repository leaves: its lock file naming its
    staging (half written) and the earlier repository's copy, set aside."""
    tmp, old = export_dir / ".triton.tmp-0123abcd", export_dir / ".triton.old-4567cdef"
    (tmp / "m").mkdir(parents=True)
    (tmp / "m" / "config.pbtxt").write_text("half")
    shutil.copytree(export_dir / "triton", old / "triton")
    (export_dir / ".triton.lock").write_text(f"999999999\n{tmp.name}\n{old.name}\n")
    return tmp, old


def test_a_killed_tritons_leftovers_are_accepted_then_removed(export_dir: Path) -> None:
    tmp, old = _leftovers_of_a_killed_triton(export_dir)
    look_alike = export_dir / ".triton.tmp-mine"  # not named in the lock file: a user's, unexpected
    runner = CliRunner()
    verified = runner.invoke(main, ["verify", str(export_dir)])
    assert verified.exit_code == 0 and verified.stdout.startswith(f"{export_dir}: all ")
    assert verified.stderr == NOT_CHECKED.format(export_dir, f".triton.lock, {old.name}, {tmp.name}") + "\n"
    assert runner.invoke(main, ["generate", str(export_dir), "--ids", "1,2", "--max-new-tokens", "2"]).exit_code == 0
    look_alike.mkdir()
    (look_alike / "notes.txt").write_text("mine")
    assert verify_dir(export_dir).unexpected == (".triton.tmp-mine/notes.txt",)
    shutil.rmtree(look_alike)
    again = runner.invoke(main, ["triton", str(export_dir), "--name", "m"])
    assert again.exit_code == 0, again.output
    assert again.stderr == REMOVED.format(tmp, 999999999) + "\n"
    assert not [p for p in export_dir.iterdir() if p.name.startswith(".")] and verify_dir(export_dir).ok


def test_a_sigkilled_triton_leaves_what_the_next_one_removes(export_dir: Path) -> None:
    """SIGKILL as soon as the staging directory appears (3 tries at most, should it finish first)."""
    for _ in range(3):
        proc = _start("triton", str(export_dir), "--name", "m2")
        staged: list[Path] = []
        while proc.poll() is None and not staged:
            staged = [p for p in export_dir.iterdir() if p.name.startswith(".triton.tmp-")]
            time.sleep(0.002)
        proc.kill()
        proc.wait()
        if staged:
            break
    assert staged, "kiln triton finished before its staging directory was seen, 3 times"
    assert verify_dir(export_dir).ok and (export_dir / ".triton.lock").is_file()
    assert _run("generate", str(export_dir), "--ids", "1,2", "--max-new-tokens", "2").returncode == 0
    again = _run("triton", str(export_dir), "--name", "m2")
    assert again.returncode == 0, again.stderr
    assert REMOVED.format(staged[0], proc.pid) in again.stderr.splitlines()
    assert not [p for p in export_dir.iterdir() if p.name.startswith(".")] and verify_dir(export_dir).ok


@pytest.mark.parametrize(
    ("sig", "group"), [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["SIGINT-all", "SIGTERM"]
)
def test_bench_ended_while_its_worker_loads(export_dir: Path, tmp_path: Path, sig: signal.Signals, group: bool) -> None:
    """SIGINT to the whole process group (a terminal's Ctrl-C), SIGTERM to the bench alone (kill
    PID): the worker neither outlives the bench nor prints (it read its feeds after the bench had
    removed them: FileNotFoundError; a KeyboardInterrupt in its imports)."""
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    proc = _start("bench", str(export_dir), "--runs", "3", "--no-roofline", env=env, start_new_session=True)
    assert proc.stderr is not None
    for _ in range(20):  # until the sessions are loaded: the worker starts next
        if proc.stderr.readline().startswith("load kiln"):
            break
    time.sleep(0.3)
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    _, rest = proc.communicate(timeout=120)  # returns once every holder of stderr (the worker too) is gone
    _assert_one_line(subprocess.CompletedProcess(proc.args, proc.returncode, "", rest), sig, BEFORE.format(sig.name))
    assert not list(temp.glob("kiln-bench-torch-*"))


def test_an_error_after_a_signal_is_the_signals_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a signal surfaces as (an ImportError from a module it cut short, a worker's error) ends
    the command as the signal does: exit 130, the one line."""

    def cut_short(*args: Any, **kwargs: Any) -> None:
        with interrupts.deferred():  # recorded, not raised: as where a library swallowed the KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)
        raise ImportError("cannot import name 'InferenceSession' from partially initialized module 'onnxruntime'")

    monkeypatch.setattr("kiln.runtime.generate.generate_command", cut_short)
    result = CliRunner().invoke(main, ["generate", "anywhere", "--ids", "1"])
    assert (result.exit_code, result.stderr) == (130, "interrupted (SIGINT): nothing was written\n")


def _no_space(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_adapter_on_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX Runtime's export_adapter says only "Failed to write" (a RuntimeError): with the disk full,
    one line, and neither the file nor a temporary is left."""
    import onnxruntime as ort

    (tmp_path / "adapters").mkdir()
    out = tmp_path / "adapters" / "a.onnx_adapter"
    tensors = {"slot.A": np.ones((4, 2), np.float32)}
    manifest = SimpleNamespace(lora=object(), checkpoint=SimpleNamespace(reference=None, resolved=None))
    monkeypatch.setattr("kiln.exporter.artifacts.verify.require_verified", lambda d: manifest)
    peft = SimpleNamespace(tensors={"m": None}, rank=2)
    monkeypatch.setattr("kiln.exporter.adapter.swapped_adapter", lambda *a: (peft, tensors))

    def half_written(self: Any, path: str) -> None:
        Path(path).write_bytes(b"half")
        where = "/onnxruntime_src/onnxruntime/python/onnxruntime_pybind_lora.cc:151"  # ONNX Runtime 1.32's words
        raise RuntimeError(f'{where} Failed to write :32 bytes to "{path}"')

    monkeypatch.setattr(ort.AdapterFormat, "export_adapter", half_written)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: namedtuple("usage", "total used free")(100, 100, 0))
    args = ["adapter", str(tmp_path / "peft"), "--export", str(tmp_path / "export"), "--out", str(out), "--no-check"]
    result = CliRunner().invoke(main, args)
    assert (result.exit_code, result.stderr) == (1, f"error: artifacts: {NO_SPACE.format(out)}; nothing was written\n")
    assert list(out.parent.iterdir()) == []


def _bench_result() -> dict[str, Any]:
    return {"sweep": {"pasts": [4, 8], "median_ms": {"kiln": [1.0, 2.0]}, "fit": {}}, "median_ms": {}}


@pytest.mark.parametrize("full", ["out", "plot"])
def test_bench_out_on_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full: str) -> None:
    """``--out`` (or its plot) on a full disk: one line naming it, nothing half written."""
    import matplotlib.figure

    results = tmp_path / "results"
    results.mkdir()
    out = results / "r.json"
    monkeypatch.setattr("kiln.runtime.bench.run_bench", lambda *a, **k: _bench_result())
    if full == "out":
        monkeypatch.setattr(Path, "write_text", lambda self, text: (Path.write_bytes(self, b"{half"), _no_space()))
    else:
        half_plot = lambda self, path, **k: (Path(path).write_bytes(b"PNG half"), _no_space())  # noqa: E731
        monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_plot)
    args = ["bench", str(tmp_path / "export"), "--out", str(out), "--sweep", "4,8", "--no-torch"]
    result = CliRunner().invoke(main, args)
    name = results / ("r.json" if full == "out" else "r.png")
    assert result.exit_code == 1
    assert result.stderr == f"error: bench: {NO_SPACE.format(name)}; {name.name} was not written\n"
    assert [p.name for p in results.iterdir()] == (["r.png"] if full == "out" else [])  # the plot, written whole before
