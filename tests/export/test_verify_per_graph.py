"""Two weak spots of the fault tests (issue 40, "Still refused"), made through kiln's own code paths:
``kiln verify`` holds the manifest's precision to every graph of a set, not to the union of their
kinds (an int8 export with the fp32 export's decode.onnx, every hash and record recomputed), and a
refusal with more than five failures still names every failing graph and the step where
generation first diverged (decode's positions read one ahead: many tensor failures first).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.errors import ParityError
from kiln.exporter import graphs
from kiln.exporter.artifacts.hashing import hash_tree
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.parity.failure import ParityFailure
from kiln.exporter.parity.summary import shown_failures
from kiln.exporter.pipeline import export
from kiln_testing import tiny_config, write_checkpoint

STEPS = 6
_DIFFER = "exported graphs differ from PyTorch: "


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One checkpoint and its fp32 and int8 exports (the same graph I/O: only their Q/DQ differ)."""
    root = tmp_path_factory.mktemp("per_graph")
    ckpt = write_checkpoint(root / "ckpt", tiny_config(), seed=3)
    export(ckpt, root / "fp32", ExportOptions.from_flags(parity_tokens=STEPS))
    int8 = ExportOptions.from_flags(
        precision=Precision.INT8, calib_data="synthetic", calib_samples=2, parity_tokens=STEPS
    )
    export(ckpt, root / "int8", int8)
    return root


def _swapped(root: Path, into: str, source: str, kind: str, tmp_path: Path) -> Path:
    """``into``'s export with ``source``'s graph of ``kind`` (its weights in a file of its own), the
    manifest's record of that graph copied from ``source``'s and every hash recomputed."""
    directory = tmp_path / into
    shutil.copytree(root / into, directory)
    manifest = json.loads((root / source / "manifest.json").read_text())
    file = manifest["graphs"][kind]["file"]
    graph = onnx.load(root / source / file)
    onnx.save(graph, directory / file, save_as_external_data=True, location=f"{Path(file).stem}.swapped.bin")
    path = directory / "manifest.json"
    data = json.loads(path.read_text())
    data["graphs"][kind] = manifest["graphs"][kind]
    data["files"] = hash_tree(directory, exclude=("manifest.json",))
    path.write_text(json.dumps(data))
    return directory


def test_the_unswapped_exports_pass_verify(exports: Path) -> None:
    """The control: both exports as written pass ``kiln verify`` (the per-graph rule refuses no correct set)."""
    for name in ("fp32", "int8"):
        result = CliRunner().invoke(main, ["verify", str(exports / name)])
        assert result.exit_code == 0, (name, result.output)


@pytest.mark.parametrize(
    "kind", ["decode", "model", "prefill"], ids=["fp32-decode-in-int8", "fp32-model-in-int8", "fp32-prefill-in-int8"]
)
def test_a_graph_of_another_precision_is_refused_by_verify_by_name(exports: Path, tmp_path: Path, kind: str) -> None:
    """One graph of the other precision, its record and hashes made to match: its set's union of
    kinds is the manifest's (fp32 + int8 = int8), so only the graph by graph rule refuses it, in one
    line naming the graph file, what it shows and what the manifest claims."""
    directory = _swapped(exports, "int8", "fp32", kind, tmp_path)
    file = json.loads((directory / "manifest.json").read_text())["graphs"][kind]["file"]
    result = CliRunner().invoke(main, ["verify", str(directory)])
    assert result.exit_code == 1, result.output
    expected = f"precision is 'int8', but {file}, of the portable graphs, says 'fp32' (its QuantizeLinear, "
    assert expected in result.output, result.output
    assert "Traceback" not in result.output, result.output


def _position_ahead(model: ir.Model) -> None:
    """Every node of decode reads position_ids + 1 (as test_parity_faults.py's fault of that name):
    many of decode's tensors fail, and greedy generation through prefill + decode diverges."""
    graph = model.graph
    positions = next(value for value in graph.inputs if value.name == "position_ids")
    uses = list(positions.uses())
    assert uses, "decode reads position_ids"
    one = ir.node("Constant", [], {"value": ir.tensor(np.array(1, dtype=np.int64))})
    one.outputs[0].name = "fault.one"
    ahead = ir.node("Add", [positions, one.outputs[0]])
    ahead.outputs[0].name = "fault.positions"
    graph.insert_before(next(iter(graph)), [one, ahead])
    for node, index in uses:
        node.replace_input_with(index, ahead.outputs[0])


def test_a_refusal_with_many_tensor_failures_names_the_divergence_step(
    exports: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More than five failures, decode's tensors first: the message still starts with the first of
    them and names prefill + decode's generation run with its first divergence step."""
    made = graphs.fp32_graph

    def faulted(*args: object) -> ir.Model:
        model = made(*args)  # type: ignore[arg-type]
        if args[3] is GraphKind.DECODE:
            _position_ahead(model)
        return model

    monkeypatch.setattr(graphs, "fp32_graph", faulted)
    with pytest.raises(ParityError) as err:
        export(exports / "ckpt", tmp_path / "out", ExportOptions.from_flags(parity_tokens=STEPS))
    failures = str(err.value).split(_DIFFER, 1)[1].split("; ")
    assert failures[0].startswith("decode:"), failures
    diverged = [f for f in failures if f.startswith("generation via prefill+decode, batch ")]
    assert diverged and ", first divergence at step " in diverged[0], failures
    assert len(failures) == 5, failures


def _tensor(call: str, output: str, batch: int = 2) -> ParityFailure:
    label = f"{call}{' (batch 1)' if batch == 1 else ''}:{output}"
    return ParityFailure(kind="tensor", subject=call, check=label, message="max abs 1")


def _run(path: str, batch: int, step: int) -> ParityFailure:
    message = f"token match 0.5 (at least 0.9), first divergence at step {step}"
    return ParityFailure(kind="generation", subject=path, check=f"{path}, batch {batch}", message=message)


def _lines(failures: list[ParityFailure]) -> list[str]:
    return [failure.text for failure in failures]


def test_the_cut_keeps_the_first_of_each_graph_and_generation_path() -> None:
    """The first failure stays first; each graph's and generation path's first is kept even past
    the limit; the rest fill up to it in order; a short list is kept whole."""
    tensors = [_tensor("decode", f"present.{i}.key") for i in range(6)] + [_tensor("decode", "logits", batch=1)]
    later = [
        _tensor("model (empty cache)", "logits", batch=1),
        _tensor("prefill.ort", "logits"),
        _run("prefill+decode", 2, 2),
        _run("prefill+decode", 1, 3),
        _run("ort:prefill+decode", 2, 1),
    ]
    assert later[0].text == "model (empty cache) (batch 1):logits max abs 1"
    assert later[2].text == (
        "generation via prefill+decode, batch 2: token match 0.5 (at least 0.9), first divergence at step 2"
    )
    shown = shown_failures(tensors + later)
    assert shown == _lines([tensors[0], *later[:3], later[4]]), shown
    assert shown_failures(tensors[:3] + later[2:3]) == _lines(tensors[:3] + later[2:3])
    assert shown_failures(tensors) == _lines(tensors[:5]), shown_failures(tensors)
    quantized = [f.against("against the calibrated Q/DQ model") for f in tensors] + tensors[:1]
    assert quantized[0].text == "against the calibrated Q/DQ model: decode:present.0.key max abs 1"
    assert shown_failures(quantized) == _lines([*quantized[:4], tensors[0]]), shown_failures(quantized)
    assert shown_failures([]) == []
