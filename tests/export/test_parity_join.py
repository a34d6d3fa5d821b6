"""Parity's batches joined (issue 24 item 3): the candidate runs batch 1 and the padded batch as
one greedy run (model.onnx: one chunked run on its tokens), judged batch by batch; batch 1 is
still proved, by every graph's tensors on its unpadded row alone.

A candidate runner that records the batch of every call, and one that is wrong only at batch 1 (a
graph whose batch-1 kernel differs, which the joined runs never call): the first shows the calls
(tensors at batch 2 and 1, then each path's steps at batch 4), the second is refused by name.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.exporter.artifacts.manifest import Manifest, graph_options
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.load import prepare_reference
from kiln.exporter.options import ExportOptions
from kiln.exporter.parity import Candidate, ParityResult, ParitySettings, check_parity
from kiln.exporter.pipeline import export
from kiln.exporter.runners import OrtRunner, Runner
from kiln.exporter.runners.base import Feeds
from kiln.exporter.tolerance import FP32
from kiln.plugins import load_model
from kiln_testing import tiny_config, write_checkpoint

STEPS = 6


class _Watched:
    """An ONNX Runtime runner that records (graph, batch) of each call and may change outputs."""

    def __init__(
        self, inner: Runner, calls: list[tuple[str, int]], change: Callable[[int, Feeds], None] | None
    ) -> None:
        self.name, self._inner, self._calls, self._change = inner.name, inner, calls, change

    def graphs(self) -> tuple[GraphKind, ...]:
        return self._inner.graphs()

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        batch = len(feeds["input_ids"])
        self._calls.append((kind.value, batch))
        out = {name: np.array(value) for name, value in self._inner.run(kind, feeds).items()}
        if self._change is not None:
            self._change(batch, out)
        return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("join")
    export(
        write_checkpoint(root / "ckpt", tiny_config(), seed=3),
        root / "out",
        ExportOptions.from_flags(parity_tokens=STEPS),
    )
    return root


def _parity(
    root: Path, calls: list[tuple[str, int]], change: Callable[[int, Feeds], None] | None = None, max_batch: int = 8
) -> ParityResult:
    options = graph_options(Manifest.from_json(json.loads((root / "out" / "manifest.json").read_text())))
    paths = {
        kind: root / "out" / "onnx" / f"{'model' if kind is GraphKind.UNIFIED else kind.value}.onnx"
        for kind in (GraphKind.PREFILL, GraphKind.DECODE, GraphKind.UNIFIED)
    }

    @contextlib.contextmanager
    def opened() -> Iterator[Runner]:
        with OrtRunner.opener(paths)() as runner:
            yield _Watched(runner, calls, change)

    loaded = load_model(root / "ckpt")
    assert options.graphs.max_context is not None
    settings = ParitySettings(options.graphs.max_context, max_batch, STEPS, options.graphs.last_logits_only)
    return check_parity(
        prepare_reference(loaded, options), loaded.spec, [Candidate(opened, tuple(paths), "fp32", FP32)], settings
    )


def test_the_batches_run_joined_and_batch_one_is_checked_by_tensors(exported: Path) -> None:
    calls: list[tuple[str, int]] = []
    result = _parity(exported, calls)
    assert result.passed, result.failures()
    graphs = ["prefill", "decode", "model"]
    # graph by graph (parity.schedule: a runner holding one session at a time opens each once): prefill's tensors
    # (batch 2, then its unpadded row) and the greedy run's prompt step, all four rows; the greedy run's decode steps
    # and decode's tensors; model.onnx's tensors (and from an empty cache), then the prompt and those tokens in one call
    assert calls == (
        [("prefill", 2), ("prefill", 1), ("prefill", 4)]
        + [("decode", 4)] * (STEPS - 1)
        + [("decode", 2), ("decode", 1)]
        + [("model", 2), ("model", 2), ("model", 1), ("model", 1), ("model", 4), ("model", 4)]
    ), calls
    assert [g for g, _ in calls] == sorted((g for g, _ in calls), key=graphs.index), "each graph's runs together"
    assert [g.label for g in result.generation] == [
        "prefill+decode, batch 1",
        "model, batch 1",
        "prefill+decode, batch 3",
        "model, batch 3",
    ]
    assert [g.prompt_lengths for g in result.generation] == [(12,), (12,), (12, 8, 5), (12, 8, 5)]
    assert {(t.graph, t.batch) for t in result.tensors} == {
        (g, b) for g in ("prefill", "decode", "model") for b in (1, 2)
    }


def test_a_graph_wrong_only_at_batch_one_is_refused(exported: Path) -> None:
    def wrong_at_one(batch: int, out: Feeds) -> None:
        if batch == 1:
            out["logits"] += 0.5

    result = _parity(exported, [], wrong_at_one)
    assert not result.passed
    failed = [line.split(" max abs")[0] for line in result.failures()]
    assert failed == [
        "prefill (batch 1):logits",
        "decode (batch 1):logits",
        "model (batch 1):logits",
        "model (empty cache) (batch 1):logits",
    ], failed


def test_batches_beyond_the_max_batch_run_apart(exported: Path) -> None:
    """At --max-batch 3 the four rows would exceed the graphs' batch (a TensorRT profile's):
    each batch runs on its own, as before."""
    calls: list[tuple[str, int]] = []
    assert _parity(exported, calls, max_batch=3).passed
    assert {batch for graph, batch in calls if graph == "decode"} >= {1, 3} and all(batch <= 3 for _, batch in calls)


def test_no_call_exceeds_a_max_batch_of_one(exported: Path) -> None:
    """At --max-batch 1 (an engine profile's end) every call is batch 1: the tensors on the
    unpadded row only, the padded run a shorter prompt padded at batch 1."""
    calls: list[tuple[str, int]] = []
    result = _parity(exported, calls, max_batch=1)
    assert result.passed, result.failures()
    assert {batch for _, batch in calls} == {1} and {t.batch for t in result.tensors} == {1}
    assert [g.label for g in result.generation][2:] == [
        "prefill+decode, batch 1, 8 (padded to 12)",
        "model, batch 1, 8 (padded to 12)",
    ]
