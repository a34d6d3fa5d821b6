"""``kiln bench``'s PyTorch eager row, measured the way ONNX Runtime is: the same thread count and
no spinning threads, without the user setting anything.

ONNX Runtime's sessions get ``allow_spinning=0``; PyTorch's CPU threads are OpenMP's (libgomp in
the PyPI wheels), which spin after every parallel region unless ``OMP_WAIT_POLICY=PASSIVE``.
libgomp reads that variable once, when it is loaded (with ``import torch``), so setting it in a
process that has already imported torch does nothing. The row therefore runs in a worker process
started with ``OMP_WAIT_POLICY=PASSIVE``, ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` = the thread
count (and ``KMP_BLOCKTIME=0`` for a torch built with Intel's OpenMP), and
``torch.set_num_threads``. It stays interleaved with the other rows: the bench sends it one line
per call, the worker runs that call once and answers with the seconds it took (timed in the
worker, so the pipe's latency is not in the figure). Measured on the 2-core development machine
(demo model, three busy loops beside the bench, load average ~4): the PyTorch decode step went
from 73 and 15 ms (two runs, in-process, spinning) to 4.5 and 6.3 ms (this worker), and ONNX
Runtime's rows got faster too (the spinning threads had taken their cores); at rest the two
ways measure alike.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import numpy as np

from kiln.errors import BenchError, KilnError
from kiln.inputs import open_input

__all__ = ["SelfTimed", "TorchWorker", "worker_env"]


def worker_env(threads: int) -> dict[str, str]:
    """The environment of the worker: this one, with OpenMP's threads passive and counted."""
    count = str(threads)
    return {
        **os.environ,
        "OMP_WAIT_POLICY": "PASSIVE",
        "KMP_BLOCKTIME": "0",
        "OMP_NUM_THREADS": count,
        "MKL_NUM_THREADS": count,
    }


class SelfTimed:
    """A bench call that times itself: calling it returns the seconds it took."""

    def __call__(self) -> float:
        raise NotImplementedError


class _Call(SelfTimed):
    def __init__(self, worker: TorchWorker, kind: str) -> None:
        self._worker, self._kind = worker, kind

    def __call__(self) -> float:
        return self._worker.call(self._kind)


def _spawn(command: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """The worker process, born with SIGINT blocked (a mask survives the exec): a terminal's Ctrl-C
    reaches the whole process group, and the bench answers it, ending the worker; in the worker's
    own imports it printed a KeyboardInterrupt's traceback."""
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)


class TorchWorker:
    """The PyTorch model of ``checkpoint`` in a worker process, with ``feeds`` (by graph kind)
    bound once; ``calls()`` are the bench's calls, ``info`` what the worker reports of itself
    (its thread count and OpenMP wait policy, read inside it)."""

    def __init__(self, checkpoint: str, feeds: dict[str, dict[str, np.ndarray]], threads: int) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kiln-bench-torch-")
        path = Path(self._dir.name) / "feeds.npz"
        arrays: dict[str, Any] = {
            f"{kind}/{name}": array for kind, kind_feeds in feeds.items() for name, array in kind_feeds.items()
        }
        np.savez(path, **arrays)
        command = [sys.executable, "-m", "kiln.runtime.torch_row", checkpoint, str(path), str(threads)]
        self._proc = _spawn(command, worker_env(threads))
        self._kinds = tuple(feeds)
        try:
            self.info: dict[str, Any] = self._answer()
        except BaseException:  # a signal while it loads: it must not outlive its feeds (FileNotFoundError there)
            self.stop()
            raise

    def calls(self) -> dict[str, SelfTimed]:
        return {kind: _Call(self, kind) for kind in self._kinds}

    def call(self, kind: str) -> float:
        assert self._proc.stdin is not None
        self._proc.stdin.write(kind + "\n")
        self._proc.stdin.flush()
        seconds: float = self._answer()["seconds"]
        return seconds

    def _answer(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait()
            raise BenchError(
                f"the PyTorch row's worker process exited with code {code} (its error is above); pass --no-torch "
                "to bench without it"
            )
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            self.close()
            raise BenchError(f"the PyTorch row: {answer['error']}; pass --no-torch to bench without it")
        return answer

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.close()  # the worker ends at the end of its input
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._dir.cleanup()

    def stop(self) -> None:
        """End the worker now (an error or a signal in the bench: no waiting for it to finish
        loading), then remove its feeds: it never reads a file that is gone."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._dir.cleanup()


def _serve(checkpoint: str, feeds_path: str, threads: int, commands: IO[str], answers: IO[str]) -> None:
    """The worker: load the model, report itself, then run one call per command line."""
    import torch

    from kiln.exporter.contract.io import GraphKind
    from kiln.exporter.runners import TorchRunner
    from kiln.plugins import load_model

    def say(**answer: Any) -> None:
        answers.write(json.dumps(answer) + "\n")
        answers.flush()

    try:
        loaded = load_model(checkpoint)
    except KilnError as exc:
        say(error=str(exc))
        return
    torch.set_num_threads(threads)
    runner = TorchRunner(loaded.module, loaded.spec.n_layers)
    with open_input(Path(feeds_path), BenchError, None) as file, np.load(file) as data:  # never a FIFO or a device
        feeds: dict[str, dict[str, np.ndarray]] = {}
        for key in data.files:
            kind, name = key.split("/", 1)
            feeds.setdefault(kind, {})[name] = data[key]
    say(threads=torch.get_num_threads(), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"), pid=os.getpid())
    for line in commands:
        kind = line.strip()
        start = time.perf_counter()
        runner.run(GraphKind(kind), feeds[kind])
        say(seconds=time.perf_counter() - start)


def _main() -> None:
    """The worker process: quiet on signals (the bench reports them, in one line) and when the
    bench is gone (its pipe closed)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches it too: the bench ends it
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(128 + signum))  # no traceback, even in torch's import
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")  # the protocol's own copy of stdout
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything else printed goes to stderr
    try:
        _serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.stdin, answers)
    except BrokenPipeError:  # the bench ended (killed): nobody to answer
        os._exit(1)


if __name__ == "__main__":
    _main()
