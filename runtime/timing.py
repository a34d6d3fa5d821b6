"""Timing one graph call at fixed sizes (``Timed``), a set of them interleaved (``interleaved``),
and the vocabulary their token feeds draw from: what ``kiln bench`` and its past-length sweep share."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

from kiln.exporter.lora.adapter_file import read_adapter_file
from kiln.exporter.progress import NullProgress, Progress
from kiln.runtime.decoder_dirs import DecoderDir
from kiln.runtime.feeds import Sizes, build_feeds, declared_inputs
from kiln.runtime.torch_row import SelfTimed

__all__ = ["Timed", "interleaved", "interleaved_seconds", "medians_ms", "vocab_of"]


class Timed:
    """One graph of one directory bound to feeds at fixed sizes: calling it runs the graph once.
    For a shared-KV-buffer graph the presents are bound to the past buffers they alias, as the
    GenAI runtime does; otherwise ONNX Runtime allocates the outputs, as in any session.run."""

    def __init__(self, decoder: DecoderDir, sess: Any, sizes: Sizes, vocab: int) -> None:
        from onnxruntime import OrtValue

        sizes = dataclasses.replace(
            sizes, named=decoder.named_dims, capacity=sizes.total if decoder.shared_kv_buffer else None
        )
        feeds = build_feeds(declared_inputs(sess), sizes, vocab=vocab, roles=decoder.roles)
        if (
            decoder.adapter is not None
        ):  # the slot inputs (overridable initializers, not declared inputs) get the adapter's tensors
            assert decoder.manifest is not None, "only kiln exports take adapters (run_bench)"
            feeds |= read_adapter_file(decoder.adapter, decoder.manifest.lora, f"--adapter {decoder.adapter}")
        self._values = {name: OrtValue.ortvalue_from_numpy(array) for name, array in feeds.items()}
        self._binding = sess.io_binding()
        for name, value in self._values.items():
            self._binding.bind_ortvalue_input(name, value)
        for out in sess.get_outputs():
            alias = decoder.present_to_past.get(out.name)
            if alias in self._values:
                self._binding.bind_ortvalue_output(out.name, self._values[alias])
            else:
                self._binding.bind_output(out.name, "cpu")
        self._session = sess

    def __call__(self) -> None:
        self._session.run_with_iobinding(self._binding)


def interleaved(
    calls: dict[str, Callable[[], object]],
    runs: int,
    pause: float,
    warmup: int = 1,
    progress: Progress | None = None,
    what: str = "calls",
) -> dict[str, float]:
    """Median milliseconds of each call, the calls taken in turn ``runs`` times (a ``SelfTimed``
    call, the PyTorch row's worker, says how long it took itself)."""
    return medians_ms(interleaved_seconds(calls, runs, pause, warmup, progress, what))


def medians_ms(seconds: dict[str, list[float]]) -> dict[str, float]:
    """Each call's median in milliseconds, from its seconds."""
    return {name: statistics.median(t) * 1e3 for name, t in seconds.items()}


def interleaved_seconds(
    calls: dict[str, Callable[[], object]],
    runs: int,
    pause: float,
    warmup: int = 1,
    progress: Progress | None = None,
    what: str = "calls",
) -> dict[str, list[float]]:
    """The seconds of every call of ``interleaved`` (the bandwidth probe needs its fastest as well
    as its median). ``progress`` gets two stages named after ``what``: the warm-up, counted in
    calls (a row's first call can take long: the PyTorch worker's), then the runs, each one call
    of every row."""
    progress = progress or NullProgress()
    with progress.stage(f"{what} warm-up", total=warmup * len(calls)) as stage:
        for _ in range(warmup):
            for call in calls.values():
                call()
                stage.advance()
    times: dict[str, list[float]] = {name: [] for name in calls}
    with progress.stage(f"{what} runs", total=runs) as stage:
        for _ in range(runs):
            for name, call in calls.items():
                times[name].append(_seconds(call))
                time.sleep(pause)
            stage.advance()
    return times


def _seconds(call: Callable[[], object]) -> float:
    """One call's seconds, as it says itself when it is ``SelfTimed``."""
    if isinstance(call, SelfTimed):
        return call()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def vocab_of(sess: Any, decoder: DecoderDir) -> int:
    if decoder.manifest is not None:
        return decoder.manifest.model.vocab_size
    for out in sess.get_outputs():
        if out.name == "logits" and isinstance(out.shape[-1], int):
            return int(out.shape[-1])
    return 2  # token ids 0 and 1 exist in every vocabulary
