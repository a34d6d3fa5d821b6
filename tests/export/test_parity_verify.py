"""Parity verifies, it does not regenerate (issue 40 item 1): the graphs generate greedily (model.onnx
fed their tokens in two chunked calls), then PyTorch scores every row's whole sequence
teacher-forced in one batched forward, and each step is judged against its logits there.

On a tiny export: PyTorch's calls after the graphs ran are one forward for all four rows (or,
with a smaller logits budget, chunks of positions carried through the cache, to the same
verdict and figures); a decode graph that chooses wrong tokens, or a model.onnx wrong only on
its chunk of generated tokens, is refused by path; and the model is freed while the graphs run
and loaded again to score when the memory rule says so, the stage label saying which.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.exporter.artifacts.manifest import Manifest, graph_options
from kiln.exporter.check import check_dir
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.load import prepare_reference
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.parity import Candidate, ParityResult, ParitySettings, check_parity, driver, scoring
from kiln.exporter.pipeline import export
from kiln.exporter.precision.kinds import Int4
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln.exporter.runners import OrtRunner, Runner, TorchRunner
from kiln.exporter.runners.base import Feeds
from kiln.exporter.tolerance import FP32
from kiln.plugins import load_model
from kiln_testing import RecordedProgress, tiny_config, write_checkpoint

STEPS = 6
LENGTH = 12  # parity_plan's longest prompt at the tiny model's context


class _Changed:
    """An ONNX Runtime runner whose outputs ``change`` may alter (kind, feeds, outputs)."""

    def __init__(self, inner: Runner, change: Callable[[GraphKind, Feeds, Feeds], None] | None) -> None:
        self.name, self._inner, self._change = inner.name, inner, change

    def graphs(self) -> tuple[GraphKind, ...]:
        return self._inner.graphs()

    def run(self, kind: GraphKind, feeds: Feeds) -> Feeds:
        out = {name: np.array(value) for name, value in self._inner.run(kind, feeds).items()}
        if self._change is not None:
            self._change(kind, feeds, out)
        return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("verify")
    export(
        write_checkpoint(root / "ckpt", tiny_config(), seed=3),
        root / "out",
        ExportOptions.from_flags(parity_tokens=STEPS),
    )
    return root


@pytest.fixture
def torch_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, ...]]]:
    """Every PyTorch forward parity makes: (graph contract, input_ids shape)."""
    calls: list[tuple[str, tuple[int, ...]]] = []
    run = TorchRunner.run

    def counted(self: TorchRunner, kind: GraphKind, feeds: Feeds) -> Feeds:
        calls.append((kind.value, tuple(feeds["input_ids"].shape)))
        return run(self, kind, feeds)

    monkeypatch.setattr(TorchRunner, "run", counted)
    return calls


def _parity(
    root: Path,
    events: list[object],
    change: Callable[[GraphKind, Feeds, Feeds], None] | None = None,
    progress: RecordedProgress | None = None,
    reload: bool = False,
) -> ParityResult:
    options = graph_options(Manifest.from_json(json.loads((root / "out" / "manifest.json").read_text())))
    paths = {
        kind: root / "out" / "onnx" / f"{'model' if kind is GraphKind.UNIFIED else kind.value}.onnx"
        for kind in (GraphKind.PREFILL, GraphKind.DECODE, GraphKind.UNIFIED)
    }

    @contextlib.contextmanager
    def opened() -> Iterator[Runner]:
        events.append("open")
        with OrtRunner.opener(paths)() as runner:
            yield _Changed(runner, change)

    def reloaded() -> object:
        events.append("reload")
        return prepare_reference(load_model(root / "ckpt"), options)

    loaded = load_model(root / "ckpt")
    assert options.graphs.max_context is not None
    settings = ParitySettings(options.graphs.max_context, 8, STEPS, options.graphs.last_logits_only)
    hooks = {"release_reference": lambda: events.append("release"), "reload_reference": reloaded} if reload else {}
    candidates = [Candidate(opened, tuple(paths), "fp32", FP32)]
    return check_parity(
        prepare_reference(loaded, options), loaded.spec, candidates, settings, progress=progress, **hooks
    )  # type: ignore[arg-type]


def test_pytorch_scores_every_row_in_one_forward(
    exported: Path, torch_calls: list[tuple[str, tuple[int, ...]]]
) -> None:
    """Both paths' rows (the same four sequences: model.onnx is fed prefill + decode's tokens) are
    scored once, in one prefill forward of the prompt and every generated token but the last."""
    result = _parity(exported, [])
    assert result.passed, result.failures()
    # each graph's tensor feeds at batch 2 and 1 (decode's and model's past: PyTorch's prefill of other tokens, recorded
    # once; model's prompt call from an empty cache is judged against prefill's recorded outputs: no call of its own)
    tensors = [("prefill", (2, 7)), ("prefill", (1, 7)), ("prefill", (2, 9)), ("decode", (2, 1)), ("decode", (1, 1))]
    tensors += [("prefill", (2, 6)), ("model", (2, 4)), ("model", (1, 4))]
    assert torch_calls == [*tensors, ("prefill", (4, LENGTH + STEPS - 1))], torch_calls
    prompt = [(t.batch, t.output) for t in result.tensors if t.graph == "model" and t.empty_cache]
    assert [batch for batch, output in prompt if output == "logits"] == [2, 1], prompt
    assert [g.steps for g in result.generation] == [STEPS] * 4 and all(
        g.token_match_rate == 1.0 for g in result.generation
    )


def test_chunked_scoring_gives_the_same_verdict(
    exported: Path, torch_calls: list[tuple[str, tuple[int, ...]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A logits budget of 8 positions: each row alone, in chunks of 8 positions (prefill, then the
    unified contract with the cache); every step's figures as one forward's, to float rounding."""
    whole = _parity(exported, [])
    spec = load_model(exported / "ckpt").spec
    monkeypatch.setattr(scoring, "LOGITS_BYTES", 4 * spec.vocab_size * 8)
    torch_calls.clear()
    chunked = _parity(exported, [])
    assert torch_calls[8:] == [("prefill", (1, 8)), ("model", (1, 8)), ("model", (1, 1))] * 4, torch_calls[8:]
    assert chunked.passed, chunked.failures()
    for a, b in zip(whole.generation, chunked.generation, strict=True):
        assert a.per_step_match == b.per_step_match and np.allclose(
            a.per_step_max_abs, b.per_step_max_abs, atol=1e-5
        ), (a, b)


def _negated_decode(kind: GraphKind, feeds: Feeds, out: Feeds) -> None:
    if (
        kind is GraphKind.DECODE and len(feeds["input_ids"]) == 4
    ):  # the generation run only: tensor checks run batch 2 and 1
        out["logits"] = -out["logits"]  # the argmin chosen: never the reference's argmax


def _shifted_chunk(kind: GraphKind, feeds: Feeds, out: Feeds) -> None:
    if kind is GraphKind.UNIFIED and feeds["input_ids"].shape == (
        4,
        STEPS - 1,
    ):  # model.onnx's chunk of generated tokens only
        out["logits"] = np.roll(out["logits"], 1, axis=-1)


@pytest.mark.parametrize(("change", "failing"), [(_negated_decode, "prefill+decode"), (_shifted_chunk, "model")])
def test_a_wrong_graph_path_is_refused_by_name(
    exported: Path, change: Callable[[GraphKind, Feeds, Feeds], None], failing: str
) -> None:
    """A decode graph that picks wrong tokens diverges at step 1 (model.onnx, fed those tokens,
    still agrees with PyTorch at each of their prefixes); a model.onnx wrong only on the generated
    tokens' chunk diverges at step 1 too, prefill + decode passing."""
    result = _parity(exported, [], change)
    failures = result.failures()
    assert not result.passed and len(failures) == 2 and all(t.passed for t in result.tensors), failures
    assert all(
        line.startswith(f"generation via {failing}, batch ") and "first divergence at step " in line
        for line in failures
    ), failures
    assert [(g.path, g.first_divergence is None) for g in result.generation if g.path != failing] == [
        (g.path, True) for g in result.generation if g.path != failing
    ]


@pytest.mark.parametrize("kept", [True, False])
def test_the_model_is_freed_while_the_graphs_run_unless_both_fit(
    exported: Path, kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept (both fit): the graphs run beside it, and it is freed once it has scored. Not kept: it
    is freed before the graphs' session opens and loaded again after it closed, to score."""
    monkeypatch.setattr(driver, "keeps_model", lambda module, weight_bytes: kept)
    events: list[object] = []
    progress = RecordedProgress()
    result = _parity(exported, events, progress=progress, reload=True)
    assert result.passed, result.failures()
    assert events == (["open", "release"] if kept else ["release", "open", "reload"]), events
    label = f"parity: PyTorch scores the graphs' tokens ({'model kept in memory' if kept else 'model loaded again'})"
    assert label in progress.stages, progress.stages


@pytest.mark.parametrize("int4", [False, True])
def test_an_export_and_its_check_load_the_model_again_when_it_does_not_fit(
    tmp_path: Path, int4: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kiln export`` and ``kiln check`` with the memory rule saying no: the model is loaded again
    from the checkpoint to score, and (int4, ``--target ort``) that same module is then made the
    quantized model, against which every graph set is judged as when it is kept."""
    monkeypatch.setattr(driver, "keeps_model", lambda module, weight_bytes: False)
    precision = (
        {"precision": Precision.of(Int4(method=Int4Method.RTN)), "target": "ort", "parity_agreement": "record"}
        if int4
        else {}
    )
    progress = RecordedProgress()
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config(), seed=3)
    options = ExportOptions.from_flags(parity_tokens=STEPS, **precision)  # type: ignore[arg-type]
    result = export(ckpt, tmp_path / "out", options, progress)
    assert result.parity.passed, result.parity.failures()
    assert "parity: PyTorch scores the graphs' tokens (model loaded again)" in progress.stages, progress.stages
    assert (
        result.parity.quantized is not None
        and result.parity.quantized.passed
        and "ort" in result.parity.quantized.targets
    ) == int4
    checked = check_dir(tmp_path / "out", progress=progress)
    assert checked.passed and len(checked.generation) == len(result.parity.generation) == (8 if int4 else 4), (
        checked.failures()
    )
    assert progress.stages["parity: PyTorch scores the graphs' tokens (model loaded again)"][0] == 2, (
        progress.stages
    )  # the export's, then the check's
