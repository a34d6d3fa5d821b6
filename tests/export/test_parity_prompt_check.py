"""model.onnx's tensor check from an empty cache (``parity.tensors.prompt_check``): its feeds are
prefill's tensor feeds with an empty past, and its reference is prefill's recorded outputs (no
PyTorch call of its own) where prefill returns every position's logits; with ``--logits last`` it
is one unified forward. Either way the reference is what PyTorch's unified contract computes there."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.parity.results import TensorCheck
from kiln.exporter.parity.tensors import empty_cache, prompt_check, tensor_feeds
from kiln.exporter.runners import RecordingRunner, TorchRunner
from kiln.exporter.runners.base import Feeds
from kiln.plugins import LoadedModel, load_model
from kiln_testing import tiny_config, write_checkpoint


class _Counted:
    """A runner that lists the graph kinds it was asked to run."""

    def __init__(self, inner: TorchRunner) -> None:
        self.name, self._inner, self.calls = inner.name, inner, list[GraphKind]()

    def graphs(self) -> tuple[GraphKind, ...]:
        return self._inner.graphs()

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        self.calls.append(kind)
        return self._inner.run(kind, feeds)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(write_checkpoint(tmp_path_factory.mktemp("prompt") / "ckpt", tiny_config(), seed=3))


@pytest.mark.parametrize("single_row", [False, True], ids=["batch-2", "batch-1"])
def test_prompt_check_reuses_prefill_and_equals_the_unified_contract(loaded: LoadedModel, single_row: bool) -> None:
    spec, f32 = loaded.spec, np.dtype(np.float32)
    counted = _Counted(TorchRunner(loaded.module, spec.n_layers))
    recorder = RecordingRunner(counted)
    prefill = tensor_feeds(spec, GraphKind.PREFILL, 0, f32, recorder, single_row=single_row)
    recorder.run(GraphKind.PREFILL, prefill)
    feeds, want = prompt_check(recorder, spec, 0, f32, single_row=single_row)
    assert counted.calls == [GraphKind.PREFILL], counted.calls  # prefill's recorded outputs, nothing more
    assert empty_cache(GraphKind.UNIFIED, feeds), sorted(feeds)
    assert not empty_cache(GraphKind.UNIFIED, tensor_feeds(spec, GraphKind.UNIFIED, 0, f32, recorder))
    assert np.array_equal(feeds["input_ids"], prefill["input_ids"]) and feeds["past_key_values.0.key"].shape[2] == 0
    unified = TorchRunner(loaded.module, spec.n_layers).run(GraphKind.UNIFIED, feeds)
    assert sorted(want) == sorted(unified), (sorted(want), sorted(unified))
    for name, value in unified.items():
        np.testing.assert_allclose(want[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_with_last_logits_only_the_prompt_check_runs_the_unified_contract(loaded: LoadedModel) -> None:
    spec, f32 = loaded.spec, np.dtype(np.float32)
    counted = _Counted(TorchRunner(loaded.module, spec.n_layers, last_logits_only=True))
    feeds, want = prompt_check(counted, spec, 0, f32, single_row=False)
    assert counted.calls == [GraphKind.PREFILL, GraphKind.UNIFIED], counted.calls
    assert want["logits"].shape[:2] == feeds["input_ids"].shape, want["logits"].shape  # every position's logits


def test_only_the_unified_graph_without_a_past_is_named_apart() -> None:
    """A failure says which of model.onnx's two calls failed: the label names the empty-cache one."""
    feeds = {"input_ids": np.zeros((1, 3), np.int64), "attention_mask": np.ones((1, 5), np.int64)}
    prompt = {**feeds, "attention_mask": np.ones((1, 3), np.int64)}
    assert not empty_cache(GraphKind.UNIFIED, feeds) and not empty_cache(GraphKind.PREFILL, prompt)
    check = TensorCheck("model", "logits", 1.0, 1.0, 0.5, None, 0.0, 0.0, 1.0, 1.0, False, batch=1)
    assert dataclasses.replace(check, empty_cache=True).label == "model (empty cache) (batch 1):logits"
    assert check.label == "model (batch 1):logits"
