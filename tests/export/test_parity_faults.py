"""Faults parity must still refuse (issue 40, "Done means"), each made through kiln's own code paths:
a graph edited right after kiln's contract passes made it (``exporter.graphs.fp32_graph``) during a
real export, or a written export's graph replaced with its hashes recomputed, then ``kiln verify``
and ``kiln check``. A decode graph whose cache update skips a step, a decode graph of another
precision, a float graph with one causal-mask element opened. (An int4 scale off, a Q/DQ pair
dropped, an activation scale off and a wrong decode or chunk path: test_int4_proof.py,
test_check_int4.py, test_qdq_proof.py, test_parity_verify.py.)
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
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
from kiln.exporter.pipeline import export
from kiln_testing import tiny_config, write_checkpoint

STEPS = 6
_DIFFER = "exported graphs differ from PyTorch: "


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One checkpoint and its fp32 and fp16 exports, unfaulted: every fault below is made from these."""
    root = tmp_path_factory.mktemp("faults")
    ckpt = write_checkpoint(root / "ckpt", tiny_config(), seed=3)
    for name, precision in (("fp32", Precision.FP32), ("fp16", Precision.FP16)):
        export(ckpt, root / name, ExportOptions.from_flags(precision=precision, parity_tokens=STEPS))
    return root


@pytest.fixture(scope="module")
def int8_export(pristine: Path) -> Path:
    """``--int8`` of the same checkpoint (its graphs' I/O are fp32's: only their Q/DQ differ)."""
    options = ExportOptions.from_flags(
        precision=Precision.INT8, calib_data="synthetic", calib_samples=2, parity_tokens=STEPS
    )
    export(pristine / "ckpt", pristine / "int8", options)
    return pristine / "int8"


def _named(node: ir.Node, name: str) -> ir.Node:
    node.outputs[0].name = name
    return node


def _constant(name: str, value: int, shape: tuple[int, ...] = ()) -> ir.Node:
    return _named(ir.node("Constant", [], {"value": ir.tensor(np.full(shape, value, dtype=np.int64))}), name)


def _stale_key(model: ir.Model) -> None:
    """decode's present.0.key is the past and the past's last key again: the new position's key is
    never written (attention still reads it: only the cache carried to the next step skips it)."""
    graph = model.graph
    at = next(i for i, value in enumerate(graph.outputs) if value.name == "present.0.key")
    present = graph.outputs[at]
    past = present.producer().inputs[0]  # type: ignore[union-attr]
    assert past is not None and past.name == "past_key_values.0.key", past
    bounds = [_constant(f"fault.bound.{i}", v, (1,)) for i, v in enumerate((-1, 2**62, 2))]
    last = _named(ir.node("Slice", [past, *(b.outputs[0] for b in bounds)]), "fault.last_key")
    stale = ir.node("Concat", [past, last.outputs[0]], {"axis": 2})
    graph.extend([*bounds, last, stale])
    present.name = "fault.attended_keys"
    written = stale.outputs[0]
    written.name, written.type, written.shape = "present.0.key", present.type, present.shape
    graph.outputs[at] = written


def _position_ahead(model: ir.Model) -> None:
    """Every node of decode reads position_ids + 1: the new key is rotated (and the PLE row read) one
    position ahead of where it is written."""
    graph = model.graph
    positions = next(value for value in graph.inputs if value.name == "position_ids")
    uses = list(positions.uses())
    assert uses, "decode reads position_ids"
    one = _constant("fault.one", 1)
    ahead = _named(ir.node("Add", [positions, one.outputs[0]]), "fault.positions")
    graph.insert_before(next(iter(graph)), [one, ahead])
    for node, index in uses:
        node.replace_input_with(index, ahead.outputs[0])


def _opened(query: int, key: int) -> Callable[[ir.Model], None]:
    """The causal mask's element (``query``, ``key``) opened: the query at that cache index also
    attends to the key one past it (the traced ``LessOrEqual(key index, query index)``)."""

    def edit(model: ir.Model) -> None:
        graph = model.graph
        causal = [node for node in graph if node.op_type == "LessOrEqual"]
        assert len(causal) == 1, [node.name for node in causal]
        keys, queries = causal[0].inputs
        uses = list(causal[0].outputs[0].uses())
        at_key, at_query = _constant("fault.key", key), _constant("fault.query", query)
        is_key = _named(ir.node("Equal", [keys, at_key.outputs[0]]), "fault.is_key")
        is_query = _named(ir.node("Equal", [queries, at_query.outputs[0]]), "fault.is_query")
        both = _named(ir.node("And", [is_key.outputs[0], is_query.outputs[0]]), "fault.element")
        mask = _named(ir.node("Or", [causal[0].outputs[0], both.outputs[0]]), "fault.mask")
        graph.insert_after(causal[0], [at_key, at_query, is_key, is_query, both, mask])
        for node, index in uses:
            node.replace_input_with(index, mask.outputs[0])

    return edit


def _refused_export(
    root: Path, out: Path, monkeypatch: pytest.MonkeyPatch, kind: GraphKind, edit: Callable[[ir.Model], None]
) -> str:
    """``export`` of the pristine checkpoint with ``kind``'s fp32 graph edited: its ParityError's message."""
    made = graphs.fp32_graph

    def faulted(*args: object) -> ir.Model:
        model = made(*args)  # type: ignore[arg-type]
        if args[3] is kind:
            edit(model)
        return model

    monkeypatch.setattr(graphs, "fp32_graph", faulted)
    with pytest.raises(ParityError) as err:
        export(root / "ckpt", out, ExportOptions.from_flags(parity_tokens=STEPS))
    assert not out.exists(), "a refused export leaves nothing"
    message = str(err.value)
    assert message.startswith(f"parity: {out}: {_DIFFER}"), message
    return message


def test_the_pristine_exports_pass(pristine: Path) -> None:
    """The control: unfaulted, both exports passed parity (``export`` raises otherwise) and verify."""
    for name in ("fp32", "fp16"):
        assert json.loads((pristine / name / "reports" / "parity.json").read_text())["passed"], name
        result = CliRunner().invoke(main, ["verify", str(pristine / name)])
        assert result.exit_code == 0, result.output


@pytest.mark.parametrize("edit", [_stale_key, _position_ahead], ids=["stale-key", "position-ahead"])
def test_a_decode_cache_update_that_skips_a_step_is_refused_by_path_and_step(
    pristine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: Callable[[ir.Model], None]
) -> None:
    """decode alone faulted: its tensors fail first, and prefill + decode's generation diverges at a
    named step; prefill and model.onnx (the same trace, unfaulted) are not blamed. The refusal keeps the
    first failure of each graph and each generation path (``parity.summary``): position-ahead fails five of
    decode's tensors, and its divergence (prefill + decode, batch 3, step 2 here) is still named."""
    message = _refused_export(pristine, tmp_path / "out", monkeypatch, GraphKind.DECODE, edit)
    failures = message.split(_DIFFER, 1)[1].split("; ")
    assert failures[0].startswith("decode:") and len(failures) <= 5, failures
    assert all(
        f.startswith(("decode:", "decode (batch 1):", "generation via prefill+decode, batch ")) for f in failures
    )
    diverged = [f for f in failures if f.startswith("generation via ")]
    assert diverged and all(", first divergence at step " in f for f in diverged), failures


@pytest.mark.parametrize(
    ("kind", "element"),
    [(GraphKind.PREFILL, (0, 1)), (GraphKind.UNIFIED, (6, 7))],
    ids=["prefill-query-0", "model-query-6"],
)
def test_one_causal_mask_element_opened_is_refused_by_graph(
    pristine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: GraphKind, element: tuple[int, int]
) -> None:
    """One query sees one future key, in one float graph: that graph's tensors fail, by name."""
    message = _refused_export(pristine, tmp_path / "out", monkeypatch, kind, _opened(*element))
    failures = message.split(_DIFFER, 1)[1].split("; ")
    assert failures[0].startswith(f"{kind.value}:logits max abs "), failures
    assert all(f.startswith((kind.value, "generation via")) for f in failures), failures


def test_a_unified_mask_element_opened_at_the_prompt_is_refused(
    pristine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Query 0 sees key 1 in model.onnx alone: only its prompt call from an empty cache reads that
    element (its check with a past has queries 6-9), and that call's tensors fail, named so."""
    message = _refused_export(pristine, tmp_path / "out", monkeypatch, GraphKind.UNIFIED, _opened(0, 1))
    failures = message.split(_DIFFER, 1)[1].split("; ")
    assert failures[0].startswith("model (empty cache):logits max abs "), failures
    assert all(f.startswith(("model (empty cache)", "generation via model")) for f in failures), failures


def _swapped(pristine: Path, into: str, source: str, tmp_path: Path, records: bool) -> Path:
    """``into``'s export with ``source``'s decode.onnx (its weights in a file of its own), every hash
    recomputed; with ``records``, the manifest's decode entry copied from ``source``'s as well."""
    directory = tmp_path / into
    shutil.copytree(pristine / into, directory)
    decode = onnx.load(pristine / source / "onnx" / "decode.onnx")
    onnx.save(decode, directory / "onnx" / "decode.onnx", save_as_external_data=True, location="decode.bin")
    path = directory / "manifest.json"
    data = json.loads(path.read_text())
    if records:
        data["graphs"]["decode"] = json.loads((pristine / source / "manifest.json").read_text())["graphs"]["decode"]
    data["files"] = hash_tree(directory, exclude=("manifest.json",))
    path.write_text(json.dumps(data))
    return directory


@pytest.mark.parametrize(("into", "source"), [("fp16", "fp32"), ("fp32", "fp16")], ids=["fp32-in-fp16", "fp16-in-fp32"])
def test_a_decode_graph_of_another_precision_is_refused_by_verify_and_check(
    pristine: Path, tmp_path: Path, into: str, source: str
) -> None:
    """The swapped graph's cache dtypes differ from the I/O the manifest records for decode; with
    that record copied too, the set's precision or KV dtype differs from the manifest's claim."""
    dtypes = {"fp32": "'float32'", "fp16": "'float16'"}
    verify = CliRunner().invoke(main, ["verify", str(_swapped(pristine, into, source, tmp_path / "io", False))])
    assert verify.exit_code == 1, verify.output
    expected = (
        "graph onnx/decode.onnx: its inputs are not the ones the manifest records (#3: the graph has "
        f"('past_key_values.0.key', {dtypes[source]}, ('batch', 2, 'past_seq', 8)), the manifest "
        f"('past_key_values.0.key', {dtypes[into]}, "
    )
    assert expected in verify.output, verify.output
    check = CliRunner().invoke(main, ["check", str(_swapped(pristine, into, source, tmp_path / "claims", True))])
    lines = check.stderr.strip().splitlines()
    assert check.exit_code == 1 and lines[-1].startswith("error: artifacts: "), (check.exit_code, check.stderr)
    assert "Traceback" not in check.stderr and len(lines) == 1, check.stderr
    claim = f"kv_cache.dtype is {dtypes[into]}, but the portable graphs say 'float16+float32' (the dtype of their past"
    assert claim in lines[-1], lines[-1]
    if into == "fp16":
        assert "precision is 'fp16', but the portable graphs say 'fp32'" in lines[-1], lines[-1]


def test_a_float_decode_in_an_int8_export_is_refused_by_check(int8_export: Path, tmp_path: Path) -> None:
    """The fp32 decode.onnx in an int8 export: the same I/O, so the manifest's records hold; kiln check
    refuses it at its verify step, graph by graph: decode shows none of int8's nodes."""
    pristine = int8_export.parent
    swapped = _swapped(pristine, "int8", "fp32", tmp_path, True)
    check = CliRunner().invoke(main, ["check", str(swapped)])
    lines = check.stderr.strip().splitlines()
    assert check.exit_code == 1 and lines and "Traceback" not in check.stderr, (check.exit_code, check.stderr)
    assert lines[-1].endswith(
        "precision is 'int8', but onnx/decode.onnx, of the portable graphs, says 'fp32' (its QuantizeLinear, "
        f"DequantizeLinear and MatMulNBits, and its float type); run kiln verify {swapped}"
    ), lines[-1]
